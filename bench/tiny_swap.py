"""Does a model read the colour word of a phrase, and the kind word? Synth's every-task scenes whose
phrase names a colour (a kind), answered with the phrase and again with that word swapped for
another colour (kind) in the scene: how often the answer stays the same where the right answer
changes. A model that reads the word changes its answer about as often as the right answer
changes; one that ignores it keeps its answer.

    python bench/tiny_swap.py MODEL [MODEL ...] --n 300 [--out swap.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from groundtune.cli.flags import positive_int
from groundtune.data.synth import make_sample, make_scene
from groundtune.evaluate import score_answer
from groundtune.infer import load, predict

sys.path.insert(0, str(Path(__file__).parent))
from provenance import measure_models

SEED = 91  # scenes of synth's val split that no training stream draws


def pairs(word: str, n: int) -> list[tuple]:
    """n (image, phrase, its boxes, swapped phrase, its boxes) from every-task val scenes."""
    out, index = [], 0
    while len(out) < n:
        image, _ = make_sample(SEED, index, task="every", split="val")
        scene = make_scene(SEED, index, task="every", split="val")
        index += 1
        query = scene.query
        named = getattr(query, word)
        others = sorted({getattr(s, word) for s in scene.shapes} - {named})
        if named is None or not others:
            continue
        swapped = {"colour": query.colour, "kind": query.kind, word: others[0]}
        boxes = [s.box for s in scene.shapes if (query.colour in (None, s.colour)) and (query.kind in (None, s.kind))]
        swapped_boxes = [s.box for s in scene.shapes
                         if swapped["colour"] in (None, s.colour) and swapped["kind"] in (None, s.kind)]
        # "every red circle" -> "every blue circle"; "all the circles" -> "all the squares"
        out.append((image, query.text, boxes, query.text.replace(named, others[0]), swapped_boxes))
    return out


def swap_test(gm, word: str, n: int) -> dict:
    rows = pairs(word, n)
    images = [r[0] for r in rows for _ in range(2)]
    phrases = [p for r in rows for p in (r[1], r[3])]
    answers = predict(gm, images, phrases, batch_size=100, max_new_tokens=128)
    same = [a.boxes == b.boxes for a, b in zip(answers[0::2], answers[1::2])]
    right = [score_answer(a, boxes)["set_hit"] for a, boxes in zip(answers, (b for r in rows for b in (r[2], r[4])))]
    return {"pairs": n,
            "answer_unchanged": round(sum(same) / n, 3),
            "right_answer_unchanged": round(sum(r[2] == r[4] for r in rows) / n, 3),
            "exactly_right": round(sum(right[0::2]) / n, 3),
            "exactly_right_swapped": round(sum(right[1::2]) / n, 3)}


def swap_tests(gm, n: int) -> dict:
    return {word: swap_test(gm, word, n) for word in ("colour", "kind")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+")
    parser.add_argument("--n", type=positive_int, default=300, help="phrase pairs per word")
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args()
    measure_models(parser, args.models, lambda model: swap_tests(load(model), args.n), args.out)


if __name__ == "__main__":
    main()
