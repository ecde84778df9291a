"""A box-head ONNX export on ONNX Runtime against the same model in PyTorch (groundtune's own
box-head path, ``infer.head_boxes``), on the CPU, in ONE run: samples/s of each, the ratio, and
the largest difference between their boxes in pixels. PyTorch is timed twice: from the image
(encoding included, as `groundtune predict` runs) and on prompts encoded beforehand (the forward
pass alone).

    python bench/onnx_speed.py --out bench/results/onnx_speed_cpu.json
    python bench/onnx_speed.py --model runs/box --size 640x480 --batch 1,8,32

Default model: the built-in tiny model with a (random) box head. Each (image, phrase) batch is one
image with --batch phrases (what a caller of the export sends); both sides are warmed up on one
batch, then timed over --batches batches, alternating, so that both see the same machine load.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from provenance import stamped

from groundtune import infer
from groundtune.deploy import onnx_export, onnx_predict
from groundtune.models import head
from groundtune.models.adapt import base_model, hidden_size
from groundtune.models.loading import load_model

PHRASES = ["the red circle", "the blue square on the left", "the small green triangle", "the top shape",
           "the yellow cross below the blue diamond", "the biggest circle", "the square", "the shape on the right"]


def time_batch(gm, grounder, images: list, batch: int, batches: int) -> dict:
    """Batches of one image with ``batch`` phrases: ONNX Runtime against PyTorch, alternating."""
    phrases = (PHRASES * (batch // len(PHRASES) + 1))[:batch]
    start_text = infer.answer_start(gm)

    def encode(image):
        encoded, sizes = zip(*(infer.encode_prompt(gm.processor, gm.resize, gm.prompt, image, p, "bench", start_text)
                               for p in phrases))
        return list(encoded), list(sizes)

    encoded_images = {id(image): encode(image) for image in images}
    runs = [("pytorch", lambda image: infer.head_boxes(gm, *encode(image))),
            ("pytorch_forward_only", lambda image: infer.head_boxes(gm, *encoded_images[id(image)])),
            ("onnxruntime", lambda image: grounder.ground(image, phrases))]
    largest = max(float(np.abs(np.array([p.bbox for p in runs[0][1](im)]) - np.array(runs[2][1](im))).max())
                  for im in images)  # and the warm-up
    seconds = dict.fromkeys((name for name, _ in runs), 0.0)
    for i in range(batches):
        for name, fn in runs if i % 2 == 0 else runs[::-1]:
            t = time.perf_counter()
            fn(images[i % len(images)])
            seconds[name] += time.perf_counter() - t
    samples = batches * batch
    row = {"batch": batch, "samples": samples, "largest_box_difference_px": round(largest, 5)}
    row |= {f"{name}_samples_per_s": round(samples / s, 1) for name, s in seconds.items()}
    row |= {"onnxruntime_over_pytorch": round(seconds["pytorch"] / seconds["onnxruntime"], 2),
            "onnxruntime_over_pytorch_forward_only": round(seconds["pytorch_forward_only"] / seconds["onnxruntime"], 2)}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="a box-head run or export (default: tiny + a random head)")
    parser.add_argument("--size", default="168x168", help="image size WxH the graph is exported for")
    parser.add_argument("--batch", default="1,8", help="phrases per image (one batch); several: 1,8")
    parser.add_argument("--batches", type=int, default=40, help="timed batches per size")
    parser.add_argument("--threads", type=int, default=0, help="0: each runtime's default")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    width, height = map(int, args.size.split("x"))
    gm = load_model(args.model, device="cpu", dtype="fp32")
    if head.head_of(gm.model) is None:
        torch.manual_seed(0)
        head.attach(gm.model, hidden_size(base_model(gm.model)))
    box_head = head.head_of(gm.model)
    folder = Path(tempfile.mkdtemp(prefix="onnx_speed_"))
    model = gm.model.merge_and_unload() if hasattr(gm.model, "peft_config") else gm.model
    start = time.perf_counter()
    settings = onnx_export.export_onnx(model, box_head, gm.processor, gm.family, gm.resize, gm.prompt,
                                       (width, height), folder)
    export_seconds = time.perf_counter() - start
    (folder / "groundtune.json").write_text(json.dumps({"onnx": settings}))
    gm.processor.tokenizer.save_pretrained(folder)
    grounder = onnx_predict.Grounder(folder, threads=args.threads)

    rng = np.random.default_rng(0)
    images = [Image.fromarray((rng.random((height, width, 3)) * 255).astype("uint8")) for _ in range(4)]
    rows = [time_batch(gm, grounder, images, batch, args.batches) for batch in map(int, args.batch.split(","))]
    result = {
        "torch_threads": torch.get_num_threads(), "model": args.model, "family": gm.family,
        "image_size": [width, height], "graph_image_size": settings["image_size"],
        "export_seconds": round(export_seconds, 1),
        "onnx_mib": round((folder / onnx_export.ONNX_FILE).stat().st_size / 2**20, 1), "rows": rows,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(stamped(result), indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
