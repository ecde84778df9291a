"""`groundtune eval` and `groundtune predict`: a model's answers, scored or written."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from groundtune.cli.flags import MODEL_HELP, OVERWRITE_HELP, Formatter, infer_flag, model_files, positive_int
from groundtune.errors import UsageError
from groundtune.files import not_an_input, not_one_of, output_file
from groundtune.protocols import DEFAULT_PROTOCOL, PROTOCOLS


def _eval(args: argparse.Namespace) -> int:
    from groundtune.evaluate import (gallery_files, run_eval, written_by_eval, written_by_eval_samples,
                                     written_by_gallery)

    outs = [(flag, out, written) for flag, out, written in (("--out", args.out, written_by_eval),
                                                            ("--samples", args.samples, written_by_eval_samples))
            if out is not None]
    if args.gallery is not None:  # each file the gallery may write, the --compare model's in FOLDER/compare too
        folders = [Path(args.gallery)] + ([Path(args.gallery) / "compare"] if args.compare else [])
        outs += [("--gallery", path, written_by_gallery) for folder in folders for path in gallery_files(folder)]
    if outs:
        from groundtune.data.records import image_path, jsonl_file, read_samples

        data = jsonl_file(args.data)
        reads = [("an image of --data", image_path(s, data)) for s in read_samples(data)]
        reads += model_files(("--model", args.model), ("--compare", args.compare))
        if args.gallery is not None:
            _gallery_folder(args.gallery, args.data, reads)
        for flag, out, written in outs:
            not_an_input(out, flag, {"--data": args.data})
            output_file(out, flag, "eval", reads, written, args.overwrite)
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
        samples_out=args.samples,
    )
    return 0


def _gallery_folder(gallery: str, data: str, reads: list[tuple[str, Path]]) -> None:
    """--gallery names a folder: a UsageError when it is --data, a file the command reads, or any
    other file (the gallery's own files are checked one by one, as --out)."""
    not_an_input(gallery, "--gallery", {"--data": data})
    if os.path.lexists(gallery) and not Path(gallery).is_dir():
        not_one_of(gallery, "--gallery", reads)
        raise UsageError(f"--gallery {gallery} is a file; name a folder for the gallery")


DRAWN_BY = "groundtune predict --draw"  # in the PNG it writes: a later --draw may replace it


def _predict(args: argparse.Namespace) -> int:
    if args.jsonl is not None:
        if args.out is None or args.image is not None or args.phrase is not None or args.draw is not None:
            raise UsageError("groundtune predict --jsonl: needs --out, and takes no --image/--phrase/--draw")
    elif args.image is None or args.phrase is None or args.out is not None:
        raise UsageError("groundtune predict: give --image and --phrase, or --jsonl and --out")
    if args.jsonl is not None:
        not_an_input(args.out, "--out", {"--jsonl": args.jsonl})
    else:
        from groundtune.data.records import MAX_PHRASE_CHARS, phrase_too_long

        if len(args.phrase) > MAX_PHRASE_CHARS:
            raise UsageError(f"--phrase: {phrase_too_long(args.phrase)}")
        if args.draw is not None:
            not_an_input(args.draw, "--draw", {"--image": args.image})

    from groundtune import infer
    from groundtune.data.images import drawn_by, load_image, png_info
    from groundtune.data.records import atomic_write, image_path

    if args.jsonl is not None:
        records = infer.read_queries(args.jsonl)  # a bad file is said before the model loads
        reads = [("an image of --jsonl", image_path(r, args.jsonl)) for r in records]
        output_file(args.out, "--out", "predict", reads + model_files(("--model", args.model)),
                    infer.written_by_predict, args.overwrite)
        gm = infer.load(args.model, device=args.device, compile=args.compile)
        n = infer.predict_jsonl(gm, args.jsonl, args.out, batch_size=args.batch_size,
                                max_new_tokens=args.max_new_tokens, records=records)
        print(f"wrote {n} predictions to {args.out}", file=sys.stderr)
        return 0
    if args.draw is not None:
        output_file(args.draw, "--draw", "predict", model_files(("--model", args.model)),
                    lambda path: drawn_by(path, DRAWN_BY), args.overwrite)
    image = load_image(args.image)  # a missing or broken image is said before the model loads
    gm = infer.load(args.model, device=args.device)
    pred = infer.predict(gm, [image], [args.phrase], max_new_tokens=args.max_new_tokens, names=[args.image])[0]
    print(json.dumps(pred.to_json(), ensure_ascii=False))
    if args.draw:
        from groundtune.evaluate import draw_boxes

        with atomic_write(args.draw, "wb") as f:
            draw_boxes(image, [], pred.bbox).save(f, format="PNG", pnginfo=png_info(DRAWN_BY))
    return 0


def add_eval(sub: argparse._SubParsersAction) -> None:
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
        formatter_class=Formatter,
    )
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--data", required=True, help="canonical JSONL file with true boxes, or hf:REPO:SPLIT "
                   "(a data set of the Hub, e.g. hf:lmms-lab/RefCOCO:val)")
    p.add_argument("--limit", type=positive_int, help="evaluate only the first N samples")
    p.add_argument("--out", help="write the report as JSON here (never over --data, its images or the model's "
                   "files; over another file only with --overwrite)")
    p.add_argument("--samples", metavar="OUT.jsonl", help="write every answer here, one JSON line a sample: the "
                   "sample, its boxes, IoU, boxes matched, missed and extra (each line names its model; "
                   "`groundtune studio` browses them); the same rules as --out")
    p.add_argument("--overwrite", action="store_true",
                   help=OVERWRITE_HELP.format(what="report (or --samples file, or file of the --gallery)"))
    p.add_argument("--gallery", metavar="FOLDER", help="write PNGs of the worst and some of the best answers, and "
                   "an index.html, to this folder (the --compare model's go to FOLDER/compare); each file the same "
                   "rules as --out")
    p.add_argument("--compare", metavar="M2", help="a second model evaluated on the same samples; "
                   "both reports side by side")
    infer_flag(p, "batch_size")
    p.add_argument("--max-pixels", type=positive_int, help="override the model's saved pixel budget (warned: "
                   "a budget other than training's usually costs accuracy)")
    p.add_argument("--min-pixels", type=positive_int, help="override the model's saved minimum pixels")
    p.add_argument("--protocol", choices=list(PROTOCOLS), default=DEFAULT_PROTOCOL,
                   help="whose prompt is asked and whose rules read the answers: groundtune (the model's own "
                   "prompt, its family's coordinates), qwen (Qwen's official prompt), lmms-eval or vlmevalkit "
                   "(those harnesses' prompts and readings, for numbers comparable with theirs; "
                   "docs/eval-and-inference.md). Recorded in the report.")
    infer_flag(p, "max_new_tokens")
    infer_flag(p, "device")
    infer_flag(p, "compile")
    p.set_defaults(handler=_eval)


def add_predict(sub: argparse._SubParsersAction) -> None:
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
        formatter_class=Formatter,
    )
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--image", help="image file")
    p.add_argument("--phrase", help="what to find, e.g. 'the man in the red shirt'")
    p.add_argument("--draw", metavar="OUT.png", help="also save the image with the predicted box drawn")
    p.add_argument("--jsonl", metavar="IN", help="predict every line of this JSONL file instead")
    p.add_argument("--out", help="with --jsonl: the JSONL file to write (never over --jsonl, its images or the "
                   "model's files)")
    p.add_argument("--overwrite", action="store_true",
                   help=OVERWRITE_HELP.format(what="--out JSONL (or --draw PNG)"))
    infer_flag(p, "batch_size", when="with --jsonl: ")
    infer_flag(p, "max_new_tokens")
    infer_flag(p, "device")
    infer_flag(p, "compile", when="with --jsonl: ")
    p.set_defaults(handler=_predict)

