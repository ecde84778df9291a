"""The command line: an explicit table of commands, each calling one Python function.

    groundtune data convert|check|show|synth|refgen
    groundtune plan | train | rl | eval | predict | export | serve | quickstart

Each handler only turns flags into arguments; the work is in the function it calls, which is
what Python users call too. Imports are inside handlers so `groundtune --help` starts fast.

A mistake of the user's (a groundtune error: a bad setting, file, record or model name) is one
line on stderr and exit code 2; anything else (a bug, CUDA out of memory, a broken install) keeps
its traceback and exits 1. ``groundtune --debug COMMAND`` shows the traceback of every error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback

from groundtune.boxes import FAMILIES
from groundtune.errors import GroundtuneError, RankLostError, UsageError
from groundtune.files import not_an_input
from groundtune.protocols import DEFAULT_PROTOCOL, PROTOCOLS
from groundtune.runs import RunFolder


class _Parser(argparse.ArgumentParser):
    """argparse, with a mistake on the command line said as every other user mistake is: one line,
    ``error: ...``, exit 2 (argparse prints the whole usage first, several lines for most commands)."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action):  # no "(default: None)": such a help says what happens unset
        return action.help if action.default is None else super()._get_help_string(action)


# --------------------------------------------------------------------------------------------
# data


def _data_convert(args: argparse.Namespace) -> int:
    from collections import Counter

    from groundtune.data import sources

    not_an_input(args.out, "--out", {"--refs": args.refs, "--instances": args.instances, "--path": args.path})
    if args.source != "coco" and (args.negatives or args.one_per_box):
        flag = "--negatives" if args.negatives else "--one-per-box"
        raise UsageError(f"groundtune data convert: {flag} is for --from coco, not --from {args.source}")
    counts = Counter()
    if args.source == "refcoco":
        _require(args, "refs", "instances", "images")
        n = sources.convert_refcoco(args.refs, args.instances, args.images, args.out, split=args.split)
    elif args.source == "grefcoco":
        _require(args, "refs", "instances", "images")
        n = sources.convert_grefcoco(args.refs, args.instances, args.images, args.out, split=args.split,
                                     counts=counts)
    elif args.source == "parquet":
        _require(args, "path", "images_out")
        n = sources.convert_parquet(args.path, args.images_out, args.out, split=args.split)
    elif args.source == "coco":
        _require(args, "instances", "images")
        n = sources.convert_coco(args.instances, args.images, args.out, split=args.split, negatives=args.negatives,
                                 seed=args.seed, one_per_box=args.one_per_box, counts=counts)
    else:
        _require(args, "path")
        n = sources.convert_jsonl(args.path, args.out)
    print(f"wrote {n} samples to {args.out}")
    if args.source in ("coco", "grefcoco"):
        crowd = ("crowd boxes" if args.one_per_box else "(image, category) pairs with a crowd box"
                 if args.source == "coco" else "sentences of refs naming a crowd box")
        empty = f", {counts['empty_sentence']} empty sentences" if counts["empty_sentence"] else ""
        print(f"  {counts['with_boxes']} with boxes, {counts['no_target']} with no target; "
              f"left out: {counts['crowd']} {crowd}{empty}")
    if args.one_per_box:
        print(f"warning: --one-per-box: {counts['repeated']} of {n} lines name a category that repeats in their image; "
              "there the phrase names every box of it and the line only one, which teaches a model to pick one "
              "at random. Without --one-per-box each line holds every box of its category", file=sys.stderr)
    return 0


def _data_check(args: argparse.Namespace) -> int:
    from groundtune.data import check

    if args.fix_out is not None:
        not_an_input(args.fix_out, "--fix-out", {"the file being checked": args.file})
    if args.refs:
        from groundtune.data import refcheck

        report = refcheck.check_refs(args.file, fix_out=args.fix_out)
        print(json.dumps(report.to_dict()) if args.json else report.summary())
        return 1 if report.failed else 0
    report = check.check_file(args.file, fix_out=args.fix_out)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print(report.summary())
    return 0 if report.trainable else 1


def _data_show(args: argparse.Namespace) -> int:
    from groundtune.boxes import ResizeSpec
    from groundtune.data import show
    from groundtune.models import qwen

    not_an_input(args.out, "--out", {"the file being drawn": args.file})
    family = qwen.family(args.family)
    resize = ResizeSpec(factor=family.factor, min_pixels=args.min_pixels or family.min_pixels,
                        max_pixels=args.max_pixels or family.max_pixels)
    path = show.show_grid(args.file, args.out, n=args.n, resize=resize, seed=args.seed)
    print(f"wrote {path}")
    return 0


def _data_synth(args: argparse.Namespace) -> int:
    from groundtune.data import synth

    path = synth.make_synthetic_set(
        args.out,
        n=args.n,
        seed=args.seed,
        width=args.width,
        height=args.height,
        split=args.split,
        task=args.task,
        workers=args.workers,
        canvas=args.canvas,
    )
    print(f"wrote {args.n} samples to {path}")
    return 0


def _data_refgen(args: argparse.Namespace) -> int:
    from groundtune.data import refgen
    from groundtune.data.records import write_samples

    not_an_input(args.out, "--out", {"--instances": args.instances, "--path": args.path})
    settings = refgen.RefgenSettings(kinds=refgen.parse_kinds(args.kinds), per_box=args.per_box,
                                     min_size=args.min_size, seed=args.seed)
    if args.filter_model is None and (args.filter_iou is not None or args.filter_mode is not None):
        raise UsageError("groundtune data refgen: --filter-iou and --filter-mode need --filter-model")
    if args.filter_iou is not None and not 0 < args.filter_iou <= 1:
        raise UsageError(f"groundtune data refgen: --filter-iou must be in (0, 1], got {args.filter_iou}")
    if args.filter_model is not None:
        from groundtune.models.loading import resolve

        resolve(args.filter_model)  # a wrong model name is said before any work
    if args.source == "coco":
        _require(args, "instances", "images", command="refgen")
        images = refgen.from_coco(args.instances, args.images, args.out, split=args.split,
                                  attribute_field=args.attribute_field)
    else:
        _require(args, "path", command="refgen")
        images = refgen.from_jsonl(args.path, args.out, attribute_field=args.attribute_field)
    stats = refgen.Stats()
    records = list(refgen.generate(images, settings, stats))
    agreed, min_iou = None, refgen.MODEL_FILTER_IOU if args.filter_iou is None else args.filter_iou
    # the filter asks for one box back: set and none phrases pass it untouched (data check --refs
    # is what verifies them)
    boxed = [r for r in records if "target" in r]
    if args.filter_model is not None:
        from groundtune import evaluate, infer

        gm = infer.load(args.filter_model, device=args.device, who="refgen --filter-model")
        filtered, agreed = evaluate.filter_by_model(gm, boxed, args.out, min_iou=min_iou,
                                                    flag_only=args.filter_mode == "flag", batch_size=args.batch_size)
        kept = {r["id"]: r for r in filtered}
        records = [kept.get(r["id"], r) for r in records if "target" not in r or r["id"] in kept]
    n = write_samples(args.out, records)
    if args.stats:
        print(refgen.format_stats(stats))
    if agreed is not None:
        what = "flagged the rest" if args.filter_mode == "flag" else "kept those"
        print(f"--filter-model {args.filter_model}: boxed back {agreed} of {len(boxed)} one-box phrases at IoU >= "
              f"{min_iou}; {what}; set and none phrases are not filtered")
    one_box = sum("target" in r for r in records)
    sets = sum(stats.expressions[k] for k in refgen.SET_KINDS)
    print(f"wrote {n} expressions to {args.out}: {one_box} naming one box ({stats.targets} of {stats.boxes} boxes "
          f"have one), {sets} naming sets, {stats.expressions['none']} naming nothing")
    return 0


def _int_at_least(minimum: int, name: str):
    """An argparse type: an integer of at least ``minimum``; argparse names it by ``name`` ("invalid
    positive integer value: 'x'")."""
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = name
    return parse


_positive_int = _int_at_least(1, "positive integer")
_count = _int_at_least(0, "count")
_canvas_side = _int_at_least(8, "canvas side")  # synth draws shapes of a few pixels at least


def _canvas_range(text: str) -> tuple[int, int]:
    """An argparse type: ``MIN-MAX`` canvas sides (synth.parse_canvas)."""
    from groundtune.data.synth import parse_canvas

    try:
        return parse_canvas(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _require(args: argparse.Namespace, *names: str, command: str = "convert") -> None:
    missing = [n for n in names if getattr(args, n) is None]
    if missing:
        flags = ", ".join("--" + n.replace("_", "-") for n in missing)
        raise UsageError(f"groundtune data {command} --from {args.source}: missing {flags}")


def _add_data(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser(
        "data",
        help="convert, check, draw and synthesise grounding data; referring expressions from detections",
        description="Everything about data: convert sources to canonical JSONL, check it, draw it, "
        "make the built-in synthetic set, and turn detection boxes into referring expressions.\n\n"
        "Canonical JSONL: one referring expression per line, "
        '{"id", "image", "width", "height", "phrase", "bbox": [x1, y1, x2, y2] in pixels of the '
        'original image, "split", "source"}.',
        formatter_class=_Formatter,
    )
    dsub = data.add_subparsers(dest="data_command", required=True, metavar="COMMAND")
    for add in (_add_data_convert, _add_data_check, _add_data_show, _add_data_synth, _add_data_refgen):
        add(dsub)


def _add_data_convert(dsub: argparse._SubParsersAction) -> None:
    p = dsub.add_parser(
        "convert",
        help="turn RefCOCO/gRefCOCO/COCO/parquet/JSONL into canonical JSONL",
        description="Convert a dataset to canonical JSONL (boxes as xyxy in original pixels). A phrase names a\n"
        "SET of boxes: bbox for one, bboxes for several, \"bboxes\": [] for a phrase with no target.\n\n"
        "examples:\n"
        "  groundtune data convert --from refcoco --refs refcoco/refs(unc).p \\\n"
        "      --instances refcoco/instances.json --images coco/train2014 --split val --out val.jsonl\n"
        "  groundtune data convert --from grefcoco --refs grefcoco/grefs(unc).json \\\n"
        "      --instances grefcoco/instances.json --images coco/train2014 --split val --out gval.jsonl\n"
        "  groundtune data convert --from parquet --path RefCOCO/data --images-out images --out all.jsonl\n"
        "  groundtune data convert --from coco --instances instances_val2017.json --images val2017 --out coco.jsonl\n"
        "  groundtune data convert --from coco --instances instances_val2017.json --images val2017 \\\n"
        "      --negatives 2 --out coco-neg.jsonl\n"
        "  groundtune data convert --from jsonl --path mine.jsonl --out clean.jsonl\n\n"
        "--from coco writes one line per (image, category) with every box of the category (\"cup\" names\n"
        "every cup); a category with a crowd box in the image is left out (how many it holds is\n"
        "unknown) and counted. --from grefcoco writes one line per sentence, its ref's boxes or [].",
        formatter_class=_Formatter,
    )
    p.add_argument("--from", dest="source", required=True, choices=["refcoco", "grefcoco", "parquet", "coco", "jsonl"],
                   help="source format")
    p.add_argument("--out", required=True, help="canonical JSONL file to write")
    p.add_argument("--refs", help="refcoco: the refer toolkit pickle, refs(unc).p / refs(umd).p / refs(google).p; "
                   "grefcoco: grefs(unc).json")
    p.add_argument("--instances", help="refcoco/grefcoco/coco: COCO instances.json with images and annotations")
    p.add_argument("--images", help="refcoco/grefcoco/coco: folder holding the COCO images")
    p.add_argument("--split", help="refcoco/grefcoco: keep only this split (train, val, testA, ...); "
                   "parquet/coco: split name to record")
    p.add_argument("--path", help="parquet: a .parquet file or a folder of them; jsonl: the input file")
    p.add_argument("--images-out", help="parquet: folder to write the embedded images to (once each)")
    p.add_argument("--negatives", type=_count, default=0, metavar="N",
                   help="coco: add up to N lines per image with no target (\"bboxes\": []) for categories of the file "
                   "with no annotation in the image, the category name as the phrase. This assumes the file labels "
                   "every one of its categories in every image, as COCO does for its 80: a category with no box is "
                   "absent. For a data set that does not label exhaustively this is wrong: leave it at 0")
    p.add_argument("--seed", type=int, default=0, help="coco: which categories --negatives draws (same seed, same bytes)")
    p.add_argument("--one-per-box", action="store_true",
                   help="coco: the old form, one line per non-crowd box (bbox). Ambiguous where a category repeats "
                   "in an image (\"cup\" names both cups, the line one); prints a warning saying how often")
    p.set_defaults(handler=_data_convert)


def _add_data_check(dsub: argparse._SubParsersAction) -> None:
    p = dsub.add_parser(
        "check",
        help="find bad records: images, boxes, phrases",
        description="Check a canonical JSONL file and report every problem with its line number.\n"
        "Errors are records that cannot be trained on as they are; warnings are records that are\n"
        "usable after a recorded automatic fix (box clipped by <= 2 px, image converted to RGB...).\n"
        "Exit code 0 when there is no error, 1 otherwise.",
        formatter_class=_Formatter,
    )
    p.add_argument("file", help="canonical JSONL file, or hf:REPO:SPLIT (a data set of the Hub, e.g. "
                   "hf:lmms-lab/RefCOCO:val; docs/data.md)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--fix-out", help="write the usable records, with automatic fixes applied, here "
                   "(with --refs: the records whose phrase picks exactly its box)")
    p.add_argument("--refs", action="store_true",
                   help="instead: check that every phrase of a `data refgen` file picks exactly its box, re-read "
                   "from the text and the image's boxes (the record's objects) by a checker independent of the "
                   "generator; no image is read. Exit code 1 when any does not")
    p.set_defaults(handler=_data_check)


def _add_data_show(dsub: argparse._SubParsersAction) -> None:
    p = dsub.add_parser(
        "show",
        help="draw samples with their boxes as the model sees them",
        description="Draw a grid of samples: the original image with its box, beside the image after\n"
        "smart_resize with the box mapped by the same function training uses.",
        formatter_class=_Formatter,
    )
    p.add_argument("file", help="canonical JSONL file")
    p.add_argument("--out", required=True, help="PNG file to write")
    p.add_argument("--n", type=_positive_int, default=16, help="number of samples to draw")
    p.add_argument("--seed", type=int, default=0, help="which samples: a random choice with this seed")
    p.add_argument("--family", default="qwen2.5-vl", choices=FAMILIES,
                   help="model family: its resize factor, and its shipped pixel budget unless given below")
    p.add_argument("--max-pixels", type=_positive_int, help="the run's pixel budget (default: the family's shipped one)")
    p.add_argument("--min-pixels", type=_positive_int, help="the run's minimum pixels (default: the family's)")
    p.set_defaults(handler=_data_show)


def _add_data_synth(dsub: argparse._SubParsersAction) -> None:
    from groundtune.data import synth  # numpy and Pillow only: --help stays quick

    p = dsub.add_parser(
        "synth",
        help="make the built-in synthetic grounding set",
        description="Make a synthetic grounding set: 1-3 coloured shapes per image and a phrase that\n"
        "names exactly one of them; or, --task every, 1-6 shapes and a phrase that names a set of them\n"
        "(\"bboxes\") or nothing in the image (\"bboxes\": []). The same seed gives byte-identical files.",
        formatter_class=_Formatter,
    )
    p.add_argument("--out", required=True, help="folder to write SPLIT.jsonl and images/ to")
    p.add_argument("--n", type=_count, default=1000, help="number of samples")
    p.add_argument("--seed", type=_count, default=0, help="random seed")
    p.add_argument("--width", type=_canvas_side, default=synth.CANVAS_SIDE, help="canvas width in pixels")
    p.add_argument("--height", type=_canvas_side, default=synth.CANVAS_SIDE, help="canvas height in pixels")
    p.add_argument("--canvas", type=_canvas_range, metavar="MIN-MAX",
                   help="varied canvases: each sample's width and height drawn from MIN..MAX px, independently "
                        "(non-square too), in place of --width/--height; e.g. 112-224")
    p.add_argument("--split", default=synth.SPLIT, help="split name: the file is OUT/SPLIT.jsonl")
    p.add_argument("--task", default=synth.TASK, choices=synth.TASKS,
                   help="full: 1-3 shapes and relational phrases; single: one shape, 'the {colour} {shape}'; "
                        "attribute: 2-3 shapes named by colour and/or kind; multi: like full with 2-3 shapes; "
                        "every: sets, 1-6 shapes whose colour and kind may repeat and a phrase naming all of a "
                        "colour and/or kind ('every red circle', 'all the squares'), 0 to 6 boxes, at least a "
                        "fifth of the samples naming nothing in the image (no target)")
    p.add_argument("--workers", type=_count, default=0, help="worker processes (0: one per CPU core)")
    p.set_defaults(handler=_data_synth)


def _add_data_refgen(dsub: argparse._SubParsersAction) -> None:
    from groundtune.data.refgen import (
        ATTRIBUTE_FIELD,
        KINDS,
        MODEL_FILTER_IOU,
        RefgenSettings,
    )

    d = RefgenSettings()
    p = dsub.add_parser(
        "refgen",
        help="turn detection boxes into referring expressions that pick exactly their boxes",
        description="Turn detection boxes (COCO instances.json, or JSONL) into canonical JSONL of referring\n"
        "expressions, each written only when it names exactly its box, its set of boxes, or nothing, with\n"
        "a margin. One box (bbox, target):\n"
        "  category   'the laptop' (the only one)       attribute  'the red cup' (from --attribute-field)\n"
        "  extreme    'the leftmost cup', 'the top cup'  ordinal    'the second cup from the left'\n"
        "  size       'the biggest cup', 'the small cup' relation   'the cup left of the laptop',\n"
        "                                                           'the cup next to the laptop'\n"
        "A set of 2+ boxes of a category (bboxes, targets):\n"
        "  set        'every cup', 'all the cups'        set_attribute  'all the red cups'\n"
        "  set_relation  'the cups left of the laptop'\n"
        "Nothing (\"bboxes\": [], targets []): none  'the dog' where no box is a dog, for categories of\n"
        "the COCO file's category list only (--from coco: COCO labels all of them in every image), at\n"
        "most one per image.\n"
        "Each record keeps its kind, the label, and every box of the image (objects) so `groundtune\n"
        "data check --refs` can re-derive that the phrase names exactly its set. Crowd boxes and boxes\n"
        "under --min-size are never targets. The same seed writes the same bytes.\n"
        "Positions need visible separation: both edges a margin (4% of the shorter side) past every\n"
        "other box's on that side, and at most half of the smaller box shared; 'next to' only side by\n"
        "side in one band (never one standing on or inside the other). Boxes under 16 px (or\n"
        "--min-size) never make or change an extreme or ordinal: a phrase that a reader who counts\n"
        "them would read otherwise is not written.\n\n"
        "examples:\n"
        "  groundtune data refgen --from coco --instances instances_val2017.json --images val2017 \\\n"
        "      --out refs.jsonl --stats\n"
        "  groundtune data refgen --from jsonl --path shelves.jsonl --out refs.jsonl --kinds relation=2,extreme,size\n"
        "  groundtune data refgen --from coco --instances inst.json --images imgs --out refs.jsonl \\\n"
        "      --filter-model runs/sft --filter-iou 0.5\n\n"
        "--from jsonl: each line holds an image's boxes as bboxes + labels (lists; optional attribute\n"
        "and crowd lists beside them), or one box as bbox + label; lines naming one image are grouped.\n"
        "It writes no none phrases: a JSONL has no list of the categories labelled in every image.",
        formatter_class=_Formatter,
    )
    p.add_argument("--from", dest="source", required=True, choices=["coco", "jsonl"], help="detections' format")
    p.add_argument("--out", required=True, help="canonical JSONL file to write")
    p.add_argument("--instances", help="coco: instances.json with images, annotations and categories")
    p.add_argument("--images", help="coco: folder holding the images")
    p.add_argument("--path", help="jsonl: the detections file")
    p.add_argument("--split", help="coco: split name to record (default: from the file name, instances_SPLIT.json)")
    p.add_argument("--attribute-field", default=ATTRIBUTE_FIELD,
                   help="the annotation's/record's field holding attribute words of a box (a word or a list)")
    p.add_argument("--kinds", default=",".join(d.kinds),
                   help="kinds to emit, each with an optional weight (kind=weight): any of " + ", ".join(KINDS)
                   + ". A weight chooses among the kinds one box (or one category's set) can have")
    p.add_argument("--per-box", type=_positive_int, default=d.per_box,
                   help="at most this many expressions per box, and per category's set of boxes")
    p.add_argument("--min-size", type=float, default=d.min_size,
                   help="boxes whose sqrt(area) is under this many pixels are never targets or anchors, and (like "
                   "any box under 16 px) are not counted for extremes and ordinals")
    p.add_argument("--seed", type=int, default=d.seed, help="random seed: which phrases and words are chosen")
    p.add_argument("--stats", action="store_true", help="print the count of each kind and of boxes skipped, by reason")
    p.add_argument("--filter-model", metavar="M", help="ground every phrase with this model (" + _MODEL_HELP +
                   ") and keep only those it boxes back (self-consistency)")
    p.add_argument("--filter-iou", type=float, help="with --filter-model: the IoU that counts as boxed back "
                   f"(default {MODEL_FILTER_IOU})")
    p.add_argument("--filter-mode", choices=["keep", "flag"],
                   help="with --filter-model: keep (default) writes only the phrases boxed back; flag writes all, "
                   "each with model_iou and model_agrees")
    _infer_flag(p, "batch_size", when="with --filter-model: ")
    _infer_flag(p, "device", when="with --filter-model: ")
    p.set_defaults(handler=_data_refgen)


# --------------------------------------------------------------------------------------------
# eval and predict

_MODEL_HELP = (
    "the model: `tiny` (the built-in tiny model), a training run folder, a local Hugging Face "
    "folder (an export included) or a hub id such as Qwen/Qwen2.5-VL-3B-Instruct"
)


def _eval(args: argparse.Namespace) -> int:
    from groundtune.evaluate import run_eval

    if args.out is not None:
        not_an_input(args.out, "--out", {"--data": args.data})
    run_eval(
        args.model,
        args.data,
        limit=args.limit,
        out=args.out,
        gallery=args.gallery,
        compare=args.compare,
        batch_size=args.batch_size,
        max_pixels=args.max_pixels,
        min_pixels=args.min_pixels,
        device=args.device,
        max_new_tokens=args.max_new_tokens,
        protocol=args.protocol,
        compile=args.compile,
    )
    return 0


def _predict(args: argparse.Namespace) -> int:
    if args.jsonl is not None:
        if args.out is None or args.image is not None or args.phrase is not None or args.draw is not None:
            raise UsageError("groundtune predict --jsonl: needs --out, and takes no --image/--phrase/--draw")
    elif args.image is None or args.phrase is None or args.out is not None:
        raise UsageError("groundtune predict: give --image and --phrase, or --jsonl and --out")
    if args.jsonl is not None:
        not_an_input(args.out, "--out", {"--jsonl": args.jsonl})
    elif args.draw is not None:
        not_an_input(args.draw, "--draw", {"--image": args.image})

    from groundtune import infer
    from groundtune.data.images import load_image
    from groundtune.data.records import atomic_write

    if args.jsonl is not None:
        records = infer.read_queries(args.jsonl)  # a bad file is said before the model loads
        gm = infer.load(args.model, device=args.device, compile=args.compile)
        n = infer.predict_jsonl(gm, args.jsonl, args.out, batch_size=args.batch_size,
                                max_new_tokens=args.max_new_tokens, records=records)
        print(f"wrote {n} predictions to {args.out}", file=sys.stderr)
        return 0
    image = load_image(args.image)  # a missing or broken image is said before the model loads
    gm = infer.load(args.model, device=args.device)
    pred = infer.predict(gm, [image], [args.phrase], max_new_tokens=args.max_new_tokens, names=[args.image])[0]
    print(json.dumps(pred.to_json(), ensure_ascii=False))
    if args.draw:
        from groundtune.evaluate import draw_boxes

        with atomic_write(args.draw, "wb") as f:
            draw_boxes(image, [], pred.bbox).save(f, format="PNG")
    return 0


def _add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="score a model on a canonical JSONL file: Acc@0.5/0.75, mIoU, set F1/precision/recall, N-acc, "
             "parse failures",
        description="Predict the boxes of every sample with greedy decoding and score them against the\n"
        "true boxes (a phrase names one box, several, or none: \"bboxes\": []), overall and per split\n"
        "and source. The model's own saved resize settings and prompt are used, as in training.\n\n"
        "single target (RefCOCO's meaning, over the samples with a target): Acc@0.5, Acc@0.75,\n"
        "  Acc@0.5:0.95 (mean over IoU thresholds 0.5, 0.55, ..., 0.95) and mean IoU of the answer's\n"
        "  FIRST box with the best-matching true box\n"
        "sets (boxes matched one to one at IoU >= 0.5, over all samples): precision, recall and\n"
        "  F1@0.5 of the boxes; set_acc@0.5, samples answered exactly (every true box found, none\n"
        "  extra; [] for no target); N-acc, no-target samples answered []; T-acc, samples with a\n"
        "  target answered with at least one box; AP and AP@0.5 (COCO's) when the model scores its\n"
        "  boxes (a box head)\n"
        "parse failures: answers that could not be read (an answer [] was read); they score IoU 0,\n"
        "  never a guessed box\n\n"
        "examples:\n"
        "  groundtune eval --model tiny --data data/synth/val.jsonl --limit 50\n"
        "  groundtune eval --model runs/sft --data val.jsonl --out report.json --gallery gallery/\n"
        "  groundtune eval --model Qwen/Qwen2.5-VL-3B-Instruct --data refcoco_val.jsonl --batch-size 32\n"
        "  groundtune eval --model runs/rl --compare runs/sft --data val.jsonl --out compare.json",
        formatter_class=_Formatter,
    )
    p.add_argument("--model", required=True, help=_MODEL_HELP)
    p.add_argument("--data", required=True, help="canonical JSONL file with true boxes, or hf:REPO:SPLIT "
                   "(a data set of the Hub, e.g. hf:lmms-lab/RefCOCO:val)")
    p.add_argument("--limit", type=_positive_int, help="evaluate only the first N samples")
    p.add_argument("--out", help="write the report as JSON here")
    p.add_argument("--gallery", help="write PNGs of the worst and some of the best answers, and an "
                   "index.html, to this folder (the --compare model's go to FOLDER/compare)")
    p.add_argument("--compare", metavar="M2", help="a second model evaluated on the same samples; "
                   "both reports side by side")
    _infer_flag(p, "batch_size")
    p.add_argument("--max-pixels", type=_positive_int, help="override the model's saved pixel budget (warned: "
                   "a budget other than training's usually costs accuracy)")
    p.add_argument("--min-pixels", type=_positive_int, help="override the model's saved minimum pixels")
    p.add_argument("--protocol", choices=list(PROTOCOLS), default=DEFAULT_PROTOCOL,
                   help="whose prompt is asked and whose rules read the answers: groundtune (the model's own "
                   "prompt, its family's coordinates), qwen (Qwen's official prompt), lmms-eval or vlmevalkit "
                   "(those harnesses' prompts and readings, for numbers comparable with theirs; "
                   "docs/eval-and-inference.md). Recorded in the report.")
    _infer_flag(p, "max_new_tokens")
    _infer_flag(p, "device")
    _infer_flag(p, "compile")
    p.set_defaults(handler=_eval)


def _infer_flag(p: argparse.ArgumentParser, name: str, when: str = "") -> None:
    """The flag of the InferSettings field ``name`` (--batch-size for batch_size), with the field's
    default and help; ``when`` opens the help of a flag that acts only with another. From
    config.py, not infer.py: that imports torch, and --help stays quick."""
    from groundtune.config import InferSettings

    f = next(f for f in dataclasses.fields(InferSettings) if f.name == name)
    if isinstance(f.default, bool):  # a switch (--compile)
        p.add_argument("--" + name.replace("_", "-"), action="store_true", help=when + f.metadata["help"])
        return
    p.add_argument("--" + name.replace("_", "-"), type=_positive_int if isinstance(f.default, int) else str,
                   default=f.default, help=when + f.metadata["help"])


def _add_predict(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "predict",
        help="ground a phrase in an image (or every line of a JSONL file)",
        description="Ground a phrase in an image with greedy decoding and print one JSON line:\n"
        '  {"bbox": [x1, y1, x2, y2], "label": ..., "raw": ..., "error": ...}\n'
        "bbox is in pixels of the ORIGINAL image (rounded to 0.1), whatever the model's coordinate\n"
        "convention; it is null and error says why when the answer holds no usable box. The model's\n"
        "own saved resize settings and prompt are used, as in training.\n\n"
        "With --jsonl, every line (canonical JSONL, or just image + phrase) is written to --out with a\n"
        '"prediction" object of the same form added.\n\n'
        "examples:\n"
        '  groundtune predict --model tiny --image shapes.png --phrase "the red circle"\n'
        '  groundtune predict --model Qwen/Qwen2.5-VL-3B-Instruct --image cat.jpg --phrase "the cat" \\\n'
        "      --draw cat_box.png\n"
        "  groundtune predict --model runs/sft --jsonl val.jsonl --out predictions.jsonl",
        formatter_class=_Formatter,
    )
    p.add_argument("--model", required=True, help=_MODEL_HELP)
    p.add_argument("--image", help="image file")
    p.add_argument("--phrase", help="what to find, e.g. 'the man in the red shirt'")
    p.add_argument("--draw", metavar="OUT.png", help="also save the image with the predicted box drawn")
    p.add_argument("--jsonl", metavar="IN", help="predict every line of this JSONL file instead")
    p.add_argument("--out", help="with --jsonl: the JSONL file to write")
    _infer_flag(p, "batch_size", when="with --jsonl: ")
    _infer_flag(p, "max_new_tokens")
    _infer_flag(p, "device")
    _infer_flag(p, "compile", when="with --jsonl: ")
    p.set_defaults(handler=_predict)


def _add_export(sub: argparse._SubParsersAction) -> None:
    from groundtune.config import EXPORT_DTYPE, EXPORT_DTYPES

    p = sub.add_parser(
        "export",
        help="write a model as a folder transformers and vLLM load without groundtune (LoRA merged)",
        description="Write MODEL (a run folder, a model folder, a hub id, tiny) to --out as a self-contained\n"
        "Hugging Face folder: a LoRA adapter merged into its base (a QLoRA adapter into the base's\n"
        "full-precision weights), safetensors, tokenizer and chat template, a preprocessor_config.json\n"
        "carrying the run's pixel budget (the stock processor then resizes as training did), greedy\n"
        "generation defaults, groundtune.json, and a model card with the eval result and how to map a\n"
        "box back to the caller's image. groundtune predict/eval/serve --model OUT load it too.\n"
        "With --onnx, a box-head model (head=box) is also written as model.onnx: vision tower, language\n"
        "model and head in one fp32 graph for images of one size (dynamic batch and phrase length), with\n"
        "onnx_predict.py, which runs it with onnxruntime, numpy, pillow and tokenizers alone.\n"
        "With --push-to-hub REPO, the written folder, every file of it, is then uploaded to that model repo\n"
        "on the Hugging Face Hub (made if it is not there), with the token of `hf auth login` or HF_TOKEN.\n\n"
        "examples:\n"
        "  groundtune export quickstart/run --out exports/quickstart\n"
        "  groundtune export runs/sft --out exports/sft --dtype fp32 --overwrite\n"
        "  groundtune export runs/sft --out exports/sft --push-to-hub me/sft-grounding --private\n"
        "  groundtune export runs/box --out exports/box --onnx --image-size 640x480\n"
        "  python exports/box/onnx_predict.py exports/box --image photo.jpg --phrase 'the red mug'",
        formatter_class=_Formatter,
    )
    p.add_argument("model", help=_MODEL_HELP)
    p.add_argument("--out", required=True, help="the folder to write (refused if it exists and is not empty)")
    p.add_argument("--dtype", default=EXPORT_DTYPE, choices=EXPORT_DTYPES,
                   help="weights' dtype: base = the dtype the base's weights are stored in")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--onnx", action="store_true",
                   help="also write model.onnx (box-head models; needs pip install 'groundtune[onnx]')")
    p.add_argument("--image-size", type=_image_size, metavar="WxH",
                   help="with --onnx: the size of the images it will see, e.g. 640x480; the graph takes them "
                   "resized as the run resizes that size, and other sizes are stretched to it")
    p.add_argument("--push-to-hub", metavar="REPO",
                   help="then upload the folder to this model repo on the hub, name or owner/name; the repo id "
                   "and the token are checked before the export starts")
    p.add_argument("--private", action="store_true",
                   help="with --push-to-hub: make a new repo private (an existing public one is refused)")
    p.add_argument("--revision", metavar="BRANCH", help="with --push-to-hub: the branch to push to (made from "
                   "main if it is not there; default main)")
    p.add_argument("--commit-message", metavar="MSG", help="with --push-to-hub: the commit's message")
    p.set_defaults(handler=_export)


def _image_size(text: str) -> tuple[int, int]:
    width, x, height = text.lower().partition("x")
    if not x or not width.isdigit() or not height.isdigit() or int(width) < 1 or int(height) < 1:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT in pixels, like 640x480, got {text!r}")
    return int(width), int(height)


def _export(args: argparse.Namespace) -> int:
    from groundtune.deploy.export import export
    from groundtune.deploy.hub import check_hub, push_to_hub

    if args.onnx != (args.image_size is not None):
        raise UsageError("--onnx and --image-size WxH go together: the graph is built for one image size")
    hub_flags = [flag for flag, given in (("--private", args.private), ("--revision", args.revision is not None),
                                          ("--commit-message", args.commit_message is not None)) if given]
    if hub_flags and args.push_to_hub is None:
        raise UsageError(f"{', '.join(hub_flags)}: for a push, which needs --push-to-hub REPO")
    if args.push_to_hub is not None:
        check_hub(args.push_to_hub)  # before the export's minutes, not after
    out = export(args.model, args.out, dtype=args.dtype, overwrite=args.overwrite,
                 say=lambda line: print(line, file=sys.stderr), onnx_image_size=args.image_size)
    if args.push_to_hub is not None:
        print(push_to_hub(out, args.push_to_hub, private=args.private, revision=args.revision,
                          commit_message=args.commit_message, say=lambda line: print(line, file=sys.stderr)))
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from groundtune.deploy.limits import MB, Limits, flag
    from groundtune.deploy.serve import HOST, PORT

    def port(text: str) -> int:
        value = int(text)
        if not 1 <= value <= 65535:
            raise argparse.ArgumentTypeError(f"must be from 1 to 65535, got {value}")
        return value

    def number(text: str) -> float:  # "nan" and "inf" are floats too
        value = float(text)
        if not 0 <= value < float("inf"):
            raise argparse.ArgumentTypeError(f"must be a number of at least 0, got {text}")
        return value

    p = sub.add_parser(
        "serve",
        help="serve a model over HTTP: /v1/ground, OpenAI-compatible /v1/chat/completions, a UI at /",
        description="Serve MODEL over HTTP (FastAPI on uvicorn; pip install \"groundtune[serve]\"):\n"
        "  POST /v1/ground            an image (base64/data: URI, or a multipart upload) and phrase(s) ->\n"
        "                             boxes in pixels of the caller's original image\n"
        "  POST /v1/chat/completions  OpenAI's chat API (streaming too); the boxes in a 'groundtune' field\n"
        "  GET  /v1/models, /health, /metrics (Prometheus), / (a one-page UI)\n"
        "Concurrent requests are answered in batches; a full queue answers 503. Listens on 127.0.0.1\n"
        "unless --host says otherwise; nothing is read from the server's disk or network for a caller.\n\n"
        "examples:\n"
        "  groundtune serve --model quickstart/export\n"
        "  groundtune serve --model runs/sft --host 0.0.0.0 --port 8080 --api-key $GROUNDTUNE_KEY",
        formatter_class=_Formatter,
    )
    p.add_argument("--model", required=True, help=_MODEL_HELP)
    p.add_argument("--host", default=HOST, help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=port, default=PORT, help="port to listen on (1-65535)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (the one way to give it) on /v1/*, /metrics "
                                     "and /openapi.json")
    for f in dataclasses.fields(Limits):  # --batch-size among them: its default and help are InferSettings'
        name, in_mb = flag(f.name), flag(f.name).endswith("-mb")  # a size in bytes is given in MB
        if in_mb or isinstance(f.default, float):
            kind = number
        else:
            kind = _count if f.metadata["least"] == 0 else _positive_int
        p.add_argument(name, dest=f.name, metavar=name[2:].replace("-", "_").upper(), type=kind,
                       default=f.default / MB if in_mb else f.default, help=f.metadata["help"])
    _infer_flag(p, "max_new_tokens")
    _infer_flag(p, "device")
    _infer_flag(p, "compile")
    p.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    from groundtune.deploy.serve import serve

    serve(args.model, args.host, args.port, args.api_key, _limits(args), args.device, args.max_new_tokens,
          args.compile)
    return 0


def _limits(args: argparse.Namespace):
    """serve's Limits from its flags, a size given in MB back in bytes."""
    from groundtune.deploy.limits import MB, Limits, flag

    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(Limits)}
    return Limits(**{name: int(value * MB) if flag(name).endswith("-mb") else value for name, value in given.items()})


# --------------------------------------------------------------------------------------------
# train, rl, quickstart


def _plan(args: argparse.Namespace) -> int:
    from groundtune import plan
    from groundtune.config import TrainConfig, load_config, preset_path

    if args.gpus < 1:
        raise UsageError(f"groundtune plan: --gpus {args.gpus}: expected 1 or more")
    given_card = args.gpu or args.memory_gib is not None
    card = plan.card(args.gpu, args.memory_gib) if given_card else plan.card(plan.DEFAULT_CARD)
    if args.data and not os.path.isfile(args.data):
        what = "a folder, not a JSONL file" if os.path.isdir(args.data) else "no such file"
        raise UsageError(f"groundtune plan: --data {args.data}: {what}")
    given = dict(o.split("=", 1) for o in args.overrides if "=" in o)
    overrides = list(args.overrides) + ([] if "train_data" in given else [f"train_data={plan.PLAN_TRAIN_DATA}"])
    cfg = load_config(TrainConfig, preset_path(args.config), overrides)
    result = plan.plan_run(cfg, card, args.data, args.gpus)  # batch_size=auto: planned at the largest that fits
    if args.json:
        print(json.dumps({**result.plan.to_json(), "model": result.model,
                          "suggestions": [{"change": x.change, "peak_gib": round(x.plan.peak_gib, 2),
                                           "samples_per_s": x.plan.samples_per_s and round(x.plan.samples_per_s, 2)}
                                          for x in result.suggestions]}, indent=1))
    else:
        print(plan.render(result, args.explain))
    return 0


def _add_plan(sub: argparse._SubParsersAction) -> None:
    from groundtune.plan import DEFAULT_CARD

    p = sub.add_parser(
        "plan",
        help="will a training run fit a GPU, how fast will it go, and what to change if not (no model loaded)",
        description="Predict a run's peak GPU memory (weights, adapters and optimizer, activations, the vision\n"
        "tower's pass), whether it fits the card, the largest batch_size that does, its samples/s and time\n"
        "per epoch, and, when it does not fit, the changes that make it fit ranked by speed. From the\n"
        "model's shape, the settings and the data's image sizes, with constants fitted from real steps on\n"
        "an H200 (bench/results/plan_check.json); speed scaled to the card by its bf16 rate and bandwidth.\n"
        "Nothing is loaded and no GPU is needed: it answers in about a second.\n\n"
        "examples:\n"
        "  groundtune plan qwen2.5-vl-7b-lora-24gb --gpu rtx3090\n"
        "  groundtune plan qwen2.5-vl-3b-lora-24gb batch_size=128 --memory-gib 16 --data train.jsonl\n"
        "  groundtune plan qwen2.5-vl-7b-qlora --gpu l4 --json\n"
        "  groundtune plan my.yaml distributed=fsdp2 --gpu a100-80gb --gpus 8 --explain\n\n"
        "key=value settings go before the flags.",
        formatter_class=_Formatter,
    )
    p.add_argument("config", metavar="CONFIG", help="a YAML file or a preset name (as groundtune train takes)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="settings over the file's, as in train")
    p.add_argument("--gpu", metavar="NAME", help="the card, e.g. rtx3090, rtx4090, l4, a100-80gb, h100 (default: "
                   f"{DEFAULT_CARD} unless --memory-gib is given); an unknown name lists the known ones")
    p.add_argument("--memory-gib", type=float, help="the card's memory in GiB (with --gpu: that card with this "
                   "memory; alone: a card of this memory with the reference card's speeds)")
    p.add_argument("--gpus", type=int, default=1, help="GPUs of the run (per-GPU memory under distributed=fsdp2/"
                   "zero2/zero3 shards; samples/s of all of them)")
    p.add_argument("--data", help="canonical JSONL file whose image sizes (width, height) and boxes decide the "
                   "tokens a sample (default: the config's train_data file, else COCO-sized images)")
    p.add_argument("--json", action="store_true", help="print JSON (peak_gib, fits, max_batch_size, "
                   "samples_per_s, epoch_s, parts_gib, suggestions, ...) for scripts")
    p.add_argument("--explain", action="store_true", help="also print the model's assumptions and the card's "
                   "sources")
    p.set_defaults(handler=_plan)


def _train(args: argparse.Namespace) -> int:
    """`groundtune train` and `groundtune rl`: the same command line, each with its settings class."""
    from groundtune.config import RLConfig, TrainConfig, load_config, preset_path

    cls = RLConfig if args.command == "rl" else TrainConfig
    if args.resume:
        # a corrected data file of the same records may be named (train_data=..., eval_data=...)
        given = [args.config] if args.config and "=" in args.config else []
        if args.config and not given:
            raise UsageError(f"groundtune {args.command} --resume RUN takes no config file: the run's saved "
                             f"{RunFolder(args.resume).config.name} is used, so the resumed run is the same run")
        start = dict(resume=args.resume, resume_overrides=tuple(given + args.overrides))
    else:
        if not args.config:
            raise UsageError(f"groundtune {args.command}: give a CONFIG.yaml (or a preset name) or --resume RUN")
        start = dict(cfg=load_config(cls, preset_path(args.config), args.overrides))  # settings first: fast
    if args.command == "rl":
        from groundtune.train.rl import rl as run_fn
    else:
        from groundtune.train.sft import train as run_fn
    from groundtune.train.distributed import from_environment

    run = run_fn(**start)
    if from_environment().main:  # under torchrun, rank 0 speaks for the run
        print(f"run folder: {run}  (model: {RunFolder(run).model})")
    return 0


def _add_train(sub: argparse._SubParsersAction) -> None:
    from groundtune.config import TrainConfig

    _add_run_command(
        sub, "train", TrainConfig, "supervised fine-tuning (LoRA / QLoRA / full)",
        "Fine-tune a model on canonical JSONL.",
        "  groundtune train quickstart max_steps=500\n"
        "  groundtune train qwen2.5-vl-3b-lora-24gb train_data=train.jsonl eval_data=val.jsonl\n"
        "  groundtune train my.yaml model=Qwen/Qwen2.5-VL-7B-Instruct method=qlora lr=1e-4\n"
        "  groundtune train --resume runs/sft        # after Ctrl-C, SIGTERM, `touch runs/sft/STOP` or a "
        "crash\n")


def _add_rl(sub: argparse._SubParsersAction) -> None:
    from groundtune.config import RLConfig

    _add_run_command(
        sub, "rl", RLConfig, "reinforcement learning with the box's IoU as reward (GRPO / REINFORCE)",
        "Improve a model (an SFT run's LoRA adapter, or a new one) by sampling answers to\n"
        "prompts and rewarding each by its box's IoU with the truth.",
        "  groundtune rl quickstart-rl model=quickstart/run\n"
        "  groundtune rl my.yaml model=runs/sft train_data=train.jsonl eval_data=val.jsonl kl_coef=0.04\n"
        "  groundtune rl --resume runs/rl\n")


def _add_run_command(sub: argparse._SubParsersAction, name: str, cls, help_text: str, what: str,
                     examples: str) -> None:
    """A command that makes a run folder from ``cls``'s settings (train, rl): CONFIG, key=value
    overrides or --resume RUN, and every setting with its default and help in --help."""
    from groundtune.config import PRESETS, describe

    presets = ", ".join(sorted(p.stem for p in PRESETS.glob("*.yaml")))
    p = sub.add_parser(
        name,
        help=help_text,
        description=f"{what} CONFIG is a YAML file or a shipped preset\n({presets}); any setting can be "
        "overridden as key=value.\n\nexamples:\n" + examples + "\n"
        "The run folder (out_dir) gets model/ (use it with eval/predict), checkpoints/, metrics.jsonl\n"
        f"and tb/ (TensorBoard).\n\nsettings ({cls.__name__}) and their defaults:\n" + describe(cls),
        formatter_class=_Formatter,
    )
    p.add_argument("config", nargs="?", help="YAML file or preset name")
    p.add_argument("overrides", nargs="*", help="key=value settings that override the file")
    p.add_argument("--resume", metavar="RUN", help="continue the run in this folder exactly where it stopped "
                   "(train_data=/eval_data= may name a corrected file of the same records)")
    p.set_defaults(handler=_train)


def _quickstart(args: argparse.Namespace) -> int:
    from groundtune.quickstart import quickstart

    quickstart(args.out, n_train=args.n_train, n_eval=args.n_eval, overrides=tuple(args.overrides))
    return 0


def _add_quickstart(sub: argparse._SubParsersAction) -> None:
    from groundtune.quickstart import N_EVAL, N_TRAIN, OUT

    p = sub.add_parser(
        "quickstart",
        help="the first run: the pre-trained tiny model, LoRA-tuned to a new task variant (CPU, minutes)",
        description="Make a synthetic set of a variant the built-in tiny model was not trained on (168 px\n"
        "canvases), evaluate the tiny model on it, fine-tune it with LoRA (preset `quickstart`), evaluate\n"
        "again and print both, with a gallery. Re-running resumes an unfinished run.\n\n"
        "examples:\n  groundtune quickstart\n  groundtune quickstart --out /tmp/qs max_steps=300",
        formatter_class=_Formatter,
    )
    p.add_argument("overrides", nargs="*", help="key=value training settings (see groundtune train --help)")
    p.add_argument("--out", default=OUT, help="folder for data/, run/, report.json and gallery/")
    p.add_argument("--n-train", type=_positive_int, default=N_TRAIN, help="synthetic training samples of the variant")
    p.add_argument("--n-eval", type=_positive_int, default=N_EVAL, help="synthetic held-out samples (another seed)")
    p.set_defaults(handler=_quickstart)


# --------------------------------------------------------------------------------------------
# The table

COMMANDS = {
    "data": _add_data,
    "plan": _add_plan,
    "train": _add_train,
    "rl": _add_rl,
    "eval": _add_eval,
    "predict": _add_predict,
    "export": _add_export,
    "serve": _add_serve,
    "quickstart": _add_quickstart,
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="groundtune",
        description="Fine-tune Qwen-VL models for visual grounding: image + phrase -> bounding box.",
        formatter_class=_Formatter,
    )
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of every error, the user's mistakes included")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS.values():
        add(sub)
    return parser


# Errors that name what the user gave, whoever raised them: a file or folder that is not there or
# cannot be read (their message holds the path).
_USER_OS_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # the command line's own bars say what is loading; transformers' draw one per weight file
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from groundtune.progress import quiet_libraries

    quiet_libraries()
    try:
        return args.handler(args)
    except (GroundtuneError, *_USER_OS_ERRORS) as e:
        if args.debug:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RankLostError as e:  # the rank that failed first printed why
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # a bug or the machine: the traceback is what a report needs
        traceback.print_exc()
        print(f"\nerror: {type(e).__name__} (above). {_hint(e)}", file=sys.stderr)
        return 1


def _hint(error: Exception) -> str:
    import torch

    if isinstance(error, torch.OutOfMemoryError):
        return ("Out of GPU memory: lower batch_size (or eval_batch_size / --batch-size), max_pixels, or set "
                "gradient_checkpointing=-1; the presets in configs/ are measured for 24 GB cards.")
    return "This is not a known mistake in the input; please report it with the command and the traceback."


if __name__ == "__main__":
    sys.exit(main())
