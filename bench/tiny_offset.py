"""Does a model's answer depend on where the text after the image sits? M-RoPE places the text after
an image past the image's largest side (``qwen.mrope_positions``), so the rotary phase between a
phrase and the image tokens moves with the canvas's size. On synth's full-task val scenes at 112,
168 and 224 px, the answer's loss (teacher-forced, nats per answer token) and the share of its
tokens predicted right: as placed, and with the text after a larger image placed as after a 112-px
one (its merged grid's 4 tokens a side). A model that matches content on phases alone loses much
when moved; one that does not, little.

    python bench/tiny_offset.py MODEL [MODEL ...] --n 120 [--answer-label] [--out offset.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from groundtune.cli.flags import positive_int
from groundtune.data.synth import make_sample
from groundtune.infer import load
from groundtune.models import qwen
from groundtune.train.batches import encode_sample

sys.path.insert(0, str(Path(__file__).parent))
from provenance import measure_models

SEED = 91  # scenes of synth's val split that no training stream draws
PLACED_AS = 4  # a 112-px canvas's merged grid, tokens a side


def answer_scores(gm, side: int, n: int, moved: bool, answer_label: bool) -> dict:
    right = total = 0
    loss = 0.0
    for index in range(n):
        image, sample = make_sample(SEED, index, side, side, task="full", split="val")
        encoded = encode_sample(gm.processor, gm.family, gm.resize, gm.prompt, image, sample, answer_label)
        positions = encoded["position_ids"].clone()
        if moved:  # the text after the image resumes past its merged grid's larger side (qwen.mrope_positions)
            image_tokens = encoded["input_ids"] == gm.processor.image_token_id
            end = int(image_tokens.nonzero()[-1]) + 1
            rows, cols = (int(patches) // gm.processor.merge_size for patches in encoded["image_grid_thw"][0][1:])
            positions[:, end:] -= max(rows, cols) - PLACED_AS
        inputs = {k: v.unsqueeze(0) for k, v in encoded.items() if k in ("input_ids", "mm_token_type_ids")}
        inputs |= {"pixel_values": encoded["pixel_values"], "image_grid_thw": encoded["image_grid_thw"],
                   "position_ids": positions.unsqueeze(1)}
        with torch.no_grad():
            logits = gm.model(**inputs).logits[0, :-1].float()
        labels = encoded["labels"][1:]
        answer = labels != qwen.IGNORE_INDEX
        right += int((logits[answer].argmax(-1) == labels[answer]).sum())
        total += int(answer.sum())
        loss += float(torch.nn.functional.cross_entropy(logits[answer], labels[answer]))
    return {"answer_loss": round(loss / n, 4), "tokens_right": round(right / total, 4)}


def offsets(model: str, n: int, answer_label: bool) -> dict:
    gm = load(model)
    gm.model.eval()
    out = {"112": answer_scores(gm, 112, n, False, answer_label)}
    for side in (168, 224):
        out[str(side)] = answer_scores(gm, side, n, False, answer_label)
        out[f"{side} placed as 112"] = answer_scores(gm, side, n, True, answer_label)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+")
    parser.add_argument("--n", type=positive_int, default=120, help="scenes per canvas size")
    parser.add_argument("--answer-label", action="store_true",
                        help="the answer repeats the phrase as its label (models pre-trained with answer_label=true)")
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args()
    measure_models(parser, args.models, lambda model: offsets(model, args.n, args.answer_label), args.out)


if __name__ == "__main__":
    main()
