"""What every training loop (SFT in sft.py, RL in rl.py) does around its updates, written once: the
run folder (new or resumed), seeding, precision, the learning-rate schedule, and after each update
the eval on a fixed subset (keeping the best model), the caller's hook, checkpoints, the NaN guard,
the STOP file and the thermal pause."""

from __future__ import annotations

import contextlib
import math
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from groundtune.config import TrainConfig, load_config, to_yaml
from groundtune.data.records import read_samples
from groundtune.errors import MissingError, RunExistsError, TrainingError
from groundtune.infer import Decoding
from groundtune.models import adapt
from groundtune.models.loading import GroundingModel
from groundtune.train import checkpoint as ckpt
from groundtune.train.monitor import MetricsLog, StopRequest, thermal_pause

__all__ = ["Loop", "TrainingError", "prepare_run", "seed_everything", "use_bf16", "lr_lambda"]


def prepare_run(cfg, resume, cls: type = TrainConfig) -> tuple[Path, TrainConfig, Path | None]:
    """The run folder of a new run (refusing one that already holds a run) or of a resumed one
    (its saved ``cls`` settings and newest checkpoint)."""
    if resume is not None:
        run = Path(resume)
        saved = run / "config.yaml"
        if not saved.exists():
            raise MissingError(f"{run}: no config.yaml; is this a groundtune run folder?")
        cfg = load_config(cls, saved)
        checkpoints = ckpt.list_checkpoints(run)
        if not checkpoints:
            raise MissingError(f"{run}: no checkpoint to resume from in {run / ckpt.CHECKPOINTS}")
        (run / "STOP").unlink(missing_ok=True)
        return run, cfg, checkpoints[-1]
    run = Path(cfg.out_dir)
    if ckpt.list_checkpoints(run):
        raise RunExistsError(f"{run} already holds a run; resume it with `groundtune {cfg.command} --resume {run}` "
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


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def use_bf16(cfg, device: torch.device) -> bool:
    return cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")


def lr_lambda(cfg):
    """Linear warmup over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` at ``max_steps``."""

    def factor(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine

    return factor


@dataclass
class Loop:
    """A run between its updates. ``gm.model`` is the model being trained; ``state`` is what a
    checkpoint keeps besides weights, optimizer, scheduler and RNG (step, samples seen, best eval,
    non-finite steps in a row, and whatever the loop adds). ``cfg`` is a TrainConfig or RLConfig:
    the settings used here are the ones both have."""

    run: Path
    cfg: TrainConfig
    gm: GroundingModel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    state: dict
    eval_samples: list[dict]
    log: MetricsLog
    on_step: Callable | None = None  # on_step(step, run, model) after every update (tests drop a STOP file)

    @classmethod
    def start(cls, run: Path, cfg, gm: GroundingModel, resume_from: Path | None,
              on_step: Callable | None = None, **extra_state) -> "Loop":
        """The optimizer (AdamW over ``adapt.param_groups``), the schedule, the loop state (plus
        ``extra_state``) and the eval subset of a new run, or all of them restored from
        ``resume_from``, the run's newest checkpoint."""
        device = gm.device
        optimizer = torch.optim.AdamW(adapt.param_groups(gm.model, cfg), betas=(0.9, 0.95),
                                      fused=device.type == "cuda")
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
        state = {"step": 0, "samples": 0, "best_acc": -1.0, "bad_steps": 0, "finished": False, **extra_state}
        if resume_from is not None:  # over the defaults: a run saved before a state key existed resumes too
            state = {**state, **ckpt.load_checkpoint(resume_from, gm.model, optimizer, scheduler)}
            print(f"resumed from {resume_from} at step {state['step']}")
        eval_samples = read_samples(cfg.eval_data)[: cfg.eval_samples] if cfg.eval_data else []
        log = MetricsLog(run)
        if eval_samples:
            log.log(state["step"], {"eval/decoding": Decoding.greedy(cfg.eval_max_new_tokens).to_dict()})
        return cls(run, cfg, gm, optimizer, scheduler, state, eval_samples, log, on_step)

    def autocast(self):
        """bf16 autocast where the run trains in bf16 (trainable weights stay fp32), else nothing."""
        device = self.gm.device
        return (torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16(self.cfg, device)
                else contextlib.nullcontext())

    def evaluate(self, say=print) -> dict:
        """Greedy eval on the fixed subset of eval_data; a new best is saved as the run's model."""
        from groundtune import evaluate

        step = self.state["step"]
        report, _ = evaluate.evaluate(self.gm, self.eval_samples, self.cfg.eval_data,
                                      batch_size=self.cfg.eval_batch_size, progress=False,
                                      max_new_tokens=self.cfg.eval_max_new_tokens)
        metrics = {k: report[k] for k in ("acc@0.5", "acc@0.75", "miou", "parse_fail_rate")}
        self.log.log(step, {f"eval/{k}": v for k, v in metrics.items()})
        say(f"step {step}: eval Acc@0.5 {metrics['acc@0.5']:.3f} mIoU {metrics['miou']:.3f}")
        if metrics["acc@0.5"] > self.state["best_acc"]:
            self.state["best_acc"] = metrics["acc@0.5"]
            ckpt.save_model(self.run, self.gm, self.gm.model,
                            {"step": step, "eval": {**metrics, "n": report["n"], "decoding": report["decoding"]}})
        return metrics

    def skip_nonfinite(self, values: dict, hint: str) -> None:
        """The NaN/Inf guard: the caller dropped this update; give up after ``max_bad_steps`` in a row."""
        self.state["bad_steps"] += 1
        self.log.log(self.state["step"], {"skipped_nonfinite": 1, **values, "bad_steps": self.state["bad_steps"]})
        if self.state["bad_steps"] >= self.cfg.max_bad_steps:
            self._save_checkpoint()
            self.log.close()
            raise TrainingError(f"{self.state['bad_steps']} non-finite losses/gradients in a row at step "
                                f"{self.state['step']}: {hint}")

    def after_update(self, stop: StopRequest, say=print) -> bool:
        """Count the update, then eval, hook, checkpoint, STOP and thermal pause, in that order.
        Returns whether the run stops here (its checkpoint is then written)."""
        self.state["step"] += 1
        self.state["bad_steps"] = 0
        step, cfg = self.state["step"], self.cfg
        is_last = step == cfg.max_steps
        if self.eval_samples and ((cfg.eval_every and step % cfg.eval_every == 0) or is_last):
            self.evaluate(say)
        if self.on_step is not None:
            self.on_step(step, self.run, self.gm.model)
        reason = stop.reason
        if (cfg.save_every and step % cfg.save_every == 0) or is_last or reason:
            self.state["finished"] = is_last
            self._save_checkpoint()
        if reason:
            say(f"stopping at step {step} ({reason}); resume with: groundtune {cfg.command} --resume {self.run}")
            return True
        waited = thermal_pause(self.gm.device, cfg.thermal_pause_c, cfg.thermal_resume_c, log=say)
        if waited:
            self.log.log(step, {"thermal_pause_s": waited})
        return False

    def finish(self) -> Path:
        """The run's model is the best evaluated one, or the last when nothing was evaluated."""
        if not self.eval_samples or self.state["best_acc"] < 0:
            ckpt.save_model(self.run, self.gm, self.gm.model, {"step": self.state["step"]})
        self.log.close()
        return self.run

    def _save_checkpoint(self) -> None:
        ckpt.save_checkpoint(self.run, self.gm.model, self.optimizer, self.scheduler, self.state, self.cfg.keep_last)
