"""A training step timed one change at a time, in one run, on one fixed set of samples: the table
BENCHMARKS.md keeps of what each change gave.

    from step_ladder import ladder
    rows = ladder(model, samples, pad_token_id, steps=5)   # model: prepared for training, with the
                                                           # attention of models/attention.py only;
                                                           # samples: encoded (groundtune's dataset)

Rungs, each adding to the one before: (1) the step as groundtune ran it before the variable-length
kernels: padded batch, vision windows batched by length through SDPA, peft's LoRA layers casting
their inputs to fp32, the vision MLP at its own width; (2) + the vision attention as one
variable-length flash call per layer; (3) + the vision MLP zero-padded to an aligned width;
(4) + LoRA inputs left in bf16; (5) + fused LoRA layers (scale and sum inside the matmuls);
(6) + the samples packed into one row, the text attention variable-length too (no padding);
(7) + liger-kernel's fused RMSNorm/SwiGLU/rotations (`kernels=liger`); (8) + its fused linear
cross-entropy on the answer tokens (also `kernels=liger`); (9) + the LoRA layers' frozen base
products in float8 (`fp8=true`). Rungs 2, 3, 7 and 8 need a GPU (and liger-kernel for 7 and 8),
9 a GPU with FP8 matmuls: elsewhere they are skipped. The earlier history (transformers' own
paths -> positions from the loader -> LM head on answer tokens only) is in BENCHMARKS.md.
The optimizer is AdamW at a tiny learning rate: the weights barely move between rungs.
"""

from __future__ import annotations

import contextlib
import time

import torch

from groundtune.models import adapt, attention, kernels, qwen
from groundtune.train.batches import to_device
from groundtune.train.objective import answer_loss


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _vision_mlp(model, padded: bool) -> None:
    for m in model.modules():
        if type(m).__name__ == adapt.family_of(model).padded_vision_mlp:
            m.__dict__.pop("forward", None)
    if padded:
        kernels.pad_vision_mlp(model, adapt.family_of(model).padded_vision_mlp)


def ladder(model, samples: list[dict], pad_token_id: int, steps: int = 5, warmup: int = 3) -> list[dict]:
    cuda = torch.cuda.is_available()
    attention.install(model, adapt.family_of(model))  # every rung runs on it: varlen on or off
    device = next(model.parameters()).device
    padded = to_device(qwen.collate(samples, pad_token_id), device)
    packed = to_device(qwen.collate_packed(samples), device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-7, fused=cuda)
    state = {"batch": padded, "uncast": False}
    gpu = attention.varlen_usable(torch.empty(1, device=device, dtype=torch.bfloat16))

    def use_varlen(on: bool):
        attention.VARLEN_ENABLED = on

    def fuse_loss(on: bool):
        kernels.FUSED_LOSS = on

    fuse_loss(False)  # its own rung, after the rest of kernels=liger

    rungs = [
        ("before: padded, vision windows grouped by length, peft LoRA casting to fp32, vision MLP as is",
         lambda: (use_varlen(False), _vision_mlp(model, False)), True),
        ("+ vision attention: one variable-length flash call per layer", lambda: use_varlen(True), gpu),
        ("+ vision MLP zero-padded to an aligned width", lambda: _vision_mlp(model, True), gpu),
        ("+ LoRA inputs left in bf16 (no fp32 copies)", lambda: state.update(uncast=True), True),
        ("+ fused LoRA layers (scale and sum inside the matmuls)", lambda: kernels.fuse_lora_layers(model), True),
        ("+ packed row, variable-length text attention (no padding)", lambda: state.update(batch=packed), True),
        ("+ liger-kernel RMSNorm, SwiGLU, rotations (kernels=liger)",
         lambda: kernels.apply_fused_kernels(model, "liger"), kernels.liger_usable(model)),
        ("+ liger-kernel fused linear cross-entropy on the answer tokens (kernels=liger)",
         lambda: fuse_loss(True), kernels.liger_usable(model)),
        ("+ LoRA layers' frozen base products in float8 (fp8=true)",
         lambda: kernels.fp8_matmuls(model), kernels.fp8_usable(model)),
    ]

    def step():
        uncast = adapt.lora_inputs_uncast(model) if state["uncast"] else contextlib.nullcontext()
        with uncast:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                loss = answer_loss(model, state["batch"])
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    n = len(samples)
    rows = []
    try:
        for name, change, runs_here in rungs:
            if not runs_here:
                print(f"   skipped (needs a GPU, liger-kernel or FP8 matmuls)  {name}", flush=True)
                continue
            try:  # an optional kernel that fails must not cost the rungs measured so far
                change()
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
    finally:
        use_varlen(True)
        fuse_loss(True)
    return rows
