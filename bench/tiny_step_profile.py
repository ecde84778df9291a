"""Where a pre-training step of the tiny model spends its time: the data loader alone (synthetic
stream, several worker counts), the model step alone on a fixed batch, and a profile of that step.

    python bench/tiny_step_profile.py --model MODEL --batch 128 --out profile.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch

from groundtune.config import TrainConfig
from groundtune.data.samples import open_samples
from groundtune.models import adapt, qwen
from groundtune.models.loading import load_model
from groundtune.train.batches import GroundingDataset, make_loader, to_device
from groundtune.train.objective import answer_loss
from provenance import stamped
from step_ladder import ladder


def loader_rate(gm, batch: int, workers: int, seconds: float, train_data: str = "synth:full") -> float:
    """Samples/s the training data loader alone delivers (decode or draw, resize, encode, collate)."""
    ds = GroundingDataset(open_samples(train_data, 0), gm.processor, gm.family, gm.resize, gm.prompt)
    it = iter(make_loader(ds, batch, 0, 0, workers, gm.processor.pad_token_id, pin_memory=torch.cuda.is_available()))
    next(it)  # workers started
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        n += len(next(it)["input_ids"])
    return n / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--workers", default="1,4,12")
    parser.add_argument("--ladder-only", action="store_true", help="skip the forward timings and the profile")
    parser.add_argument("--loader-seconds", type=float, default=8.0,
                        help="how long the data loader alone is timed, with each worker count")
    parser.add_argument("--out")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()  # CPU: a smoke test of this script
    gm = load_model(args.model, device="cuda" if cuda else "cpu", dtype="bf16" if cuda else "fp32")
    out = {"batch": args.batch, "loader_samples_per_s": {}}
    for w in [int(v) for v in args.workers.split(",") if v]:
        out["loader_samples_per_s"][w] = round(loader_rate(gm, args.batch, w, args.loader_seconds), 1)
        print(f"loader, {w} workers: {out['loader_samples_per_s'][w]:.0f} samples/s", flush=True)

    cfg = TrainConfig(train_data="synth:full", method="full", freeze_vision=False, freeze_merger=False)
    model = adapt.prepare_for_training(gm.model, cfg).float()
    ds = GroundingDataset(open_samples("synth:full", 0), gm.processor, gm.family, gm.resize, gm.prompt)
    samples = [ds[(i, i)] for i in range(args.batch)]
    batch = to_device(qwen.collate(samples, gm.processor.pad_token_id), model.device)

    # one change at a time, in the same run (step_ladder.py)
    out["ladder"] = ladder(model, samples, gm.processor.pad_token_id, steps=20)
    dt = out["ladder"][-1]["step_s"]
    out["step_s"] = round(dt, 4)
    out["model_samples_per_s"] = round(args.batch / dt, 1)
    if args.ladder_only:
        _write(out, args.out)
        return

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def bf16():  # the GPU's precision; fp32 on the CPU smoke run
        return torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()

    with torch.no_grad(), bf16():
        for name, fn in [("vision forward", lambda: model.model.visual(batch["pixel_values"], grid_thw=batch["image_grid_thw"])),
                         ("full forward", lambda: model(**batch, use_cache=False))]:
            fn()
            sync()
            t0 = time.perf_counter()
            for _ in range(10):
                fn()
            sync()
            out[f"{name} ms"] = round((time.perf_counter() - t0) * 100, 2)
            print(f"{name}: {out[f'{name} ms']:.1f} ms", flush=True)

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        with bf16():
            answer_loss(model, batch).backward()  # groundtune's step (the ladder's last rung)
        sync()
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    cuda_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    out["cuda_kernels_per_step"] = kernels
    out["gpu_busy_ms"] = round(cuda_us / 1000, 2)
    print(f"kernels per step: {kernels}; GPU busy {cuda_us / 1000:.1f} ms of a {dt * 1000:.1f} ms step")
    table = events.table(sort_by="self_cpu_time_total", row_limit=18)
    print(table)
    out["top_ops"] = table
    _write(out, args.out)


def _write(out: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(stamped(out), f, indent=1)


if __name__ == "__main__":
    main()
