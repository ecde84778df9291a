"""Eval speed of a box head (one forward pass, models/head.py) against text answers (generation)
on the real Qwen2.5-VL-3B/7B architectures (random weights), through `groundtune eval`'s own code
(`evaluate.evaluate`), from image files on disk, in ONE run, capped at --cap-gib (a 24 GB card).

    python bench/head_speed.py --models 3b --out bench/results/head_speed.json
    python bench/head_speed.py --models tiny --samples 16 --batch 8          # CPU smoke test

Data: RefCOCO-like JPEGs (bench/sft_speed.py). The same model answers both ways: text, with
answers forced to --new-tokens tokens (random weights seldom stop; a real 3B answers a box in
~20-30), and box, with a (random) box head attached, which reads each prompt's last hidden state.
Each variant is warmed up on one batch first, then timed from the first file read to the last box;
the box head runs first (with --compile, again with its vision tower compiled). Then one box-head batch is profiled: the vision tower alone against the whole forward pass (the
language model is the difference) over the row in which an image's prompts share their beginning
(``qwen.collate_shared``), the same prompts each time, after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from sft_speed import MODELS, earlier_samples, make_refcoco_like  # noqa: E402
from provenance import stamped  # noqa: E402
from gpu_cap import cap_gpu_memory  # noqa: E402

from groundtune import evaluate, infer  # noqa: E402
from groundtune.data.records import read_samples  # noqa: E402
from groundtune.models import adapt, head, kernels  # noqa: E402


def _now() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def timed_eval(gm, records: list[dict], data: Path, batch: int, new_tokens: int) -> dict:
    evaluate.evaluate(gm, records[:batch], data, batch_size=batch, progress=False, max_new_tokens=new_tokens)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = _now()
    report, _ = evaluate.evaluate(gm, records, data, batch_size=batch, progress=False, max_new_tokens=new_tokens)
    seconds = _now() - start
    return {"samples": len(records), "seconds": round(seconds, 2), "samples_per_s": round(len(records) / seconds, 2),
            "parse_fail_rate": report["parse_fail_rate"],
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None}


def profile_box_batch(gm, records: list[dict], data: Path, batch: int, repeats: int = 3) -> dict:
    """Milliseconds of one box-head batch: the vision tower on its distinct images, the whole
    forward pass over the row in which an image's prompts share their beginning (as
    ``infer.head_boxes`` runs it; the language model is the difference) and ``head_boxes`` itself
    (grouping, collation and copies included)."""
    from PIL import Image

    from groundtune.data.records import image_path
    from groundtune.models import qwen
    from groundtune.models.attention import attached

    encode = infer.PromptEncoder(gm)
    encoded, sizes = zip(*(encode(Image.open(image_path(r, data)).convert("RGB"), r["phrase"], r["id"])
                           for r in records[:batch]))
    core = adapt.base_model(gm.model)
    row = qwen.collate_shared(list(encoded))
    inputs = {k: v.to(gm.device) if isinstance(v, torch.Tensor) else v for k, v in row.inputs.items()}
    layout = row.layout.to(gm.device)

    def forward():
        with attached(layout):
            return core.model(**inputs, use_cache=False)

    steps = {
        "vision_tower": lambda: core.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]),
        "forward": forward,
        "head_boxes": lambda: infer.head_boxes(gm, list(encoded), list(sizes)),
    }
    out = {"batch": batch, "images": int(len(inputs["image_grid_thw"])),
           "prompt_tokens": int(sum(len(e["input_ids"]) for e in encoded)),
           "row_tokens": int(inputs["input_ids"].numel()), "patches": int(inputs["image_grid_thw"].prod(-1).sum())}
    with torch.inference_mode():
        for name, fn in steps.items():
            fn()  # warm-up
            start = _now()
            for _ in range(repeats):
                fn()
            out[f"{name}_ms"] = round((_now() - start) / repeats * 1000, 1)
    out["language_model_ms"] = round(out["forward_ms"] - out["vision_tower_ms"], 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="3b", help="comma-separated: 3b, 7b, tiny or a model folder")
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--cap-gib", type=float, default=24.0)
    parser.add_argument("--data", type=earlier_samples, help="train.jsonl made by an earlier run")
    parser.add_argument("--phrases-per-image", type=int, default=1,
                        help="without --data: samples that share an image (RefCOCO val: 7.2)")
    parser.add_argument("--no-read-ahead", action="store_true",
                        help="eval receives each batch from its encoding processes after the one before")
    parser.add_argument("--compile", action="store_true",
                        help="then the box head again with the vision tower compiled (eval --compile; a GPU's)")
    parser.add_argument("--out")
    args = parser.parse_args()
    infer.READ_AHEAD = not args.no_read_ahead
    cap_gpu_memory(args.cap_gib)
    data = args.data or make_refcoco_like(Path(f"/tmp/head_speed_data_{args.phrases_per_image}"), args.samples,
                                          phrases_per_image=args.phrases_per_image)
    records = read_samples(data)[: args.samples]
    results = []
    for key in args.models.split(","):
        gm = infer.load(MODELS.get(key, key), device="cuda" if torch.cuda.is_available() else "cpu")
        # the box head first: after text generation its engine's KV cache and graphs would still
        # hold memory under the cap, which a box-head model's own eval never has
        torch.manual_seed(0)
        head.attach(gm.model, adapt.hidden_size(adapt.base_model(gm.model)))
        box = timed_eval(gm, records, data, args.batch, args.new_tokens)
        profile = profile_box_batch(gm, records, data, args.batch)
        compiled = None
        if args.compile:  # what eval --compile adds; its warm-up batch compiles
            kernels.compile_vision_blocks(gm.model, backend="inductor" if torch.cuda.is_available() else "eager")
            compiled = timed_eval(gm, records, data, args.batch, args.new_tokens)
        delattr(gm.model, head.ATTRIBUTE)  # the same model, answering in text
        text = timed_eval(gm, records, data, args.batch, args.new_tokens)
        row = {"model": key, "batch": args.batch, "new_tokens": args.new_tokens,
               "phrases_per_image": args.phrases_per_image if args.data is None else None, "text": text, "box": box,
               "box_vs_text": round(box["samples_per_s"] / text["samples_per_s"], 2),
               "box_batch_profile": profile}
        if compiled is not None:
            row.update(box_compiled=compiled, box_compiled_vs_box=round(compiled["samples_per_s"] / box["samples_per_s"], 2))
        results.append(row)
        print(json.dumps(row), flush=True)
        del gm
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    print(f"\n{'model':6} {'text samples/s':>15} {'box samples/s':>14} {'ratio':>6} {'box peak GiB':>13} "
          f"{'vision ms':>10} {'LLM ms':>8} {'head_boxes ms':>14}")
    for r in results:
        prof = r["box_batch_profile"]
        print(f"{r['model']:6} {r['text']['samples_per_s']:15.1f} {r['box']['samples_per_s']:14.1f} "
              f"{r['box_vs_text']:6.2f} {r['box']['peak_gib'] or 0:13.2f} {prof['vision_tower_ms']:10.1f} "
              f"{prof['language_model_ms']:8.1f} {prof['head_boxes_ms']:14.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps(stamped(results), indent=2) + "\n")


if __name__ == "__main__":
    main()
