"""Which task variant can the quickstart's LoRA teach a pre-trained tiny model, and how fast? Each
variant (a palette, a task and a canvas the model may not have seen) gets its own synthetic train and
val sets (synth.py, seeds 1 and 2, as `groundtune quickstart` makes them); the model is scored on
the val set as it is, then `groundtune train quickstart` runs on the variant from it (every variant's
run at once, in a process each), evaluated every few steps: the curve of Acc@0.5 against steps is what
tells a variant a CPU can teach in the quickstart's minutes from one that needs longer.

    python bench/quickstart_variants.py --model tiny --steps 300 \\
        --out bench/results/tiny2/quickstart_variants.json answer_label=false precision=fp32

Variants (VARIANTS): ``renamed`` is the default scene (colours, shapes, background) with its four
colours called by words no built-in model read in pre-training; ``hues`` four new colours (new
words and new RGB) on the default shapes; ``unseen`` synth's unseen palette (new colours and new
shapes); ``dark`` the default scene on a dark background (synth's dark palette). The colour task
(2-3 shapes of one kind in distinct colours, so the colour word alone tells which) starts near
chance for a model that cannot read the colour; the full task (1-3 shapes, every phrase form)
often names the target by kind or position as well.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from groundtune import infer
from groundtune.data import synth
from groundtune.data.records import atomic_write, read_samples
from groundtune.evaluate import evaluate

sys.path.insert(0, str(Path(__file__).parent))
from provenance import stamped  # noqa: E402

# The default palette's colours (same RGB) under words the pre-training stream never used
RENAMED = synth.Palette(colours=dict(zip(("scarlet", "jade", "cobalt", "amber"),
                                         synth.DEFAULT_PALETTE.colours.values())))
HUES = synth.Palette(colours=synth.UNSEEN_PALETTE.colours)  # new colours, the default shapes
PALETTES = {"renamed": RENAMED, "hues": HUES, "unseen": synth.UNSEEN_PALETTE, "dark": synth.DARK_PALETTE}
VARIANTS = {
    "renamed-colour-112": ("renamed", "colour", 112),
    "renamed-colour-168": ("renamed", "colour", 168),
    "renamed-full-112": ("renamed", "full", 112),
    "renamed-full-168": ("renamed", "full", 168),
    "hues-colour-112": ("hues", "colour", 112),
    "hues-full-168": ("hues", "full", 168),
    "unseen-full-168": ("unseen", "full", 168),
    "dark-full-112": ("dark", "full", 112),
    "dark-full-168": ("dark", "full", 168),
    "dark-colour-168": ("dark", "colour", 168),
}


def make_data(folder: Path, palette: str, task: str, side: int, n_train: int, n_val: int) -> None:
    for split, n, seed in (("train", n_train, 1), ("val", n_val, 2)):
        if not (folder / f"{split}.jsonl").exists():
            synth.make_synthetic_set(folder, n=n, seed=seed, split=split, width=side, height=side, task=task,
                                     palette=PALETTES[palette])


def curve(run: Path) -> list[dict]:
    """(step, Acc@0.5, seconds since the run's first metrics line) of every eval in its metrics.jsonl."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    start = rows[0]["time"]
    return [{"step": r["step"], "acc@0.5": r["eval/acc@0.5"], "seconds": round(r["time"] - start, 1)}
            for r in rows if "eval/acc@0.5" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the pre-trained model the variants start from")
    parser.add_argument("--work", default="/tmp/quickstart_variants", help="data and run folders")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--n-train", type=int, default=8000)
    parser.add_argument("--n-val", type=int, default=200)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--out", default="bench/results/quickstart_variants.json")
    parser.add_argument("overrides", nargs="*", help="key=value settings for every run")
    args = parser.parse_args()
    work = Path(args.work)
    result, runs = {}, {}
    gm = infer.load(args.model)
    for name in args.variants:
        palette, task, side = VARIANTS[name]
        data = work / name / "data"
        make_data(data, palette, task, side, args.n_train, args.n_val)
        before, _ = evaluate(gm, read_samples(data / "val.jsonl"), data / "val.jsonl", progress=False)
        result[name] = {"palette": palette, "colours": list(PALETTES[palette].colours),
                        "shapes": list(PALETTES[palette].shapes), "task": task, "side": side,
                        "before": before["acc@0.5"]}
        print(f"{name:<20} before {before['acc@0.5']:.3f}", flush=True)
        command = [sys.executable, "-m", "groundtune", "train", "quickstart", f"model={args.model}",
                   f"train_data={data / 'train.jsonl'}", f"eval_data={data / 'val.jsonl'}",
                   f"out_dir={work / name / 'run'}", "overwrite=true", f"max_steps={args.steps}",
                   f"eval_every={args.eval_every}", "save_every=0", *args.overrides]
        log = open(work / name / "train.log", "w")  # noqa: SIM115 - open until the process ends
        runs[name] = (subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), time.time(), log)
    for name, (process, started, log) in runs.items():
        code = process.wait()
        log.close()
        result[name]["train_wall_s"] = round(time.time() - started, 1)
        if code != 0:
            print((work / name / "train.log").read_text()[-2000:])
            raise SystemExit(f"{name}: groundtune train exited with {code}")
        result[name]["curve"] = curve(work / name / "run")
    result = {"model": args.model, "n_train": args.n_train, "n_val": args.n_val, "overrides": args.overrides,
              "variants": result}
    with atomic_write(args.out) as f:
        f.write(json.dumps(stamped(result), indent=2) + "\n")
    for name, row in result["variants"].items():
        print(f"{name:<20} {row['before']:.3f} -> " + " ".join(f"{c['step']}:{c['acc@0.5']:.3f}" for c in row["curve"]))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
