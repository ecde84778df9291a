"""Does `data refgen` help, as a user would see it? Synthetic scenes (whose generator knows the
truth) are turned into detections only: boxes, category = the shape's kind, the colour kept as
the attribute field, in a COCO instances.json. From them:

  (a) `data convert --from coco`: one line per box, the category name as the phrase ("circle");
  (b) `data refgen --from coco`: verified referring expressions ("the circle left of the square").

The shipped tiny model is fine-tuned with LoRA on each (the quickstart's preset and variant: 168 px
canvases it was not trained on; same steps, same seed), and both are evaluated on held-out
referring expressions: the synthetic set's own val phrases (another seed), which neither (a) nor
(b) produced. Acc@0.5 of each, with the binomial noise of the eval.

    python bench/refgen_proof.py --out bench/results/refgen_proof.json           # ~8 min on 2 cores
    python bench/refgen_proof.py --check 10000                                   # ~1 min

`--check N`: refgen on the layouts of 10,000 synthetic scenes (no images drawn), every written phrase
(one box, a set, or nothing: the palette's shapes are the label set) re-read by the independent
checker (data/refcheck.py): how many pick a wrong or a second box.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections import Counter
from pathlib import Path

# One thread per process: on a shared 2-core machine, two processes each spinning two OpenMP
# threads ran the tiny model's eval 15x slower than one thread each (76 s against 5 s for 100).
os.environ.setdefault("OMP_NUM_THREADS", "1")

from groundtune.data import refcheck, refgen, sources, synth  # noqa: E402
from groundtune.data.records import atomic_write, read_samples, write_samples  # noqa: E402
from provenance import stamped  # noqa: E402

CHECK_SEED = 3  # not the proof's training (1) or eval (2) scenes
VARIANT = {"width": 168, "height": 168, "task": "multi"}  # 2-3 shapes: two of a kind happens often


def scene_detections(seed: int, index: int, split: str, variant: dict) -> list[refgen.Obj]:
    """The boxes of synthetic scene ``index`` as detections: category = shape kind, the colour as an
    attribute; the phrase the scene was made with is not used."""
    scene = synth.make_scene(seed, index, split=split, **variant)
    return [refgen.Obj(tuple(float(v) for v in s.box), s.kind, (s.colour,)) for s in scene.shapes]


def write_instances(folder: Path, seed: int, n: int, split: str, variant: dict) -> Path:
    """A COCO instances.json for the scenes ``make_synthetic_set`` drew into ``folder/images``."""
    kinds = {k: i + 1 for i, k in enumerate(synth.DEFAULT_PALETTE.shapes)}
    images, annotations = [], []
    for i in range(n):
        images.append({"id": i, "file_name": f"{split}-{i:07d}.png", "width": variant["width"],
                       "height": variant["height"]})
        for o in scene_detections(seed, i, split, variant):
            x1, y1, x2, y2 = o.box
            annotations.append({"id": len(annotations) + 1, "image_id": i, "category_id": kinds[o.label],
                                "bbox": [x1, y1, x2 - x1, y2 - y1], "area": (x2 - x1) * (y2 - y1), "iscrowd": 0,
                                "attributes": list(o.attributes)})
    path = folder / f"instances_{split}.json"
    with atomic_write(path) as f:
        json.dump({"images": images, "annotations": annotations,
                   "categories": [{"id": i, "name": k} for k, i in kinds.items()]}, f)
    return path


def binomial_std(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / n)


def proof(args) -> dict:
    from groundtune import evaluate, infer
    from groundtune.config import TrainConfig, load_config, preset_path
    from groundtune.train.sft import train

    work = Path(args.work)
    data = work / "data"
    started = time.time()
    # overwrite: a second run of the proof draws its scenes again into the same work folder
    synth.make_synthetic_set(data, n=args.scenes, seed=1, split="train", workers=1, overwrite=True, **VARIANT)
    val_path = synth.make_synthetic_set(data, n=args.n_eval, seed=2, split="val", workers=1, overwrite=True,
                                        **VARIANT)
    instances = write_instances(data, 1, args.scenes, "train", VARIANT)
    files = {"a_category": work / "a_category.jsonl", "b_refgen": work / "b_refgen.jsonl"}
    # (a) and (b) as they were measured (bench/results/refgen_proof.json): one line per box, and the
    # one-box kinds only; sets and no-target phrases came later and are not part of this figure
    sources.convert_coco(instances, data / "images", files["a_category"], split="train", one_per_box=True)
    stats = refgen.Stats()
    records = refgen.generate(refgen.from_coco(instances, data / "images", files["b_refgen"], split="train"),
                              refgen.RefgenSettings(kinds=dict.fromkeys(refgen.BOX_KINDS, 1.0), seed=0), stats)
    write_samples(files["b_refgen"], records)
    checked = refcheck.check_refs(files["b_refgen"])
    print(refgen.format_stats(stats), "\n", checked.summary(), sep="")
    data_seconds = time.time() - started

    val = read_samples(val_path)
    forms = [synth.make_scene(2, i, split="val", **VARIANT).query.form for i in range(len(val))]
    results = {}
    before, rows = evaluate.evaluate(infer.load("tiny"), val, val_path)
    results["tiny (no fine-tuning)"] = (before, rows, 0.0)
    for name, path in files.items():
        cfg = load_config(TrainConfig, preset_path("quickstart"), [
            f"train_data={path}", "eval_data=", f"out_dir={work / 'runs' / name}", f"max_steps={args.steps}",
            "overwrite=true", *args.overrides])
        t0 = time.time()
        run = train(cfg)
        seconds = time.time() - t0
        report, rows = evaluate.evaluate(infer.load(str(run)), val, val_path)
        results[name] = (report, rows, seconds)

    n = len(val)
    table = {}
    for name, (report, rows, seconds) in results.items():
        by_form = Counter(), Counter()
        for form, row in zip(forms, rows):
            by_form[0][form] += 1
            by_form[1][form] += row["hit@0.5"]
        acc = report["acc@0.5"]
        table[name] = {"acc@0.5": acc, "binomial_std": binomial_std(acc, n), "miou": report["miou"],
                       "parse_fail_rate": report["parse_fail_rate"], "train_seconds": round(seconds, 1),
                       "acc@0.5_by_form": {f: by_form[1][f] / by_form[0][f] for f in sorted(by_form[0])},
                       "n_by_form": dict(sorted(by_form[0].items()))}
    a, b = (results[k][1] for k in files)
    pa, pb = table["a_category"]["acc@0.5"], table["b_refgen"]["acc@0.5"]
    only_b = sum(rb["hit@0.5"] and not ra["hit@0.5"] for ra, rb in zip(a, b))
    only_a = sum(ra["hit@0.5"] and not rb["hit@0.5"] for ra, rb in zip(a, b))
    result = {
        "variant": VARIANT, "train_scenes": args.scenes, "eval_samples": n, "steps": args.steps,
        "train_records": {"a_category": sum(1 for _ in open(files["a_category"])), "b_refgen": checked.to_dict()["checked"]},
        "refgen_stats": stats.to_dict(), "refgen_checked": {k: v for k, v in checked.to_dict().items() if k != "problems"},
        "models": table,
        "b_minus_a": pb - pa,
        # the two evals are on the same samples; unpaired std of the difference is the cautious figure
        "std_of_difference": math.sqrt(binomial_std(pa, n) ** 2 + binomial_std(pb, n) ** 2),
        "paired": {"only_b_hits": only_b, "only_a_hits": only_a},
        "data_seconds": round(data_seconds, 1), "total_seconds": round(time.time() - started, 1),
    }
    return result


def check(args) -> dict:
    """refgen on the layouts of many synthetic scenes, every phrase re-read by refcheck."""
    started, stats, verdicts, by_kind = time.time(), refgen.Stats(), Counter(), {}
    variant = {**VARIANT, "task": args.check_task}
    # the palette's shapes are the label set, as a COCO file's categories are: none phrases are checked too
    scenes = (refgen.Detections(str(i), f"{i}.png", variant["width"], variant["height"], "train",
                                scene_detections(CHECK_SEED, i, "train", variant), label_set=synth.DEFAULT_PALETTE.shapes)
              for i in range(args.check))
    problems = []
    for record in refgen.generate(scenes, refgen.RefgenSettings(seed=0), stats, progress=False):
        v = refcheck.check_record(record)
        verdicts[v.verdict] += 1
        by_kind.setdefault(record["kind"], Counter())[v.verdict] += 1
        if not v.ok and len(problems) < 20:
            problems.append({"id": record["id"], "phrase": record["phrase"], "verdict": v.verdict})
    result = {
        "scenes": args.check, "variant": variant, "scene_seed": CHECK_SEED,
        "phrases": sum(verdicts.values()), "verdicts": dict(verdicts),
        "wrong_or_second_box": verdicts["wrong_box"] + verdicts["second_box"] + verdicts["unparsed"],
        "by_kind": {k: dict(c) for k, c in sorted(by_kind.items())}, "refgen_stats": stats.to_dict(),
        "problems": problems, "seconds": round(time.time() - started, 1),
    }
    print(json.dumps({k: result[k] for k in ("phrases", "verdicts", "wrong_or_second_box", "seconds")}))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", type=int, metavar="N", help="instead of the proof: refgen on the layouts of N "
                        "synthetic scenes, every phrase re-read by the independent checker")
    parser.add_argument("--check-task", default="multi", choices=synth.TASKS, help="--check: the scenes' task")
    parser.add_argument("--work", default="/tmp/refgen_proof", help="data and run folders")
    parser.add_argument("--scenes", type=int, default=2000, help="training scenes (detections)")
    parser.add_argument("--n-eval", type=int, default=1000, help="held-out referring expressions")
    parser.add_argument("--steps", type=int, default=500, help="LoRA steps of each fine-tune (the quickstart's)")
    parser.add_argument("--out", help="JSON to write (default bench/results/refgen_proof.json, "
                        "with --check bench/results/refgen_check.json)")
    parser.add_argument("overrides", nargs="*", help="key=value training settings for both runs")
    args = parser.parse_args()
    args.out = args.out or f"bench/results/refgen_{'check' if args.check else 'proof'}.json"
    result = check(args) if args.check else proof(args)
    with atomic_write(args.out) as f:
        f.write(json.dumps(stamped(result), indent=2) + "\n")
    if not args.check:
        for name, row in result["models"].items():
            print(f"{name:<24} Acc@0.5 {row['acc@0.5']:.3f} +- {row['binomial_std']:.3f}  by form "
                  + ", ".join(f"{f} {v:.2f}" for f, v in row["acc@0.5_by_form"].items()))
        print(f"(b) - (a): {result['b_minus_a']:+.3f} (std of the difference {result['std_of_difference']:.3f})")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
