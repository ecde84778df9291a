"""Supervised fine-tuning for grounding: the loss is on the answer's box text only.

Single GPU or CPU:
    groundtune train configs/quickstart.yaml
    groundtune train configs/qwen2.5-vl-3b-lora-24gb.yaml train_data=train.jsonl eval_data=val.jsonl
Resume (same run folder, same settings; exact: weights, optimizer, scheduler, RNG, data position):
    groundtune train --resume runs/sft
Stop cleanly at any time: Ctrl-C, SIGTERM or `touch RUN/STOP`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from groundtune.boxes import ResizeSpec
from groundtune.config import TrainConfig, load_config, to_yaml
from groundtune.data.dataset import GroundingDataset, SyntheticStream, make_loader, open_samples
from groundtune.data.records import read_samples
from groundtune.models import adapt
from groundtune.models.loading import GroundingModel, load_model, pick_device
from groundtune.progress import progress_bar
from groundtune.train import checkpoint as ckpt
from groundtune.train.monitor import MetricsLog, StopRequest, gpu_stats, thermal_pause
from groundtune.train.objective import answer_loss


class TrainingError(RuntimeError):
    pass


def train(cfg: TrainConfig | None = None, resume: str | Path | None = None, on_step=None) -> Path:
    """Run SFT and return the run folder. ``on_step(step, run, model)`` is called after every
    optimizer step (tests use it to drop a STOP file or poison a weight at a known step)."""
    run, cfg, resume_from = _prepare_run(cfg, resume)
    _seed_everything(cfg.seed)
    gm, model = _setup_model(cfg)
    device = gm.device
    samples = open_samples(cfg.train_data, cfg.seed)
    eval_samples = read_samples(cfg.eval_data)[: cfg.eval_samples] if cfg.eval_data else []
    optimizer = torch.optim.AdamW(adapt.param_groups(model, cfg), betas=(0.9, 0.95),
                                  fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg))
    state = {"step": 0, "samples": 0, "best_acc": -1.0, "bad_steps": 0, "finished": False}
    if resume_from is not None:
        state = ckpt.load_checkpoint(resume_from, model, optimizer, scheduler)
        print(f"resumed from {resume_from} at step {state['step']}")
    dataset = GroundingDataset(samples, gm.processor, gm.family, gm.resize, gm.prompt,
                               cfg.hflip_prob, cfg.scale_crop_prob, cfg.seed, cfg.answer_label)
    batches = iter(make_loader(dataset, cfg.batch_size, cfg.seed, state["samples"], cfg.num_workers,
                               gm.processor.pad_token_id, pin_memory=device.type == "cuda", packing=cfg.packing))
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if _use_bf16(cfg, device)
                else contextlib.nullcontext())
    log = MetricsLog(run)
    print(f"training {gm.source} ({cfg.method}; {adapt.count_parameters(model)['trainable']:,} trainable "
          f"parameters) on {_describe(samples, cfg.train_data)} -> {run}")

    model.train()
    window = {"loss": 0.0, "n": 0, "samples": 0, "tokens": 0, "t0": time.time()}
    with StopRequest(run) as stop, progress_bar() as bar:
        task = bar.add_task("train", total=cfg.max_steps, completed=state["step"], info="")
        say = functools.partial(bar.console.print, soft_wrap=True)  # never wrap a command users copy
        while state["step"] < cfg.max_steps:
            # ---- one optimizer step: grad_accum micro-batches
            step_loss, finite = 0.0, True
            for _ in range(cfg.grad_accum):
                batch = {k: v.to(device, non_blocking=True) for k, v in next(batches).items()}
                with autocast:  # the LM head runs on the answer tokens only (train/objective.py)
                    loss = answer_loss(model, batch) / cfg.grad_accum
                finite = finite and bool(torch.isfinite(loss))
                if finite:
                    loss.backward()
                step_loss += loss.item()
                samples_in_batch = len(batch["image_grid_thw"])  # one image per sample, packed or not
                state["samples"] += samples_in_batch
                window["samples"] += samples_in_batch
                mask = batch.get("attention_mask")  # a packed batch has no padding and no mask
                window["tokens"] += int(mask.sum()) if mask is not None else batch["input_ids"].numel()
            grad_norm = (torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                         if finite and cfg.max_grad_norm else torch.tensor(0.0))
            if not finite or not torch.isfinite(grad_norm):
                # NaN/Inf guard: drop this step's gradients, keep going, give up after K in a row.
                optimizer.zero_grad(set_to_none=True)
                state["bad_steps"] += 1
                log.log(state["step"], {"skipped_nonfinite": 1, "loss": step_loss, "bad_steps": state["bad_steps"]})
                if state["bad_steps"] >= cfg.max_bad_steps:
                    ckpt.save_checkpoint(run, model, optimizer, scheduler, state, cfg.keep_last)
                    log.close()
                    raise TrainingError(f"{state['bad_steps']} non-finite losses/gradients in a row at step "
                                        f"{state['step']}: lower lr, check the data (groundtune data check)")
                continue
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            state["step"] += 1
            state["bad_steps"] = 0
            window["loss"] += step_loss
            window["n"] += 1
            step = state["step"]

            # ---- logging, eval, checkpoints, stop
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                elapsed = max(time.time() - window["t0"], 1e-9)
                values = {"loss": window["loss"] / window["n"], "lr": scheduler.get_last_lr()[0],
                          "grad_norm": float(grad_norm), "samples_per_s": window["samples"] / elapsed,
                          "tokens_per_s": window["tokens"] / elapsed, "samples": state["samples"],
                          **gpu_stats(device)}
                log.log(step, values)
                mem = f" {values['gpu_mem_peak_gib']:.1f}GiB" if "gpu_mem_peak_gib" in values else ""
                bar.update(task, info=f"loss {values['loss']:.4f} lr {values['lr']:.2e} "
                                      f"{values['samples_per_s']:.1f} samples/s{mem}")
                window = {"loss": 0.0, "n": 0, "samples": 0, "tokens": 0, "t0": time.time()}
            bar.update(task, completed=step)
            is_last = step == cfg.max_steps
            if eval_samples and ((cfg.eval_every and step % cfg.eval_every == 0) or is_last):
                metrics = _evaluate(gm, model, eval_samples, cfg)
                log.log(step, {f"eval/{k}": v for k, v in metrics.items()})
                say(f"step {step}: eval Acc@0.5 {metrics['acc@0.5']:.3f} mIoU {metrics['miou']:.3f}")
                if metrics["acc@0.5"] > state["best_acc"]:
                    state["best_acc"] = metrics["acc@0.5"]
                    ckpt.save_model(run, gm, model, {"step": step, "eval": metrics})
            if on_step is not None:
                on_step(step, run, model)
            reason = stop.reason
            if (cfg.save_every and step % cfg.save_every == 0) or is_last or reason:
                state["finished"] = is_last
                ckpt.save_checkpoint(run, model, optimizer, scheduler, state, cfg.keep_last)
            if reason:
                say(f"stopping at step {step} ({reason}); resume with: groundtune train --resume {run}")
                break
            waited = thermal_pause(device, cfg.thermal_pause_c, cfg.thermal_resume_c, log=say)
            if waited:
                log.log(step, {"thermal_pause_s": waited})
    if not eval_samples or state["best_acc"] < 0:
        ckpt.save_model(run, gm, model, {"step": state["step"]})
    log.close()
    return run


# --------------------------------------------------------------------------------------------
# setup


def _prepare_run(cfg: TrainConfig | None, resume) -> tuple[Path, TrainConfig, Path | None]:
    if resume is not None:
        run = Path(resume)
        saved = run / "config.yaml"
        if not saved.exists():
            raise FileNotFoundError(f"{run}: no config.yaml; is this a groundtune run folder?")
        cfg = load_config(TrainConfig, saved)
        checkpoints = ckpt.list_checkpoints(run)
        if not checkpoints:
            raise FileNotFoundError(f"{run}: no checkpoint to resume from in {run / ckpt.CHECKPOINTS}")
        (run / "STOP").unlink(missing_ok=True)
        return run, cfg, checkpoints[-1]
    run = Path(cfg.out_dir)
    if ckpt.list_checkpoints(run):
        raise FileExistsError(f"{run} already holds a run; resume it with `groundtune train --resume {run}` "
                              f"or choose another out_dir")
    run.mkdir(parents=True, exist_ok=True)
    (run / "STOP").unlink(missing_ok=True)
    for stale in ("metrics.jsonl", "tb", "model"):
        path = run / stale
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    (run / "config.yaml").write_text(to_yaml(cfg))
    return run, cfg, None


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _describe(samples, train_data: str) -> str:
    return f"fresh samples of {train_data}" if isinstance(samples, SyntheticStream) else f"{len(samples):,} samples"


def _use_bf16(cfg: TrainConfig, device: torch.device) -> bool:
    return cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")


def _setup_model(cfg: TrainConfig) -> tuple[GroundingModel, torch.nn.Module]:
    device = pick_device(cfg.device)
    if cfg.method == "qlora" and device.type != "cuda":
        raise TrainingError("method=qlora needs a CUDA GPU (bitsandbytes 4-bit); use method=lora on CPU")
    dtype = "bf16" if _use_bf16(cfg, device) else "fp32"
    gm = load_model(cfg.model, device=cfg.device, dtype=dtype, quantize_4bit=cfg.method == "qlora")
    resize = ResizeSpec(factor=gm.resize.factor,
                        min_pixels=cfg.min_pixels or gm.resize.min_pixels,
                        max_pixels=cfg.max_pixels or gm.resize.max_pixels)
    gm = dataclasses.replace(gm, resize=resize, prompt=cfg.prompt or gm.prompt)
    model = adapt.prepare_for_training(gm.model, cfg)
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()  # trainable weights and their optimizer state stay fp32
    gm = dataclasses.replace(gm, model=model)
    return gm, model


def _lr_lambda(cfg: TrainConfig):
    def factor(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine

    return factor


def _evaluate(gm: GroundingModel, model, eval_samples: list[dict], cfg: TrainConfig) -> dict:
    from groundtune import evaluate

    report, _ = evaluate.evaluate(dataclasses.replace(gm, model=model), eval_samples, cfg.eval_data,
                                  batch_size=cfg.eval_batch_size, progress=False)
    return {k: report[k] for k in ("acc@0.5", "acc@0.75", "miou", "parse_fail_rate")}
