"""`groundtune data convert|check|show|synth|refgen`: the flags, and handlers that call data/."""

from __future__ import annotations

import argparse
import json
import sys

from groundtune.boxes import FAMILIES
from groundtune.cli.flags import (
    MODEL_HELP,
    OVERWRITE_HELP,
    Formatter,
    canvas_range,
    canvas_side,
    count,
    infer_flag,
    model_files,
    positive_int,
)
from groundtune.errors import UsageError
from groundtune.files import not_an_input, output_file


# the flags each source of `data convert` needs
CONVERT_NEEDS = {"refcoco": ("refs", "instances", "images"), "grefcoco": ("refs", "instances", "images"),
                 "parquet": ("path", "images_out"), "coco": ("instances", "images"), "jsonl": ("path",)}


def _data_convert(args: argparse.Namespace) -> int:
    from collections import Counter

    from groundtune.data import sources
    from groundtune.data.records import named_images

    not_an_input(args.out, "--out", {"--refs": args.refs, "--instances": args.instances, "--path": args.path})
    if args.source != "coco" and (args.negatives or args.one_per_box):
        flag = "--negatives" if args.negatives else "--one-per-box"
        raise UsageError(f"groundtune data convert: {flag} is for --from coco, not --from {args.source}")
    _require(args, *CONVERT_NEEDS[args.source])
    # the images the input names (read lazily: only an --out already there needs them); parquet's are in the file
    images = (named_images(args.path, "an image of --path") if args.source == "jsonl" else
              sources.instance_images(args.instances, args.images) if args.instances is not None else [])
    jsonl_input = args.path if args.source == "jsonl" else None
    output_file(args.out, "--out", "data convert", images, lambda out: sources.written_by_convert(out, jsonl_input),
                args.overwrite)
    counts = Counter()
    if args.source == "refcoco":
        n = sources.convert_refcoco(args.refs, args.instances, args.images, args.out, split=args.split)
    elif args.source == "grefcoco":
        n = sources.convert_grefcoco(args.refs, args.instances, args.images, args.out, split=args.split,
                                     counts=counts)
    elif args.source == "parquet":
        n = sources.convert_parquet(args.path, args.images_out, args.out, split=args.split)
    elif args.source == "coco":
        n = sources.convert_coco(args.instances, args.images, args.out, split=args.split, negatives=args.negatives,
                                 seed=args.seed, one_per_box=args.one_per_box, counts=counts)
    else:
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
    from groundtune.data.records import derived_from, named_images

    if args.fix_out is not None:
        not_an_input(args.fix_out, "--fix-out", {"the file being checked": args.file})
        # a previous --fix-out of the file holds its records; an image the file names is never one
        images = named_images(args.file, "an image of the file being checked")
        output_file(args.fix_out, "--fix-out", "data check", images, lambda out: derived_from(out, args.file),
                    args.overwrite)
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
    from groundtune.data.images import drawn_by
    from groundtune.data.records import named_images
    from groundtune.models import qwen

    not_an_input(args.out, "--out", {"the file being drawn": args.file})
    output_file(args.out, "--out", "data show", named_images(args.file, "an image of the file being drawn"),
                lambda out: drawn_by(out, show.DRAWN_BY), args.overwrite)
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
        palette=synth.PALETTES[args.palette],
        canvas=args.canvas,
        overwrite=args.overwrite,
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
    _require(args, *(("instances", "images") if args.source == "coco" else ("path",)), command="refgen")
    _refgen_out(args)
    if args.source == "coco":
        images = refgen.from_coco(args.instances, args.images, args.out, split=args.split,
                                  attribute_field=args.attribute_field)
    else:
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


def _refgen_out(args: argparse.Namespace) -> None:
    """A UsageError when --out is an image the detections name or a file of --filter-model (a model
    that is not there is said here, before any work), or a file refgen did not write, without
    --overwrite."""
    from itertools import chain

    from groundtune.data.records import named_images
    from groundtune.data.refgen import written_by_refgen
    from groundtune.data.sources import instance_images

    images = (instance_images(args.instances, args.images) if args.source == "coco"
              else named_images(args.path, "an image of --path"))  # read lazily: only an --out already there needs them
    reads = chain(model_files(("--filter-model", args.filter_model)), images)
    output_file(args.out, "--out", "data refgen", reads, written_by_refgen, args.overwrite)


def _require(args: argparse.Namespace, *names: str, command: str = "convert") -> None:
    missing = [n for n in names if getattr(args, n) is None]
    if missing:
        flags = ", ".join("--" + n.replace("_", "-") for n in missing)
        raise UsageError(f"groundtune data {command} --from {args.source}: missing {flags}")


def add_data(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser(
        "data",
        help="convert, check, draw and synthesise grounding data; referring expressions from detections",
        description="Everything about data: convert sources to canonical JSONL, check it, draw it, "
        "make the built-in synthetic set, and turn detection boxes into referring expressions.\n\n"
        "Canonical JSONL: one referring expression per line, "
        '{"id", "image", "width", "height", "phrase", "bbox": [x1, y1, x2, y2] in pixels of the '
        'original image, "split", "source"}.',
        formatter_class=Formatter,
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
        formatter_class=Formatter,
    )
    p.add_argument("--from", dest="source", required=True, choices=["refcoco", "grefcoco", "parquet", "coco", "jsonl"],
                   help="source format")
    p.add_argument("--out", required=True, help="canonical JSONL file to write (never over an input file or an image "
                   "it names; over another file only with --overwrite)")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP.format(what="--out JSONL"))
    p.add_argument("--refs", help="refcoco: the refer toolkit pickle, refs(unc).p / refs(umd).p / refs(google).p; "
                   "grefcoco: grefs(unc).json")
    p.add_argument("--instances", help="refcoco/grefcoco/coco: COCO instances.json with images and annotations")
    p.add_argument("--images", help="refcoco/grefcoco/coco: folder holding the COCO images")
    p.add_argument("--split", help="refcoco/grefcoco: keep only this split (train, val, testA, ...); "
                   "parquet/coco: split name to record")
    p.add_argument("--path", help="parquet: a .parquet file or a folder of them; jsonl: the input file")
    p.add_argument("--images-out", help="parquet: folder to write the embedded images to (once each)")
    p.add_argument("--negatives", type=count, default=0, metavar="N",
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
        formatter_class=Formatter,
    )
    p.add_argument("file", help="canonical JSONL file, or hf:REPO:SPLIT (a data set of the Hub, e.g. "
                   "hf:lmms-lab/RefCOCO:val; docs/data.md)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--fix-out", help="write the usable records, with automatic fixes applied, here "
                   "(with --refs: the records whose phrase picks exactly its box). Never over the file or an image "
                   "it names; a previous --fix-out of the file is replaced, another file only with --overwrite")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP.format(what="--fix-out file"))
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
        formatter_class=Formatter,
    )
    p.add_argument("file", help="canonical JSONL file")
    p.add_argument("--out", required=True, help="PNG file to write (never over the file or an image it names; "
                   "over another file only with --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out PNG that data show did not draw")
    p.add_argument("--n", type=positive_int, default=16, help="number of samples to draw")
    p.add_argument("--seed", type=int, default=0, help="which samples: a random choice with this seed")
    p.add_argument("--family", default="qwen2.5-vl", choices=FAMILIES,
                   help="model family: its resize factor, and its shipped pixel budget unless given below")
    p.add_argument("--max-pixels", type=positive_int, help="the run's pixel budget (default: the family's shipped one)")
    p.add_argument("--min-pixels", type=positive_int, help="the run's minimum pixels (default: the family's)")
    p.set_defaults(handler=_data_show)


def _add_data_synth(dsub: argparse._SubParsersAction) -> None:
    from groundtune.data import synth  # numpy and Pillow only: --help stays quick

    p = dsub.add_parser(
        "synth",
        help="make the built-in synthetic grounding set",
        description="Make a synthetic grounding set: 1-3 coloured shapes per image and a phrase that\n"
        "names exactly one of them; or, --task every, 1-6 shapes and a phrase that names a set of them\n"
        "(\"bboxes\") or nothing in the image (\"bboxes\": []). The same seed gives byte-identical files.",
        formatter_class=Formatter,
    )
    p.add_argument("--out", required=True, help="folder to write SPLIT.jsonl and images/ to")
    p.add_argument("--n", type=count, default=1000, help="number of samples")
    p.add_argument("--seed", type=count, default=0, help="random seed")
    p.add_argument("--width", type=canvas_side, default=synth.CANVAS_SIDE, help="canvas width in pixels")
    p.add_argument("--height", type=canvas_side, default=synth.CANVAS_SIDE, help="canvas height in pixels")
    p.add_argument("--canvas", type=canvas_range, metavar="MIN-MAX",
                   help="varied canvases: each sample's width and height drawn from MIN..MAX px, independently "
                        "(non-square too), in place of --width/--height; e.g. 112-224")
    p.add_argument("--split", default=synth.SPLIT, help="split name: the file is OUT/SPLIT.jsonl")
    p.add_argument("--task", default=synth.TASK, choices=synth.TASKS,
                   help="full: 1-3 shapes and relational phrases; single: one shape, 'the {colour} {shape}'; "
                        "attribute: 2-3 shapes named by colour and/or kind; colour: 2-3 shapes of one kind in distinct colours, "
                        "the colour word the only cue; multi: like full with 2-3 shapes; "
                        "every: sets, 1-6 shapes whose colour and kind may repeat and a phrase naming all of a "
                        "colour and/or kind ('every red circle', 'all the squares'), 0 to 6 boxes, "
                        # "25%%": argparse %-formats help text, and prints it as 25%
                        f"{synth.NO_TARGET_SHARE:.0%}% of the samples naming nothing in the image (no target); "
                        "contrast: every's scenes in pairs, one image asked twice by phrases differing only in "
                        "their colour word (samples 2j, 2j+1)")
    p.add_argument("--palette", default="default", choices=list(synth.PALETTES),
                   help="default: red, green, blue and yellow circles, squares and triangles; unseen: purple, orange, "
                        "pink and brown diamonds and crosses (colours and shapes no built-in model was pre-trained on)")
    p.add_argument("--workers", type=count, default=0, help="worker processes (0: one per CPU core this process may use)")
    p.add_argument("--overwrite", action="store_true", help="replace a synthetic set already at OUT/SPLIT.jsonl, "
                   "and remove its images the new set does not write (never a file synth did not write)")
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
        formatter_class=Formatter,
    )
    p.add_argument("--from", dest="source", required=True, choices=["coco", "jsonl"], help="detections' format")
    p.add_argument("--out", required=True, help="canonical JSONL file to write (never over --instances, --path, an "
                   "image they name or a file of --filter-model; over another file only with --overwrite)")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP.format(what="--out JSONL"))
    p.add_argument("--instances", help="coco: instances.json with images, annotations and categories")
    p.add_argument("--images", help="coco: folder holding the images")
    p.add_argument("--path", help="jsonl: the detections file")
    p.add_argument("--split", help="coco: split name to record (default: from the file name, instances_SPLIT.json)")
    p.add_argument("--attribute-field", default=ATTRIBUTE_FIELD,
                   help="the annotation's/record's field holding attribute words of a box (a word or a list)")
    p.add_argument("--kinds", default=",".join(d.kinds),
                   help="kinds to emit, each with an optional weight (kind=weight): any of " + ", ".join(KINDS)
                   + ". A weight chooses among the kinds one box (or one category's set) can have")
    p.add_argument("--per-box", type=positive_int, default=d.per_box,
                   help="at most this many expressions per box, and per category's set of boxes")
    p.add_argument("--min-size", type=float, default=d.min_size,
                   help="boxes whose sqrt(area) is under this many pixels are never targets or anchors, and (like "
                   "any box under 16 px) are not counted for extremes and ordinals")
    p.add_argument("--seed", type=int, default=d.seed, help="random seed: which phrases and words are chosen")
    p.add_argument("--stats", action="store_true", help="print the count of each kind and of boxes skipped, by reason")
    p.add_argument("--filter-model", metavar="M", help="ground every phrase with this model (" + MODEL_HELP +
                   ") and keep only those it boxes back (self-consistency)")
    p.add_argument("--filter-iou", type=float, help="with --filter-model: the IoU that counts as boxed back "
                   f"(default {MODEL_FILTER_IOU})")
    p.add_argument("--filter-mode", choices=["keep", "flag"],
                   help="with --filter-model: keep (default) writes only the phrases boxed back; flag writes all, "
                   "each with model_iou and model_agrees")
    infer_flag(p, "batch_size", when="with --filter-model: ")
    infer_flag(p, "device", when="with --filter-model: ")
    p.set_defaults(handler=_data_refgen)


