"""Where a LoRA training step's GPU memory goes, stage by stage: after loading the model, after
preparing it for training, after one forward and after one backward of a RefCOCO-like batch (the
batches of sft_speed.py), with the weights' and buffers' bytes by dtype. For a model that runs out
of memory before its batch size matters (the 7B under a 24 GiB cap, BENCHMARKS.md): the last stage
reached and the dtype table say which part holds the memory.

    python bench/memory_probe.py --model 7b --batch 2 --out probe.json
    python bench/memory_probe.py --model tiny --batch 2              # CPU smoke test (no GPU figures)
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path

import torch
from sft_speed import MODELS, _batches, make_refcoco_like
from provenance import stamped
from gpu_cap import cap_gpu_memory

from groundtune.config import TrainConfig
from groundtune.models import adapt, speedups
from groundtune.models.loading import load_model
from groundtune.train.batches import to_device
from groundtune.train.objective import answer_loss


def _gib(n: float) -> float:
    return round(n / 2**30, 3)


def _memory() -> dict:
    if not torch.cuda.is_available():
        return {"allocated_gib": None, "peak_gib": None}
    return {"allocated_gib": _gib(torch.cuda.memory_allocated()), "peak_gib": _gib(torch.cuda.max_memory_allocated())}


def _bytes_by_dtype(model) -> dict:
    sizes = Counter()
    for kind, tensors in (("param", model.parameters()), ("buffer", model.buffers())):
        for t in tensors:
            sizes[f"{kind} {str(t.dtype).removeprefix('torch.')} {t.device.type}"] += t.numel() * t.element_size()
    return {k: _gib(v) for k, v in sorted(sizes.items())}


def probe(model_name: str, batch_size: int, cap_gib: float) -> dict:
    cap_gpu_memory(cap_gib)
    result = {"model": model_name, "batch_size": batch_size, "cap_gib": cap_gib, "stages": []}

    def stage(name: str, model=None) -> None:
        row = {"stage": name, **_memory()}
        if model is not None:
            row["bytes_by_dtype_gib"] = _bytes_by_dtype(model)
        result["stages"].append(row)
        print(json.dumps(row), flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        data = make_refcoco_like(Path(tmp), batch_size)
        try:
            gm = load_model(model_name)
            stage("loaded", gm.model)
            cfg = TrainConfig(train_data=str(data), method="lora", gradient_checkpointing=-1)
            model = adapt.prepare_for_training(gm.model, cfg)
            adapt.keep_trainable_fp32(model)
            speedups.install(model)  # as `groundtune train` does
            model.train()
            stage("prepared (LoRA r16, every LLM layer recomputed)", model)
            device = next(model.parameters()).device
            batch = to_device(_batches(gm, data, batch_size, 1)[0], device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = answer_loss(model, batch)
            stage("forward")
            loss.backward()
            stage("backward")
        except torch.OutOfMemoryError as e:
            result["out_of_memory"] = {"after": result["stages"][-1]["stage"] if result["stages"] else "nothing",
                                       **_memory(), "message": str(e)[:300]}
            print(json.dumps(result["out_of_memory"]), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="7b", help="3b, 7b, tiny or a model folder")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--cap-gib", type=float, default=24.0, help="GPU memory cap (a 24 GB card)")
    parser.add_argument("--out")
    args = parser.parse_args()
    result = probe(MODELS.get(args.model, args.model), args.batch, args.cap_gib)
    if args.out:
        Path(args.out).write_text(json.dumps(stamped(result), indent=1) + "\n")


if __name__ == "__main__":
    main()
