"""The command line: an explicit table of commands, each calling one Python function.

    groundtune data convert|check|show|synth
    groundtune train | eval | predict

Each handler only turns flags into arguments; the work is in the function it calls, which is
what Python users call too. Imports are inside handlers so `groundtune --help` starts fast.
"""

from __future__ import annotations

import argparse
import json
import sys

from groundtune.boxes import DEFAULT_MAX_PIXELS, MIN_PIXELS


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


# --------------------------------------------------------------------------------------------
# data


def _data_convert(args: argparse.Namespace) -> int:
    from groundtune.data import sources

    if args.source == "refcoco":
        _require(args, "refs", "instances", "images")
        n = sources.convert_refcoco(args.refs, args.instances, args.images, args.out, split=args.split)
    elif args.source == "parquet":
        _require(args, "path", "images_out")
        n = sources.convert_parquet(args.path, args.images_out, args.out, split=args.split)
    elif args.source == "coco":
        _require(args, "instances", "images")
        n = sources.convert_coco(args.instances, args.images, args.out, split=args.split)
    else:
        _require(args, "path")
        n = sources.convert_jsonl(args.path, args.out)
    print(f"wrote {n} samples to {args.out}")
    return 0


def _data_check(args: argparse.Namespace) -> int:
    from groundtune.data import check

    report = check.check_file(args.file, fix_out=args.fix_out)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print(report.summary())
    return 1 if report.errors else 0


def _data_show(args: argparse.Namespace) -> int:
    from groundtune.boxes import ResizeSpec
    from groundtune.data import show

    resize = ResizeSpec(factor=args.factor, min_pixels=args.min_pixels, max_pixels=args.max_pixels)
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
    )
    print(f"wrote {args.n} samples to {path}")
    return 0


def _require(args: argparse.Namespace, *names: str) -> None:
    missing = [n for n in names if getattr(args, n) is None]
    if missing:
        flags = ", ".join("--" + n.replace("_", "-") for n in missing)
        raise SystemExit(f"groundtune data convert --from {args.source}: missing {flags}")


def _add_data(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser(
        "data",
        help="convert, check, draw and synthesise grounding data",
        description="Everything about data: convert sources to canonical JSONL, check it, draw it, "
        "and make the built-in synthetic set.\n\nCanonical JSONL: one referring expression per line, "
        '{"id", "image", "width", "height", "phrase", "bbox": [x1, y1, x2, y2] in pixels of the '
        'original image, "split", "source"}.',
        formatter_class=_Formatter,
    )
    dsub = data.add_subparsers(dest="data_command", required=True, metavar="COMMAND")

    p = dsub.add_parser(
        "convert",
        help="turn RefCOCO/COCO/parquet/JSONL into canonical JSONL",
        description="Convert a dataset to canonical JSONL (boxes as xyxy in original pixels).\n\n"
        "examples:\n"
        "  groundtune data convert --from refcoco --refs refcoco/refs(unc).p \\\n"
        "      --instances refcoco/instances.json --images coco/train2014 --split val --out val.jsonl\n"
        "  groundtune data convert --from parquet --path RefCOCO/data --images-out images --out all.jsonl\n"
        "  groundtune data convert --from coco --instances instances_val2017.json --images val2017 --out coco.jsonl\n"
        "  groundtune data convert --from jsonl --path mine.jsonl --out clean.jsonl",
        formatter_class=_Formatter,
    )
    p.add_argument("--from", dest="source", required=True, choices=["refcoco", "parquet", "coco", "jsonl"],
                   help="source format")
    p.add_argument("--out", required=True, help="canonical JSONL file to write")
    p.add_argument("--refs", help="refcoco: the refer toolkit pickle, refs(unc).p / refs(umd).p / refs(google).p")
    p.add_argument("--instances", help="refcoco/coco: COCO instances.json with images and annotations")
    p.add_argument("--images", help="refcoco/coco: folder holding the COCO images")
    p.add_argument("--split", help="refcoco: keep only this split (train, val, testA, ...); "
                   "parquet/coco: split name to record")
    p.add_argument("--path", help="parquet: a .parquet file or a folder of them; jsonl: the input file")
    p.add_argument("--images-out", help="parquet: folder to write the embedded images to (once each)")
    p.set_defaults(handler=_data_convert)

    p = dsub.add_parser(
        "check",
        help="find bad records: images, boxes, phrases",
        description="Check a canonical JSONL file and report every problem with its line number.\n"
        "Errors are records that cannot be trained on as they are; warnings are records that are\n"
        "usable after a recorded automatic fix (box clipped by <= 2 px, image converted to RGB...).\n"
        "Exit code 0 when there is no error, 1 otherwise.",
        formatter_class=_Formatter,
    )
    p.add_argument("file", help="canonical JSONL file")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--fix-out", help="write the usable records, with automatic fixes applied, here")
    p.set_defaults(handler=_data_check)

    p = dsub.add_parser(
        "show",
        help="draw samples with their boxes as the model sees them",
        description="Draw a grid of samples: the original image with its box, beside the image after\n"
        "smart_resize with the box mapped by the same function training uses.",
        formatter_class=_Formatter,
    )
    p.add_argument("file", help="canonical JSONL file")
    p.add_argument("--out", required=True, help="PNG file to write")
    p.add_argument("--n", type=int, default=16, help="number of samples to draw")
    p.add_argument("--seed", type=int, default=0, help="which samples: a random choice with this seed")
    p.add_argument("--max-pixels", type=int, default=DEFAULT_MAX_PIXELS, help="pixel budget of the model")
    p.add_argument("--min-pixels", type=int, default=MIN_PIXELS, help="minimum pixels of the model")
    p.add_argument("--factor", type=int, default=28, help="resize factor: 28 for Qwen2/2.5-VL, 32 for Qwen3-VL")
    p.set_defaults(handler=_data_show)

    p = dsub.add_parser(
        "synth",
        help="make the built-in synthetic grounding set",
        description="Make a synthetic grounding set: 1-3 coloured shapes per image and a phrase that\n"
        "names exactly one of them. The same seed gives byte-identical files.",
        formatter_class=_Formatter,
    )
    p.add_argument("--out", required=True, help="folder to write SPLIT.jsonl and images/ to")
    p.add_argument("--n", type=int, default=1000, help="number of samples")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--width", type=int, default=112, help="canvas width in pixels")
    p.add_argument("--height", type=int, default=112, help="canvas height in pixels")
    p.add_argument("--split", default="train", help="split name: the file is OUT/SPLIT.jsonl")
    p.add_argument("--task", default="full", choices=["full", "single"],
                   help="full: 1-3 shapes and relational phrases; single: one shape, 'the {colour} {shape}'")
    p.add_argument("--workers", type=int, default=0, help="worker processes (0: one per CPU core)")
    p.set_defaults(handler=_data_synth)


# --------------------------------------------------------------------------------------------
# The table

COMMANDS = {
    "data": _add_data,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="groundtune",
        description="Fine-tune Qwen-VL models for visual grounding: image + phrase -> bounding box.",
        formatter_class=_Formatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS.values():
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from groundtune.data.records import DataError

    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (DataError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
