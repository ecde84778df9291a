"""Does `groundtune train quickstart-every` teach "every object, or none"? The preset is run as a
user runs it (text answers), and again with ``head=box`` (the set box head), each timed; both, and
the untrained tiny model, are scored by `groundtune eval` on a held-out set that synth.py did not
make: this script's own generator (``heldout_scene``) lays out, draws and names its scenes with
code of its own (its own placement, ImageDraw shapes on its own background, its own phrase
templates, the set found by filtering the shapes it drew), on the task's vocabulary (the palette's
colours and shapes). The box head's threshold is swept on the same set (its effect on F1 and N-acc).

    python bench/every_proof.py --out bench/results/every_proof.json     # ~10 min on 2 cores

Targets (issue "every object, or none"): text F1@0.5 >= 0.75 and N-acc >= 0.85; the box head
within 5 F1 points of text in no more wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from groundtune import infer
from groundtune.data.records import atomic_write, read_samples, write_samples
from groundtune.data.synth import DEFAULT_PALETTE
from groundtune.evaluate import evaluate
from groundtune.models import head

sys.path.insert(0, str(Path(__file__).parent))
from provenance import stamped  # noqa: E402

HELDOUT_SEED = 7
SIZE = 112  # the canvas the tiny model and synth:every use
NO_TARGET_SHARE = 0.3
# Its own ways of asking for a set: some as synth's, some it never writes ("all red circles")
TEMPLATES = ("every {c} {k}", "all {c} {ks}", "all the {c} {ks}", "the {c} {ks}")
COLOUR_ONLY = ("every {c} shape", "all {c} shapes", "the {c} shapes")
KIND_ONLY = ("every {k}", "all {ks}", "all the {ks}")
METRICS = ("f1@0.5", "precision@0.5", "recall@0.5", "set_acc@0.5", "n_acc", "t_acc", "acc@0.5", "parse_fail_rate")


def _plural(kind: str) -> str:
    return kind + "es" if kind.endswith(("s", "x")) else kind + "s"


def heldout_scene(rng: np.random.Generator) -> tuple[Image.Image, str, list[list[float]]]:
    """One scene of this script's own: 1-6 shapes (colour and kind drawn with replacement, so they
    repeat), 14-40 px squares placed apart by rejection, drawn with ImageDraw on a noisy grey; a
    phrase naming every shape of a colour, a kind or both, NO_TARGET_SHARE of the time a pairing
    that is not there. Returns the image, the phrase and the named shapes' boxes."""
    colours, kinds = list(DEFAULT_PALETTE.colours), list(DEFAULT_PALETTE.shapes)
    background = rng.integers(205, 236)
    pixels = np.clip(background + rng.normal(0, 6, (SIZE, SIZE, 3)), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels, "RGB")
    draw = ImageDraw.Draw(image)
    shapes = []  # (colour, kind, box)
    for _ in range(int(rng.integers(1, 7))):
        side = int(rng.integers(14, 41))
        for _try in range(200):
            x, y = (int(v) for v in rng.integers(0, SIZE - side + 1, 2))
            if all(x + side + 3 <= b[0] or b[2] + 3 <= x or y + side + 3 <= b[1] or b[3] + 3 <= y for _, _, b in shapes):
                break
        else:
            continue
        colour, kind = colours[int(rng.integers(len(colours)))], kinds[int(rng.integers(len(kinds)))]
        fill, corner = DEFAULT_PALETTE.colours[colour], (x + side - 1, y + side - 1)
        if kind == "circle":
            draw.ellipse([x, y, *corner], fill=fill)
        elif kind == "square":
            draw.rectangle([x, y, *corner], fill=fill)
        else:  # triangle, point up
            draw.polygon([(x, corner[1]), (corner[0], corner[1]), (x + (side - 1) / 2, y)], fill=fill)
        shapes.append((colour, kind, [float(x), float(y), float(x + side), float(y + side)]))
    present = {(c, k) for c, k, _ in shapes}
    if rng.random() < NO_TARGET_SHARE:
        asked = [(c, k) for c in colours for k in kinds if (c, k) not in present]
        asked += [(c, None) for c in colours if all(c != pc for pc, _ in present)]
        asked += [(None, k) for k in kinds if all(k != pk for _, pk in present)]
    else:
        asked = sorted(present) + [(c, None) for c, _ in sorted(present)] + [(None, k) for _, k in sorted(present)]
    colour, kind = asked[int(rng.integers(len(asked)))]
    templates = TEMPLATES if colour and kind else COLOUR_ONLY if colour else KIND_ONLY
    phrase = templates[int(rng.integers(len(templates)))].format(c=colour, k=kind, ks=_plural(kind or ""))
    named = [box for c, k, box in shapes if colour in (None, c) and kind in (None, k)]
    return image, phrase, named


def make_heldout(folder: Path, n: int) -> Path:
    """``n`` scenes of ``heldout_scene`` as canonical JSONL (``bboxes``: the named set, [] for none)
    and PNGs under ``folder``; the same seed writes the same files."""
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(HELDOUT_SEED)
    records = []
    for i in range(n):
        image, phrase, named = heldout_scene(rng)
        name = f"images/heldout-{i:05d}.png"
        image.save(folder / name)
        records.append({"id": f"heldout-{i}", "image": name, "width": SIZE, "height": SIZE, "phrase": phrase,
                        "bboxes": named, "split": "heldout", "source": "every_proof"})
    write_samples(folder / "heldout.jsonl", records)
    return folder / "heldout.jsonl"


def groundtune(*args: str) -> float:
    """A groundtune command as a user types it; its wall time in seconds."""
    started = time.time()
    subprocess.run([sys.executable, "-m", "groundtune", *args], check=True)
    return round(time.time() - started, 1)


def scores(report: dict) -> dict:
    return {k: report.get(k) for k in METRICS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="/tmp/every_proof", help="data and run folders")
    parser.add_argument("--n", type=int, default=500, help="held-out samples")
    parser.add_argument("--out", default="bench/results/every_proof.json")
    parser.add_argument("overrides", nargs="*", help="key=value settings for both runs (a smoke run: max_steps=2)")
    args = parser.parse_args()
    work = Path(args.work)
    data = make_heldout(work / "heldout", args.n)
    samples = read_samples(data)
    result = {"heldout": {"n": len(samples), "no_target": sum(not s["bboxes"] for s in samples),
                          "generator": "bench/every_proof.py heldout_scene", "seed": HELDOUT_SEED},
              "runs": {}}
    for name, extra in (("text", []), ("box_head", ["head=box"])):
        run = work / name
        seconds = groundtune("train", "quickstart-every", f"out_dir={run}", "overwrite=true", *extra, *args.overrides)
        groundtune("eval", "--model", str(run), "--data", str(data), "--max-new-tokens", "128",
                   "--out", str(work / f"{name}.json"))
        report = json.loads((work / f"{name}.json").read_text())
        result["runs"][name] = {"train_wall_s": seconds, "command": " ".join(["groundtune train quickstart-every", *extra]),
                                **scores(report)}
    groundtune("eval", "--model", "tiny", "--data", str(data), "--max-new-tokens", "128", "--out", str(work / "tiny.json"))
    result["runs"]["tiny_untrained"] = scores(json.loads((work / "tiny.json").read_text()))
    gm = infer.load(str(work / "box_head"), device="cpu")
    sweep = {}
    for threshold in (0.3, 0.4, 0.5, 0.6, 0.7):  # one forward pass per sample: cheap to answer again
        head.head_of(gm.model).threshold = threshold
        report, _ = evaluate(gm, samples, data, progress=False)
        sweep[str(threshold)] = {k: report.get(k) for k in ("f1@0.5", "precision@0.5", "recall@0.5", "n_acc")}
    result["box_head_threshold"] = sweep
    text, box = result["runs"]["text"], result["runs"]["box_head"]
    f1, n_acc, box_f1 = (value or 0.0 for value in (text["f1@0.5"], text["n_acc"], box["f1@0.5"]))  # None: nothing to count
    result["targets"] = {
        "text f1@0.5 >= 0.75": f1 >= 0.75, "text n_acc >= 0.85": n_acc >= 0.85,
        "box head within 5 F1 points": box_f1 >= f1 - 0.05,
        "box head in no more wall time": box["train_wall_s"] <= text["train_wall_s"],
    }
    with atomic_write(args.out) as f:
        f.write(json.dumps(stamped(result), indent=2) + "\n")
    for name, row in result["runs"].items():
        print(f"{name:<16}" + "  ".join(f"{k} {row[k]:.3f}" for k in ("f1@0.5", "n_acc", "t_acc", "set_acc@0.5")
                                        if row.get(k) is not None) + (f"  train {row['train_wall_s']} s" if "train_wall_s" in row else ""))
    print("box head threshold:", {t: round(v["f1@0.5"] or 0, 3) for t, v in sweep.items()})
    print("targets:", result["targets"])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
