"""Does `groundtune train quickstart-every` teach "every object, or none"? The preset is run as a
user runs it (text answers), with ``loss_per=sample`` (each answer's own mean loss) and with
``loss_per=first`` (half of each answer's weight on its first token, which says none or boxes):
does the weighting of short "none" answers matter? And with ``head=box`` (the set box head), each timed;
they and the untrained tiny model are scored (``evaluate``, as `groundtune eval` scores) on
held-out sets that synth.py did not make: this script's own generator (``heldout_scene``) lays
out, draws and names its scenes with code of its own (its own placement, ImageDraw shapes on its
own background, its own phrase templates, the set found by filtering the shapes it drew), on the
task's vocabulary (the palette's colours and shapes), at 112 and 168 px: sets (0-6 targets, ~30%
naming nothing) and single objects ("the red circle" among 1-3 shapes). The box head's threshold
is swept on the set scenes (its effect on F1 and N-acc).

    python bench/every_proof.py --out bench/results/every_proof_sizes.json   # ~15 min on 2 cores
    python bench/every_proof.py --score tiny RUN ... --out scores.json    # score models as they are

A set's scores come with a breakdown per phrase form (colour and kind, colour, kind) and per number
of named shapes, and the share of boxes answered to a colour phrase that have that colour.

Targets (issue "groundtune-tiny 2"): text F1@0.5 >= 0.80 and N-acc >= 0.90 at 112 and 168 px in
<= 5 min end to end; the box head within 5 F1 points of text in no more wall time.
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
from groundtune.errors import GroundtuneError
from groundtune.evaluate import evaluate, summarise
from groundtune.models import head

sys.path.insert(0, str(Path(__file__).parent))
from provenance import stamped  # noqa: E402

HELDOUT_SEED = 7
SIZES = (112, 168)  # square canvases the held-out scenes are drawn on
NO_TARGET_SHARE = 0.3
# Its own ways of asking for a set, written by its own code (synth's set phrases open with the same
# four words: "every", "all the", "all", "the")
TEMPLATES = ("every {c} {k}", "all {c} {ks}", "all the {c} {ks}", "the {c} {ks}")
COLOUR_ONLY = ("every {c} shape", "all {c} shapes", "the {c} shapes")
KIND_ONLY = ("every {k}", "all {ks}", "all the {ks}")
METRICS = ("f1@0.5", "precision@0.5", "recall@0.5", "set_acc@0.5", "n_acc", "t_acc", "acc@0.5", "parse_fail_rate")


def _plural(kind: str) -> str:
    return kind + "es" if kind.endswith(("s", "x")) else kind + "s"


def heldout_scene(rng: np.random.Generator, size: int = 112, one: bool = False) -> tuple[Image.Image, str, list[list[float]]]:
    """One scene of this script's own on a size x size canvas: 1-6 shapes (colour and kind drawn
    with replacement, so they repeat), squares of 14-40 px per 112 px of canvas placed apart by
    rejection, drawn with ImageDraw on a noisy grey; ``one``: 1-3 shapes of distinct colour and
    kind and "the {colour} {kind}" of one of them (the single-object task); else a
    phrase naming every shape of a colour, a kind or both, NO_TARGET_SHARE of the time a pairing
    that is not there. Returns the image, the phrase and the named shapes' boxes."""
    colours, kinds = list(DEFAULT_PALETTE.colours), list(DEFAULT_PALETTE.shapes)
    background = rng.integers(205, 236)
    pixels = np.clip(background + rng.normal(0, 6, (size, size, 3)), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels, "RGB")
    draw = ImageDraw.Draw(image)
    shapes = []  # (colour, kind, box)
    for _ in range(int(rng.integers(1, 4 if one else 7))):
        side, gap = int(rng.integers(round(14 * size / 112), round(40 * size / 112) + 1)), round(3 * size / 112)
        for _try in range(200):
            x, y = (int(v) for v in rng.integers(0, size - side + 1, 2))
            if all(x + side + gap <= b[0] or b[2] + gap <= x or y + side + gap <= b[1] or b[3] + gap <= y
                   for _, _, b in shapes):
                break
        else:
            continue
        colour, kind = colours[int(rng.integers(len(colours)))], kinds[int(rng.integers(len(kinds)))]
        if one and (colour, kind) in {(c, k) for c, k, _ in shapes}:
            continue
        fill, corner = DEFAULT_PALETTE.colours[colour], (x + side - 1, y + side - 1)
        if kind == "circle":
            draw.ellipse([x, y, *corner], fill=fill)
        elif kind == "square":
            draw.rectangle([x, y, *corner], fill=fill)
        else:  # triangle, point up
            draw.polygon([(x, corner[1]), (corner[0], corner[1]), (x + (side - 1) / 2, y)], fill=fill)
        shapes.append((colour, kind, [float(x), float(y), float(x + side), float(y + side)]))
    present = {(c, k) for c, k, _ in shapes}
    if one:
        colour, kind, box = shapes[int(rng.integers(len(shapes)))]
        return image, ("the {c} {k}", "{c} {k}")[int(rng.integers(2))].format(c=colour, k=kind), [box]
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


def make_heldout(folder: Path, n: int, size: int = 112, one: bool = False) -> Path:
    """``n`` scenes of ``heldout_scene`` at ``size`` px as canonical JSONL (``bboxes``: the named
    set, [] for none; ``one``: ``bbox``, the single-object task) and PNGs,
    ``folder/{heldout,single}-SIZE.jsonl``; the same arguments write the same files (the 112 px
    set scenes are the ones every earlier figure was measured on)."""
    kind = "single" if one else "heldout"
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(HELDOUT_SEED if size == 112 and not one else [HELDOUT_SEED, size, one])
    records = []
    for i in range(n):
        image, phrase, named = heldout_scene(rng, size, one)
        name = f"images/{kind}-{size}-{i:05d}.png"
        image.save(folder / name)
        truth = {"bbox": named[0]} if one else {"bboxes": named}
        records.append({"id": f"{kind}-{size}-{i}", "image": name, "width": size, "height": size, "phrase": phrase,
                        **truth, "split": "heldout", "source": "every_proof"})
    write_samples(folder / f"{kind}-{size}.jsonl", records)
    return folder / f"{kind}-{size}.jsonl"


def score_models(models: list[str], work: Path, n: int) -> dict:
    """Each model as it is (no training) on the held-out sets and single-object scenes at every
    size in SIZES: {model: {"sets-112": scores, "single-112": scores, ...}}."""
    data = {f"{kind}-{size}": make_heldout(work / "heldout", n, size, kind == "single")
            for size in SIZES for kind in ("sets", "single")}
    result = {}
    for model in models:
        gm = infer.load(model)
        result[model] = {}
        for name, path in data.items():
            report, rows = evaluate(gm, read_samples(path), path, progress=False, max_new_tokens=128)
            result[model][name] = scores(report)
            if name.startswith("sets-"):
                result[model][name].update(breakdown(rows, path.parent))
            print(f"{model[-28:]:>28}  {name:<11}" + "  ".join(
                f"{k} {report[k]:.3f}" for k in ("acc@0.5", "f1@0.5", "n_acc") if report.get(k) is not None), flush=True)
    return result


def phrase_form(phrase: str) -> str:
    """Which attributes a held-out set phrase names (TEMPLATES, COLOUR_ONLY, KIND_ONLY)."""
    words = phrase.split()
    colour = any(w in DEFAULT_PALETTE.colours for w in words)
    return ("colour and kind" if words[-1] not in ("shape", "shapes") else "colour") if colour else "kind"


def named_colour_share(rows: list[dict], folder: Path) -> float | None:
    """Of the boxes answered to phrases that name a colour, the share whose centre pixel has that
    colour (each shape is one flat colour of the palette; a box on the background counts as wrong).
    ``folder``: where the rows' image paths start."""
    right = answered = 0
    for row in rows:
        named = [w for w in row["phrase"].split() if w in DEFAULT_PALETTE.colours]
        if not named or not row["pred_boxes"]:
            continue
        pixels = np.asarray(Image.open(folder / row["image"]).convert("RGB"), dtype=int)
        for x1, y1, x2, y2 in row["pred_boxes"]:
            x = min(max(int((x1 + x2) / 2), 0), pixels.shape[1] - 1)
            y = min(max(int((y1 + y2) / 2), 0), pixels.shape[0] - 1)
            right += int(np.abs(pixels[y, x] - np.array(DEFAULT_PALETTE.colours[named[0]])).sum() < 90)
            answered += 1
    return round(right / answered, 3) if answered else None


def breakdown(rows: list[dict], folder: Path) -> dict:
    """The set scenes' scores per phrase form and per number of named shapes, and how often a box
    answered to a colour phrase has that colour."""
    def grouped(key) -> dict:
        groups: dict[str, list[dict]] = {}
        for row in rows:
            groups.setdefault(key(row), []).append(row)
        return {name: {"n": len(group), **scores(summarise(group))} for name, group in sorted(groups.items())}

    return {"by_phrase_form": grouped(lambda row: phrase_form(row["phrase"])),
            "by_targets": grouped(lambda row: {0: "none", 1: "1"}.get(len(row["true_boxes"]), "2-6")),
            "named_colour_share": named_colour_share(rows, folder)}


def groundtune(*args: str) -> float:
    """A groundtune command as a user types it; its wall time in seconds."""
    started = time.time()
    subprocess.run([sys.executable, "-m", "groundtune", *args], check=True)
    return round(time.time() - started, 1)


def scores(report: dict) -> dict:
    return {k: report.get(k) for k in METRICS}


RUNS = (("text", []), ("text_loss_per_sample", ["loss_per=sample"]), ("text_loss_per_first", ["loss_per=first"]),
        ("box_head", ["head=box"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="/tmp/every_proof", help="data and run folders")
    parser.add_argument("--n", type=int, default=500, help="held-out samples per set and size")
    parser.add_argument("--out", default="bench/results/every_proof_sizes.json")
    parser.add_argument("--score", nargs="+", metavar="MODEL",
                        help="only score these models as they are on the held-out sets of every size")
    parser.add_argument("overrides", nargs="*", help="key=value settings for every run (a smoke run: max_steps=2)")
    args = parser.parse_args()
    work = Path(args.work)
    if args.score:
        try:
            result = score_models(args.score, work, args.n)
        except GroundtuneError as e:  # a folder that is not a model: one line, exit 2
            parser.error(str(e))
        with atomic_write(args.out) as f:
            f.write(json.dumps(stamped(result), indent=2) + "\n")
        return
    result = {"heldout": {"n": args.n, "sizes": list(SIZES), "generator": "bench/every_proof.py heldout_scene",
                          "seed": HELDOUT_SEED}, "runs": {}}
    for name, extra in RUNS:
        run = work / name
        seconds = groundtune("train", "quickstart-every", f"out_dir={run}", "overwrite=true", *extra, *args.overrides)
        result["runs"][name] = {"train_wall_s": seconds,
                                "command": " ".join(["groundtune train quickstart-every", *extra])}
    scored = score_models([str(work / name) for name, _ in RUNS] + ["tiny"], work, args.n)
    for name, _ in RUNS:
        result["runs"][name].update(scored[str(work / name)])
    result["runs"]["tiny_untrained"] = scored["tiny"]
    gm = infer.load(str(work / "box_head"), device="cpu")
    sweep = {}
    for threshold in (0.3, 0.4, 0.5, 0.6, 0.7):  # one forward pass per sample: cheap to answer again
        head.head_of(gm.model).threshold = threshold
        for size in SIZES:
            data = work / "heldout" / f"heldout-{size}.jsonl"
            report, _ = evaluate(gm, read_samples(data), data, progress=False)
            sweep[f"{threshold} at {size}"] = {k: report.get(k) for k in ("f1@0.5", "precision@0.5", "recall@0.5",
                                                                          "n_acc")}
    result["box_head_threshold"] = sweep
    text, box = result["runs"]["text"], result["runs"]["box_head"]
    targets = {"text end to end <= 300 s": text["train_wall_s"] <= 300,
               "box head in no more wall time": box["train_wall_s"] <= text["train_wall_s"]}
    for size in SIZES:
        t, b = text[f"sets-{size}"], box[f"sets-{size}"]
        targets[f"text f1@0.5 >= 0.80 at {size}"] = (t["f1@0.5"] or 0) >= 0.80
        targets[f"text n_acc >= 0.90 at {size}"] = (t["n_acc"] or 0) >= 0.90
        targets[f"box head within 5 F1 points at {size}"] = (b["f1@0.5"] or 0) >= (t["f1@0.5"] or 0) - 0.05
    result["targets"] = targets
    with atomic_write(args.out) as f:
        f.write(json.dumps(stamped(result), indent=2) + "\n")
    for name, row in result["runs"].items():
        print(f"{name:<22}" + "  ".join(f"{k} F1 {row[k]['f1@0.5'] or 0:.3f} N {row[k]['n_acc'] or 0:.3f}"
                                        for k in row if k.startswith("sets-"))
              + "  " + "  ".join(f"{k} Acc {row[k]['acc@0.5'] or 0:.3f}" for k in row if k.startswith("single-"))
              + (f"  train {row['train_wall_s']} s" if "train_wall_s" in row else ""))
    print("targets:", targets)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
