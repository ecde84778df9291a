"""Supervised fine-tuning for grounding: the loss is on the answer's box text only.

Single GPU or CPU:
    groundtune train configs/quickstart.yaml
    groundtune train configs/qwen2.5-vl-3b-lora-24gb.yaml train_data=train.jsonl eval_data=val.jsonl
Several GPUs (each rank its share of every batch; engine: distributed=ddp|fsdp2|zero2|zero3):
    torchrun --nproc-per-node 8 -m groundtune train configs/qwen2.5-vl-3b-lora-24gb.yaml train_data=train.jsonl
    accelerate launch --config_file configs/accelerate/multi-gpu.yaml -m groundtune train ...
Resume (same run folder, same settings; exact: weights, optimizer, scheduler, RNG, data position):
    groundtune train --resume runs/sft
    groundtune train --resume runs/sft train_data=fixed.jsonl     # a corrected file of the same records
Stop cleanly at any time: Ctrl-C, SIGTERM (to the process or its whole group) or `touch RUN/STOP`.
Every record is checked before the model loads (bad_records=refuse | skip); one process writes a
run folder at a time (RUN/.lock).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path

import torch

from groundtune.config import TrainConfig
from groundtune.data.samples import SyntheticStream
from groundtune.models import adapt, speedups
from groundtune.models.loading import GroundingModel, box_head_start, load_model, pick_device, with_resize
from groundtune.progress import progress_bar
from groundtune.train import distributed
from groundtune.train.batches import GroundingDataset, make_loader, to_device
from groundtune.train.loop import Loop, RunData, TrainingError, run_stage, seed_everything, use_bf16
from groundtune.train.monitor import StopRequest, gpu_stats
from groundtune.train.objective import BoxObjective, answer_loss, answer_tokens, box_head_loss, weigh_samples
from groundtune.train.parallel import Parallel

__all__ = ["TrainingError", "train"]


def train(cfg: TrainConfig | None = None, resume: str | Path | None = None, on_step=None,
          resume_overrides: tuple[str, ...] = ()) -> Path:
    """Run SFT and return the run folder. ``on_step(step, run, model)`` is called after every
    optimizer step (tests use it to drop a STOP file or poison a weight at a known step)."""
    expandable_gpu_memory()
    if cfg is not None:
        cfg = _planned(cfg)
    return run_stage(TrainConfig, cfg, resume, resume_overrides, _train, on_step)


def _train(run: Path, cfg: TrainConfig, resume_from: Path | None, data: RunData, on_step,
           ranks: distributed.Ranks = distributed.Ranks()) -> Path:
    seed_everything(cfg.seed)  # the same on every rank: the same initial weights
    gm, model = _setup_model(cfg, distributed.device_for(ranks, cfg.device))
    device = gm.device
    samples = data.samples
    trainable = adapt.count_parameters(model)["trainable"]  # (counted before an engine shards them)
    box_head = cfg.head == "box"
    objective = BoxObjective(model, text=cfg.head_text_loss_weight > 0) if box_head else None
    parallel = Parallel(model, ranks, cfg.distributed, torch.bfloat16 if use_bf16(cfg, device) else None, objective)
    loop = Loop.start(run, cfg, gm, resume_from, data, on_step, parallel)
    optimizer, scheduler, state = loop.optimizer, loop.scheduler, loop.state
    dataset = GroundingDataset(samples, gm.processor, gm.family, gm.resize, gm.prompt,
                               cfg.hflip_prob, cfg.scale_crop_prob, cfg.seed, cfg.answer_label, box_target=box_head,
                               answer_text=not box_head or cfg.head_text_loss_weight > 0)
    batches = iter(make_loader(dataset, cfg.batch_size, cfg.seed, state["samples"], cfg.num_workers,
                               gm.processor.pad_token_id, pin_memory=device.type == "cuda", packing=cfg.packing,
                               rank=ranks.rank, world=ranks.world))
    autocast = loop.autocast()
    if ranks.main:
        on = f" on {ranks.world} ranks (batch {cfg.batch_size} each)" if ranks.many else ""
        print(f"training {gm.source} ({cfg.method}; {trainable:,} trainable "
              f"parameters) on {_describe(samples, cfg.train_data)}{on} -> {run}")

    model.train()
    window = _new_window()
    with StopRequest(run) as stop, progress_bar() as bar:
        task = bar.add_task("train", total=cfg.max_steps, completed=state["step"], info="")
        say = functools.partial(bar.console.print, soft_wrap=True)  # never wrap a command users copy
        while state["step"] < cfg.max_steps:
            # ---- one optimizer step: grad_accum micro-batches, their answer tokens counted first
            # (on the CPU) so that each token weighs the same whatever micro-batch it is in
            micro_batches = [next(batches) for _ in range(cfg.grad_accum)]
            if cfg.loss_per != "token" and not box_head:  # the answers' tokens weighed (objective.weigh_samples)
                micro_batches = [weigh_samples(b, cfg.loss_per) for b in micro_batches]
            tokens, boxed = _update_size(micro_batches, box_head, ranks, device)
            step_loss, finite = 0.0, True
            for i, batch in enumerate(micro_batches):
                batch = to_device(batch, device)
                drawn, failed = batch.pop("drawn"), batch.pop("failed")  # positions used; samples that failed to load
                if failed:
                    loop.skip_unreadable(failed, drawn)
                # forward and the backward's recomputation; the ranks' gradients meet on the last micro-batch
                with adapt.lora_inputs_uncast(model), parallel.accumulating(last=i == len(micro_batches) - 1):
                    with autocast:  # the LM head runs on the answer tokens only (train/objective.py)
                        loss = (box_head_loss(parallel.objective, batch, boxed, tokens, cfg.head_l1_weight,
                                              cfg.head_text_loss_weight) if box_head
                                else answer_loss(parallel.objective, batch, tokens))
                    # one rank's non-finite loss skips the step everywhere, decided before any backward
                    # (a backward some ranks skip would leave the others waiting in theirs)
                    finite = finite and not distributed.any_rank(not bool(torch.isfinite(loss)), ranks, device)
                    if finite:
                        parallel.backward(loss)
                step_loss += loss.item()
                # positions of the order, the failed ones too, every rank's: resume goes on after them
                state["samples"] += drawn * ranks.world
                window["samples"] += len(batch["image_grid_thw"])  # one image per trained sample, packed or not
                mask = batch.get("attention_mask")  # a packed batch has no padding and no mask
                window["tokens"] += int(mask.sum()) if mask is not None else batch["input_ids"].numel()
            step_loss = distributed.total(step_loss, ranks, device)  # the global batch's loss
            lr = scheduler.get_last_lr()[0]  # what this update used (the scheduler then moves on)
            if not finite:
                parallel.drop_gradients(optimizer)
            grad_norm = parallel.step(optimizer, cfg.max_grad_norm) if finite else None  # None: not finite
            if grad_norm is None:  # this step's gradients dropped; keep going
                loop.skip_nonfinite({"loss": step_loss}, "lower lr, check the data (groundtune data check)")
                continue
            scheduler.step()
            window["loss"] += step_loss
            window["n"] += 1
            step = state["step"] + 1

            # ---- logging, then eval, checkpoints, stop
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                _log_window(loop, step, window, lr, grad_norm, ranks, bar, task)
                window = _new_window()
            bar.update(task, completed=step)
            if loop.after_update(stop, say):
                break
    return loop.finish()


def _update_size(micro_batches: list[dict], box_head: bool, ranks: distributed.Ranks, device) -> tuple[int, int]:
    """The whole update's answer tokens and, for a box head (whose loss is per sample), its samples
    with boxes, summed on every rank over every rank's micro-batches: what each loss is divided by,
    so that a token (a sample) weighs the same whatever micro-batch or rank it is in."""
    tokens = max(1, int(distributed.total(sum(answer_tokens(b) for b in micro_batches), ranks, device)))
    if not box_head:
        return tokens, 0
    return tokens, max(1, int(distributed.total(sum(len(b.get("box_target", ())) for b in micro_batches), ranks,
                                                device)))


def _new_window() -> dict:
    """What the next metrics line averages: its updates' losses, the samples and tokens trained, since when."""
    return {"loss": 0.0, "n": 0, "samples": 0, "tokens": 0, "t0": time.time()}


def _log_window(loop: Loop, step: int, window: dict, lr: float, grad_norm, ranks: distributed.Ranks, bar,
                task) -> None:
    """One metrics.jsonl line for the updates since the last (mean loss; samples and tokens per second
    of all ranks; GPU memory), and its summary on the progress bar."""
    elapsed = max(time.time() - window["t0"], 1e-9)
    values = {"loss": window["loss"] / window["n"], "lr": lr,
              "grad_norm": float(grad_norm), "samples_per_s": window["samples"] * ranks.world / elapsed,
              "tokens_per_s": window["tokens"] * ranks.world / elapsed, "samples": loop.state["samples"],
              **gpu_stats(loop.gm.device)}
    loop.log.log(step, values)
    mem = f" {values['gpu_mem_peak_gib']:.1f}GiB" if "gpu_mem_peak_gib" in values else ""
    bar.update(task, info=f"loss {values['loss']:.4f} lr {values['lr']:.2e} "
                          f"{values['samples_per_s']:.1f} samples/s{mem}")


# --------------------------------------------------------------------------------------------
# setup


def _planned(cfg: TrainConfig) -> TrainConfig:
    """Before anything loads: batch_size=auto made the largest batch the plan says fits the GPU
    found (8 on a CPU, which has no plan), and a warning with the plan's summary when the run will
    not fit that GPU (groundtune/plan.py)."""
    import os
    import warnings

    from groundtune import plan
    from groundtune.errors import GroundtuneError

    if not (torch.cuda.is_available() and pick_device(cfg.device).type == "cuda"):
        if cfg.batch_size == "auto":
            print("batch_size=auto: no GPU, so no plan; batch_size=8")
            return dataclasses.replace(cfg, batch_size=8)
        return cfg
    found = plan.card_from_device(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory)
    gpus = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.batch_size == "auto":
        size = plan.auto_batch_size(cfg, found, gpus)  # a model the planner cannot size: its error, exit 2
        print(f"batch_size=auto: {size} (the largest groundtune plan says fits {found.name}, "
              f"{found.memory_gib:.1f} GiB)")
        return dataclasses.replace(cfg, batch_size=size)
    try:
        result = plan.plan_run(cfg, found, gpus=gpus)
    except GroundtuneError:  # a model or data the planner cannot size: training decides
        return cfg
    if not result.plan.fits:
        changes = "; ".join(x.change for x in result.suggestions[:3])
        warnings.warn(f"this run will likely run out of GPU memory: {result.plan.summary()}"
                      + (f". Changes that fit: {changes} (groundtune plan CONFIG --explain)" if changes else ""),
                      stacklevel=3)
    return cfg


def expandable_gpu_memory() -> None:
    """Let torch's CUDA allocator grow its blocks in place (expandable segments) unless the user set
    PYTORCH_CUDA_ALLOC_CONF: without it, a run near the card's limit fails with 1-3 GiB held but
    unusable between blocks of other sizes (bench/plan_check.py verify, H200 capped at 12-24 GiB).
    Takes effect when CUDA is first used in this process, as it is here."""
    import os

    if not torch.cuda.is_initialized():
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def _describe(samples, train_data: str) -> str:
    return f"fresh samples of {train_data}" if isinstance(samples, SyntheticStream) else f"{len(samples):,} samples"


def _setup_model(cfg: TrainConfig, device_setting: str | None = None) -> tuple[GroundingModel, torch.nn.Module]:
    """The model to train on ``device_setting`` (by default cfg.device; under torchrun, the rank's GPU)."""
    device_setting = device_setting or cfg.device
    device = pick_device(device_setting)
    if cfg.method == "qlora" and device.type != "cuda":
        raise TrainingError("method=qlora needs a CUDA GPU (bitsandbytes 4-bit); use method=lora on CPU")
    if cfg.fp8 and device.type != "cuda":  # before the weights load (kernels.fp8_matmuls checks the GPU's kind)
        raise TrainingError("fp8=true needs a GPU with FP8 matmuls (compute capability 8.9 or later); use fp8=false on CPU")
    dtype = "bf16" if use_bf16(cfg, device) else "fp32"
    gm = load_model(cfg.model, device=device_setting, dtype=dtype, quantize_4bit=cfg.method == "qlora")
    # a base checkpoint's budget is pinned to fit the GPU as a matter of course; a trained one's is not
    gm = with_resize(gm, cfg.min_pixels, cfg.max_pixels, "train", pins_base_budget=True)
    gm = dataclasses.replace(gm, prompt=cfg.prompt or gm.prompt)
    model = adapt.prepare_for_training(gm.model, cfg)
    if cfg.head == "box":
        print(adapt.attach_box_head(model, cfg.head_text_loss_weight > 0, cfg.head_slots, cfg.head_threshold,
                                    box_head_start(cfg.model)))
    adapt.keep_trainable_fp32(model)
    speedups.install(model, cfg.kernels, cfg.compile, say=print, fp8=cfg.fp8)
    gm = dataclasses.replace(gm, model=model)
    return gm, model


