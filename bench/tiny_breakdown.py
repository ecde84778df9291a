"""Held-out Acc@0.5 of a model on the synthetic full task, broken down by phrase form and by the
number of shapes in the image: where a grounding model still fails.

    python bench/tiny_breakdown.py MODEL [MODEL ...] --n 1000 --seed 77 --out breakdown.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

from groundtune.boxes import iou
from groundtune.data.synth import make_sample, make_scene
from groundtune.infer import load, predict

sys.path.insert(0, str(Path(__file__).parent))
from provenance import stamped  # noqa: E402


def breakdown(model: str, n: int, seed: int, task: str) -> dict:
    gm = load(model)
    images, phrases, scenes = [], [], []
    for i in range(n):
        image, record = make_sample(seed, i, task=task, split="val")
        images.append(image)
        phrases.append(record["phrase"])
        scenes.append(make_scene(seed, i, task=task, split="val"))
    predictions = predict(gm, images, phrases, batch_size=250)
    hits = collections.defaultdict(list)
    for p, scene in zip(predictions, scenes):
        ok = p.bbox is not None and iou(p.bbox, scene.boxes[0]) >= 0.5
        hits["all"].append(ok)
        hits[f"form={scene.query.form}"].append(ok)
        hits[f"shapes={len(scene.shapes)}"].append(ok)
        hits[f"shapes={len(scene.shapes)} form={scene.query.form}"].append(ok)
    return {k: {"acc@0.5": round(sum(v) / len(v), 4), "n": len(v)} for k, v in sorted(hits.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+")
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=77)
    parser.add_argument("--task", default="full")
    parser.add_argument("--out")
    args = parser.parse_args()
    results = {m: breakdown(m, args.n, args.seed, args.task) for m in args.models}
    keys = sorted({k for r in results.values() for k in r})
    print(f"{'':32s}" + "".join(f"{m[-18:]:>20s}" for m in results))
    for k in keys:
        print(f"{k:32s}" + "".join(f"{r.get(k, {}).get('acc@0.5', float('nan')):>20.3f}" for r in results.values()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(stamped(results), f, indent=1)


if __name__ == "__main__":
    main()
