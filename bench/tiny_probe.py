"""Does the vision tower's output say what colour and kind of shape each image token shows?

A least-squares linear probe on the vision tower's output (the tokens the language model reads),
trained on 70% of the tokens that hold a shape's centre and scored on the rest. If a model never
picks the named shape among several, this tells whether the information is missing in the image
tokens or unused by the language model.

    python bench/tiny_probe.py MODEL [MODEL ...] --n 600
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from groundtune.train.batches import encode_sample
from groundtune.data.synth import DEFAULT_PALETTE, make_sample, make_scene
from groundtune.models.loading import load_model


def probe(model: str, n: int) -> dict:
    gm = load_model(model, device="cpu", dtype="fp32")
    colours, kinds = list(DEFAULT_PALETTE.colours), list(DEFAULT_PALETTE.shapes)
    features, colour_labels, kind_labels = [], [], []
    for i in range(n):
        image, record = make_sample(5, i, task="multi")
        scene = make_scene(5, i, task="multi")
        enc = encode_sample(gm.processor, gm.family, gm.resize, gm.prompt, image, record)
        with torch.no_grad():
            out = gm.model.model.visual(enc["pixel_values"], grid_thw=enc["image_grid_thw"])
        tokens = getattr(out, "pooler_output", out)
        tokens = torch.cat(list(tokens)) if isinstance(tokens, (list, tuple)) else tokens
        cols = int(enc["image_grid_thw"][0, 2]) // 2
        cell = image.width / cols  # pixels per merged token (the canvas is not resized at 112 px)
        for shape in scene.shapes:
            row, col = int(shape.cy // cell), int(shape.cx // cell)
            features.append(tokens[row * cols + col].float().numpy())
            colour_labels.append(colours.index(shape.colour))
            kind_labels.append(kinds.index(shape.kind))
    x = np.c_[np.array(features), np.ones(len(features))]
    split = int(0.7 * len(x))

    def accuracy(labels: list[int], k: int) -> float:
        y = np.eye(k)[labels]
        w = np.linalg.lstsq(x[:split], y[:split], rcond=None)[0]
        return float((np.argmax(x[split:] @ w, 1) == np.array(labels[split:])).mean())

    return {"tokens": len(x), "colour": round(accuracy(colour_labels, len(colours)), 3),
            "kind": round(accuracy(kind_labels, len(kinds)), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+")
    parser.add_argument("--n", type=int, default=600)
    args = parser.parse_args()
    torch.manual_seed(0)
    for model in args.models:
        print(model, probe(model, args.n))


if __name__ == "__main__":
    main()
