"""`groundtune export` and `groundtune serve`: shipping a model (deploy/)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from groundtune.cli.flags import MODEL_HELP, Formatter, count, infer_flag, port, positive_int
from groundtune.errors import UsageError


def add_export(sub: argparse._SubParsersAction) -> None:
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
        formatter_class=Formatter,
    )
    p.add_argument("model", help=MODEL_HELP)
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


def add_serve(sub: argparse._SubParsersAction) -> None:
    from groundtune.deploy.limits import MB, Limits, flag
    from groundtune.deploy.serve import HOST, PORT

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
        formatter_class=Formatter,
    )
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--host", default=HOST, help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=port, default=PORT, help="port to listen on (1-65535)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (the one way to give it) on /v1/*, /metrics "
                                     "and /openapi.json")
    for f in dataclasses.fields(Limits):  # --batch-size among them: its default and help are InferSettings'
        name, in_mb = flag(f.name), flag(f.name).endswith("-mb")  # a size in bytes is given in MB
        if in_mb or isinstance(f.default, float):
            kind = number
        else:
            kind = count if f.metadata["least"] == 0 else positive_int
        p.add_argument(name, dest=f.name, metavar=name[2:].replace("-", "_").upper(), type=kind,
                       default=f.default / MB if in_mb else f.default, help=f.metadata["help"])
    infer_flag(p, "max_new_tokens")
    infer_flag(p, "device")
    infer_flag(p, "compile")
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

