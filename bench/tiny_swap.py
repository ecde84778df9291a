"""Does a model read the colour word of a phrase, and the kind word? Synth's every-task scenes whose
phrase names a colour (a kind), answered with the phrase and again with that word swapped for
another colour (kind) in the scene: how often the answer stays the same where the right answer
changes. A model that reads the word changes its answer about as often as the right answer
changes; one that ignores it keeps its answer.

And, on synth's attribute-task scenes (2-3 shapes, one named by colour and/or kind), Acc@0.5 by the
cue that tells the target from the others: its colour alone ("the red shape"; a random pick among
the shapes, ``random_pick``, scores about 0.4), its colour where another shape has its kind ("the
red circle" beside a blue circle), its kind where another has its colour, either, or its kind alone;
with how often the answer boxes some shape (``on_a_shape``) and the named one's share of those
(``named_of_on_a_shape``: the figure to set against ``random_pick`` for a model that often boxes
nothing). And the same on synth's colour task (2-3 shapes of one kind, the colour word the only
cue; ``colour_task``, 2 x n scenes).

    python bench/tiny_swap.py MODEL [MODEL ...] --n 300 [--out swap.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from groundtune.cli.flags import positive_int
from groundtune.data.synth import make_sample, make_scene
from groundtune.evaluate import score, score_answer
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


def cue(scene) -> str:
    """What tells an attribute-task phrase's target from the other shapes."""
    query, target = scene.query, scene.shapes[scene.targets[0]]
    others = [s for i, s in enumerate(scene.shapes) if i != scene.targets[0]]
    if not (query.colour and query.kind):
        return "colour alone" if query.colour else "kind alone"
    if any(s.kind == target.kind for s in others):
        return "colour (another of its kind)"
    return "kind (another of its colour)" if any(s.colour == target.colour for s in others) else "either"


def one_target_scenes(task: str, n: int) -> tuple[list, list, list, list]:
    """n (image, phrase, target box, scene) of a one-target synth task's val split."""
    images, phrases, truths, scenes = [], [], [], []
    for index in range(n):
        image, record = make_sample(SEED, index, task=task, split="val")
        images.append(image)
        phrases.append(record["phrase"])
        truths.append(record["bbox"])
        scenes.append(make_scene(SEED, index, task=task, split="val"))
    return images, phrases, truths, scenes


def picks(rows: list[tuple[bool, bool, float]]) -> dict:
    """Acc@0.5 over (hit, on some shape, chance of a random pick) per scene. A young model often
    boxes no shape at all: the named shape's share of the answers that land on some shape is what
    compares with a random pick."""
    on = sum(on for _, on, _ in rows)
    return {"n": len(rows), "acc@0.5": round(sum(hit for hit, _, _ in rows) / len(rows), 3),
            "on_a_shape": round(on / len(rows), 3),
            "named_of_on_a_shape": round(sum(hit for hit, _, _ in rows) / max(1, on), 3),
            "random_pick": round(sum(chance for _, _, chance in rows) / len(rows), 3)}


def pick_rows(gm, task: str, n: int) -> list[tuple[object, tuple[bool, bool, float]]]:
    """(scene, (hit, on some shape, chance of a random pick)) for n scenes of a one-target task."""
    images, phrases, truths, scenes = one_target_scenes(task, n)
    answers = predict(gm, images, phrases, batch_size=100, max_new_tokens=32)
    return [(scene, (score(answer.bbox, [truth])["hit@0.5"],
                     any(score(answer.bbox, [s.box])["hit@0.5"] for s in scene.shapes), 1 / len(scene.shapes)))
            for answer, truth, scene in zip(answers, truths, scenes)]


def cue_test(gm, n: int) -> dict:
    by_cue: dict[str, list[tuple[bool, bool, float]]] = {}
    for scene, row in pick_rows(gm, "attribute", n):
        by_cue.setdefault(cue(scene), []).append(row)
    return {what: picks(rows) for what, rows in sorted(by_cue.items())}


def swap_tests(gm, n: int) -> dict:
    return {**{word: swap_test(gm, word, n) for word in ("colour", "kind")}, "attribute_by_cue": cue_test(gm, n),
            "colour_task": picks([row for _, row in pick_rows(gm, "colour", 2 * n)])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+")
    parser.add_argument("--n", type=positive_int, default=300, help="phrase pairs per word")
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args()
    measure_models(parser, args.models, lambda model: swap_tests(load(model), args.n), args.out)


if __name__ == "__main__":
    main()
