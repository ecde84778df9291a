"""Does the vision tower's output say what colour and kind of shape each image token shows?

A least-squares linear probe, trained on 70% of the image tokens that hold a shape's centre and
scored on the rest, at two places: the merger's input (the tower's last block, each token's four
patches normalised, what the merger's MLP reads) and the merged tokens (what the language model
reads). If a model never picks the named shape among several, this tells whether the information
is missing in the tower, lost in the merger, or there and unused by the language model. Chance is
0.25 for colour (four) and 0.33 for kind (three).

    python bench/tiny_probe.py MODEL [MODEL ...] --n 600 [--out probe.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from groundtune.cli.flags import positive_int
from groundtune.data.synth import DEFAULT_PALETTE, make_sample, make_scene
from groundtune.models.loading import load_model
from groundtune.train.batches import encode_sample

sys.path.insert(0, str(Path(__file__).parent))
from provenance import measure_models


def probe(model: str, n: int) -> dict:
    gm = load_model(model, device="cpu", dtype="fp32")
    colours, kinds = list(DEFAULT_PALETTE.colours), list(DEFAULT_PALETTE.shapes)
    merger = gm.model.model.visual.merger
    seen = {}  # the merger MLP's input and output, in the tower's window order
    merger.mlp.register_forward_hook(lambda _m, args, out: seen.update(mlp_in=args[0], mlp_out=out))
    features = {"before_merger": [], "merged": []}
    colour_labels, kind_labels = [], []
    for i in range(n):
        image, record = make_sample(5, i, task="multi")
        scene = make_scene(5, i, task="multi")
        enc = encode_sample(gm.processor, gm.family, gm.resize, gm.prompt, image, record)
        with torch.no_grad():
            out = gm.model.model.visual(enc["pixel_values"], grid_thw=enc["image_grid_thw"])
        tokens = getattr(out, "pooler_output", out)
        tokens = torch.cat(list(tokens)) if isinstance(tokens, (list, tuple)) else tokens
        # the tower puts its tokens back in reading order after the merger: find each one's row
        window_row = torch.cdist(tokens.float(), seen["mlp_out"].float()).argmin(1)
        cols = int(enc["image_grid_thw"][0, 2]) // 2
        cell = image.width / cols  # pixels per merged token (the canvas is not resized at 112 px)
        for shape in scene.shapes:
            token = int(shape.cy // cell) * cols + int(shape.cx // cell)
            features["merged"].append(tokens[token].float().numpy())
            features["before_merger"].append(seen["mlp_in"][window_row[token]].float().numpy())
            colour_labels.append(colours.index(shape.colour))
            kind_labels.append(kinds.index(shape.kind))
    result = {"tokens": len(colour_labels)}
    for place, rows in features.items():
        result[place] = {"colour": probe_accuracy(rows, colour_labels, len(colours)),
                         "kind": probe_accuracy(rows, kind_labels, len(kinds))}
    return result


def probe_accuracy(rows: list[np.ndarray], labels: list[int], classes: int) -> float:
    """A least-squares linear probe fitted on the first 70% of the rows, scored on the rest."""
    x = np.c_[np.array(rows), np.ones(len(rows))]
    split = int(0.7 * len(x))
    w = np.linalg.lstsq(x[:split], np.eye(classes)[labels][:split], rcond=None)[0]
    return round(float((np.argmax(x[split:] @ w, 1) == np.array(labels[split:])).mean()), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+")
    parser.add_argument("--n", type=positive_int, default=600, help="scenes (1-3 shapes each)")
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args()
    torch.manual_seed(0)
    measure_models(parser, args.models, lambda model: probe(model, args.n), args.out)


if __name__ == "__main__":
    main()
