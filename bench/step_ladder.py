"""A training step timed one change at a time, in one run, from transformers' own code paths to
groundtune's step: the table BENCHMARKS.md keeps of what each change gave.

    from step_ladder import ladder
    rows = ladder(model, batch, steps=20)   # model: prepared for training; batch: from groundtune's loader

Rungs: (1) transformers' paths: the vision attention one call per window, M-RoPE positions
computed by the model's loop over the batch, the LM head over every position; (2) + positions
from the loader; (3) + the LM head on answer tokens only; (4) + vision attention grouped by window
length: groundtune's step; then (5) + liger-kernel's fused RMSNorm/SwiGLU/M-RoPE (`kernels=liger`;
skipped where liger-kernel or a GPU is missing). torch.compile (`compile=true`) is not a rung: it
does not combine with liger's kernels (config.py), so sft_speed.py times it as a variant of its own.
The optimizer is AdamW at a tiny learning rate: the weights barely move between rungs.
"""

from __future__ import annotations

import time

import torch

from groundtune.models import kernels, vision_attention
from groundtune.train.objective import answer_loss


def _full_head_loss(model, batch):
    return model(**batch, use_cache=False).loss


def _vision_attention(model, grouped: bool) -> None:
    for m in model.modules():
        if type(m).__name__ in vision_attention.ATTENTION_CLASSES:
            m.__dict__.pop("forward", None)  # transformers' own forward
    if grouped:
        vision_attention.install(model)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def ladder(model, batch: dict, steps: int = 20, warmup: int = 3) -> list[dict]:
    cuda = torch.cuda.is_available()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-7, fused=cuda)
    own_positions = {k: v for k, v in batch.items() if k != "position_ids"}
    rungs = [
        ("transformers: per-window vision attention, positions per step, full LM head", False, own_positions,
         _full_head_loss),
        ("+ positions computed in the loader", False, batch, _full_head_loss),
        ("+ LM head on answer tokens only", False, batch, answer_loss),
        ("+ vision attention grouped by window length (groundtune)", True, batch, answer_loss),
        ("+ liger-kernel RMSNorm, SwiGLU, M-RoPE (kernels=liger)", True, batch, answer_loss),
    ]
    n = len(batch["image_grid_thw"])
    rows = []
    for name, grouped, inputs, loss_fn in rungs:
        _vision_attention(model, grouped)
        if "kernels=liger" in name and not kernels.liger_usable(model):
            print(f"   skipped (no liger-kernel or no GPU)  {name}", flush=True)
            continue

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                loss = loss_fn(model, inputs)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        try:  # an optional kernel that fails must not cost the rungs measured so far
            if "kernels=liger" in name:
                kernels.apply_fused_kernels(model, "liger")  # stays applied for the rungs after it
            for _ in range(warmup):
                step()
        except Exception as e:
            rows.append({"change": name, "error": repr(e)[:300]})
            print(f"   failed: {e!r:.200}  {name}", flush=True)
            continue
        _sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        _sync()
        dt = (time.perf_counter() - t0) / steps
        peak = round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None
        rows.append({"change": name, "step_s": round(dt, 4), "samples_per_s": round(n / dt, 2), "peak_gib": peak})
        print(f"{dt * 1000:8.1f} ms  {n / dt:7.1f} samples/s  peak {peak} GiB  {name}", flush=True)
    return rows
