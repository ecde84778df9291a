"""What every training loop (SFT in sft.py, RL in rl.py) does around its updates, written once: the
run folder (new or resumed; checked, then claimed), the records (checked before anything loads),
seeding, precision, the learning-rate schedule, and after each update the eval on a fixed subset
(keeping the best model), the caller's hook, checkpoints, the NaN guard, the STOP file and the
thermal pause.

A run starts in three steps, each refusing what it cannot take before the next costs anything
(``run_stage``, which SFT and RL both start through):

    run, cfg, resume_from = prepare_run(cfg, resume, cls, overrides)   # where, and with what settings
    data = check_data(cfg)                                              # every record, as `data check`
    with RunLock(run):  open_run(...)                                    # one writer; the folder written
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from groundtune.config import TrainConfig, load_config, to_yaml
from groundtune.data.check import check_records
from groundtune.data.records import atomic_write
from groundtune.data.samples import SYNTH_PREFIX, FileSamples, SyntheticStream, open_samples
from groundtune.errors import ConfigError, DataError, MissingError, RankLostError, RunExistsError, TrainingError
from groundtune.files import not_an_input
from groundtune.infer import Decoding
from groundtune.models import adapt, head
from groundtune.models.loading import GroundingModel, pick_device, resolve
from groundtune.runs import RunFolder
from groundtune.train import checkpoint as ckpt
from groundtune.train import distributed
from groundtune.train.monitor import MetricsLog, StopRequest, check_trackers, thermal_pause
from groundtune.train.parallel import Parallel, check_launch

__all__ = ["Loop", "RunData", "TrainingError", "run_stage", "prepare_run", "check_data", "open_run",
           "seed_everything", "use_bf16", "lr_lambda"]
# what each eval during a run logs (eval/KEY) and keeps with the best model; and the line it says
EVAL_LOGGED = ("acc@0.5", "acc@0.75", "miou", "parse_fail_rate", "f1@0.5", "set_acc@0.5", "n_acc")
EVAL_SHOWN = {"acc@0.5": "Acc@0.5", "miou": "mIoU", "f1@0.5": "F1@0.5", "set_acc@0.5": "set_acc@0.5",
              "n_acc": "N-acc"}
# the settings a resumed run takes anew: a corrected file of the same records
RESUME_OVERRIDES = ("train_data", "eval_data")


def run_stage(cls: type, cfg, resume, resume_overrides: tuple[str, ...], body: Callable, on_step) -> Path:
    """Start a run of ``cls``'s command (new or resumed) and train it with ``body(run, cfg,
    resume_from, data, on_step, ranks)`` while holding its folder; returns the run folder. Under
    torchrun, rank 0 prepares, checks and claims the run and hands what it found to the others
    (train/distributed.py)."""
    ranks = distributed.from_environment()
    distributed.start(ranks)
    if ranks.main:
        try:
            run, cfg, resume_from = prepare_run(cfg, resume, cls, resume_overrides)
            check_trackers(cfg.report_to)  # a tracker's package missing: said before anything loads
            if ranks.launched:
                check_launch(cfg.distributed, cfg.deepspeed_config)
            data = None if finished_already(run, resume_from) else check_data(cfg)  # every record, before the model loads
        except BaseException as e:
            distributed.share(("error", str(e)), ranks)
            distributed.finish(ranks, wait=False)
            raise
        distributed.share(("ok", run, cfg, resume_from, data), ranks)
    else:
        said, *found = distributed.share(None, ranks)
        if said == "error":
            distributed.finish(ranks, wait=False)
            raise TrainingError(f"rank 0 stopped before training: {found[0]}")
        run, cfg, resume_from, data = found
    if data is not None:  # None: finished already (rank 0 said so)
        claim = ckpt.RunLock(run, f"groundtune {cls.command} (out_dir={run})") if ranks.main else contextlib.nullcontext()
        try:
            with claim:
                if ranks.main:
                    open_run(run, cfg, resume_from, data)
                distributed.share(None, ranks)  # the others start once rank 0 has claimed and written the folder
                run = body(run, cfg, resume_from, data, on_step, ranks)
        except Exception as e:
            distributed.finish(ranks, wait=False)
            if ranks.many and distributed.lost_peer(e):
                raise RankLostError(_rank_lost(ranks, run, cls.command, e)) from e
            raise
    distributed.finish(ranks)  # (the folder released first) every rank waits for the others here
    return run


def resume_command(ranks: distributed.Ranks, command: str, run: Path) -> str:
    """How to resume ``run`` as it was launched (torchrun: as many ranks, though any number would do)."""
    if not ranks.launched:
        return f"groundtune {command} --resume {run}"
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", ranks.world))
    nodes = f" (on each of its {ranks.world // per_node} nodes)" if per_node < ranks.world else ""
    return f"torchrun --nproc-per-node {per_node} -m groundtune {command} --resume {run}{nodes}"


def _rank_lost(ranks: distributed.Ranks, run: Path, command: str, error: Exception) -> str:
    checkpoints = ckpt.list_checkpoints(run)
    where = (f"its last checkpoint is {checkpoints[-1].name}; resume with: {resume_command(ranks, command, run)}"
             if checkpoints else "it had written no checkpoint yet")
    return (f"rank {ranks.rank}: another rank of this run stopped ({str(error).splitlines()[0][:160]}); the rank that "
            f"failed first says why, above. The run stopped with it: {where}")


def prepare_run(cfg, resume, cls: type = TrainConfig,
                resume_overrides: tuple[str, ...] = ()) -> tuple[Path, TrainConfig, Path | None]:
    """The run folder and settings of a new run, or of a resumed one (its saved ``cls`` settings,
    ``resume_overrides`` naming corrected train_data/eval_data files, and its newest checkpoint).
    Writes nothing; refuses a new run where a run is (unless ``overwrite``) and a resume where none can be."""
    if resume is not None:
        run = Path(resume)
        saved = RunFolder(run).config
        if not saved.exists():
            raise MissingError(f"{run}: no {saved.name}; is this a groundtune run folder?")
        unknown = sorted({item.split("=", 1)[0].strip() for item in resume_overrides} - set(RESUME_OVERRIDES))
        if unknown:
            raise ConfigError(f"--resume takes no {', '.join(unknown)}: the run's saved {saved.name} is used, so "
                              f"the resumed run is the same run (only {' and '.join(RESUME_OVERRIDES)} may name a "
                              "corrected file of the same records)")
        cfg = load_config(cls, saved, resume_overrides)
        checkpoints = ckpt.list_checkpoints(run)
        if not checkpoints:
            raise MissingError(f"{run}: no checkpoint to resume from in {RunFolder(run).checkpoints}")
        _check_machine_and_model(cfg)
        return run, cfg, checkpoints[-1]
    run = Path(cfg.out_dir)
    _check_out_dir(run, cfg, _check_machine_and_model(cfg))  # before anything of an old run is replaced
    # what a run leaves that is worth keeping: its model, or checkpoints to resume from
    checkpoints, folder = ckpt.list_checkpoints(run), RunFolder(run)
    held = [name for name, there in ((f"{folder.model.name}/", folder.model.is_dir()),
                                     (folder.checkpoints.name, checkpoints)) if there]
    if held and not cfg.overwrite:
        how = (f"resume it with `groundtune {cfg.command} --resume {run}`, "
               if checkpoints and not ckpt.is_finished(checkpoints[-1]) else "")
        raise RunExistsError(f"{run} already holds a run ({', '.join(held)}); {how}choose another out_dir, or "
                             "set overwrite=true to replace it")
    if held and not folder.config.is_file():
        raise RunExistsError(f"overwrite=true: {run} holds {', '.join(held)} but no {folder.config.name}: not a "
                             "groundtune run, so nothing there is replaced; choose another out_dir")
    return run, cfg, None


def _check_out_dir(run: Path, cfg, model: tuple[str, Path | None]) -> None:
    """out_dir can be a run folder: not a file, and never the model (``model``: what ``resolve``
    made of it) or data the run reads, nor holding them, nor inside them: a replaced run would
    take them with it."""
    if run.exists() and not run.is_dir():
        raise RunExistsError(f"out_dir={run}: a file is there; name a folder for the run")
    kind, model_folder = model
    reads = {"model": model_folder if kind in ("run", "folder") else None,
             **{name: getattr(cfg, name) for name in ("train_data", "eval_data")
                if not getattr(cfg, name).startswith(SYNTH_PREFIX)}}
    not_an_input(run, "out_dir=", reads, folder=True)


def _check_machine_and_model(cfg) -> tuple[str, Path | None]:
    """What would otherwise fail only once the model loads: a device this machine has not, a model
    name that is not there (no weights are read). Returns what the model name is (``resolve``)."""
    pick_device(cfg.device)
    return resolve(cfg.model)


def finished_already(run: Path, resume_from: Path | None) -> bool:
    """Whether a resume was asked of a run that has finished (said, with where its model is)."""
    if resume_from is None or not ckpt.is_finished(resume_from):
        return False
    step = json.loads((resume_from / "state.json").read_text())["step"]
    print(f"{run} finished at step {step}: nothing to resume. Its model is {RunFolder(run).model}; to train on, "
          f"start a new run from it (model={run} out_dir=...)")
    return True


@dataclass
class RunData:
    """What a run trains and evaluates on, every record checked: usable records (fixes applied), and
    the unusable lines of both files (left out with bad_records=skip)."""

    samples: FileSamples | SyntheticStream
    eval_records: list[dict]
    bad: list[dict] = field(default_factory=list)  # {"file", "line", "kinds", "message"}

    def fingerprint(self) -> dict:
        """What a resumed run must find again: as many training records, with the same ids in the
        same order (the order of a run is a function of them), whatever their fixes."""
        if isinstance(self.samples, SyntheticStream):
            return {}
        ids = "\n".join(str(r.get("id")) for r in self.samples.samples)
        return {"train_records": len(self.samples), "train_ids_sha1": hashlib.sha1(ids.encode()).hexdigest()}


def check_data(cfg) -> RunData:
    """Every record of train_data and eval_data checked as `groundtune data check` checks them,
    before the model loads: unusable ones refused with its table (``bad_records=refuse``) or left
    out and listed (``skip``)."""
    bad, usable = [], {}
    files = [("train_data", cfg.train_data)] + ([("eval_data", cfg.eval_data)] if cfg.eval_data else [])
    for role, path in files:
        if path.startswith(SYNTH_PREFIX):
            continue
        checked = check_records(path)
        if checked.bad and cfg.bad_records == "refuse":
            raise DataError(checked.refusal(role))
        if not checked.usable:
            what = f"no usable record ({len(checked.bad)} bad)" if checked.report.lines else "holds no records"
            raise DataError(f"{role}={path}: {what}; see `groundtune data check {path}`")
        bad += [{"file": str(path), **b} for b in checked.bad]
        usable[role] = [record for _, record in checked.usable]
        if checked.bad:
            print(f"{role}: {len(checked.bad)} of {checked.report.lines} records of {path} left out "
                  f"(bad_records=skip), listed in {RunFolder(cfg.out_dir).bad_records.name}")
    samples = (open_samples(cfg.train_data, cfg.seed) if cfg.train_data.startswith(SYNTH_PREFIX)
               else FileSamples(usable["train_data"], cfg.train_data))
    return RunData(samples, usable.get("eval_data", [])[: cfg.eval_samples], bad)


def open_run(run: Path, cfg, resume_from: Path | None, data: RunData) -> None:
    """Write the run folder of a claimed run (under its RunLock): a replaced run's files gone
    (``overwrite``), the settings, the records left out; a resumed run's data checked against the
    records it started with, first."""
    folder = RunFolder(run)
    if resume_from is not None:
        started = json.loads(folder.data.read_text()) if folder.data.exists() else {}
        now = data.fingerprint()
        if started and now != started:
            raise DataError(f"train_data={cfg.train_data} holds {now.get('train_records')} usable records "
                            f"(ids {now.get('train_ids_sha1', '')[:12]}), not the {started.get('train_records')} the run "
                            f"started with (ids {started.get('train_ids_sha1', '')[:12]}): a resumed run goes on in "
                            "the same order over the same records; correct the file without adding or removing "
                            "records, or start a new run")
        ckpt.restore_interrupted_swap(folder.model)
    else:
        run.mkdir(parents=True, exist_ok=True)
        for path in folder.replaced_by_a_new_run:
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        folder.data.write_text(json.dumps(data.fingerprint(), indent=2) + "\n")
        if data.bad:  # a resumed run keeps the list, and what it adds of samples that broke since
            with atomic_write(folder.bad_records) as f:
                f.writelines(json.dumps(b, ensure_ascii=False) + "\n" for b in data.bad)
    folder.stop.unlink(missing_ok=True)
    folder.config.write_text(to_yaml(cfg))


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
    parallel: Parallel | None = None  # how the ranks train the model (train/parallel.py); rank 0 writes the run

    @property
    def ranks(self) -> distributed.Ranks:
        return self.parallel.ranks

    @classmethod
    def start(cls, run: Path, cfg, gm: GroundingModel, resume_from: Path | None, data: RunData,
              on_step: Callable | None = None, parallel: Parallel | None = None, **extra_state) -> "Loop":
        """The optimizer (AdamW over ``adapt.param_groups``), the schedule, the loop state (plus
        ``extra_state``) of a new run, or all of them restored from ``resume_from``, the run's
        newest checkpoint; ``data``: the checked records (its eval subset is evaluated).
        ``parallel``: the model as the ranks train it (by default one process's)."""
        parallel = parallel or Parallel(gm.model, distributed.Ranks())
        ranks = parallel.ranks
        # fused: one kernel for every tensor, on a GPU; sharded parameters take the default path
        optimizer = torch.optim.AdamW(adapt.param_groups(gm.model, cfg), betas=(0.9, 0.95),
                                      fused=gm.device.type == "cuda" and not parallel.sharded)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
        # best_acc: the best eval's headline metric (evaluate.headline: Acc@0.5, or its fallback)
        state = {"step": 0, "samples": 0, "best_acc": -1.0, "bad_steps": 0, "finished": False, **extra_state}
        saved = ckpt.read_checkpoint(resume_from, gm.model) if resume_from is not None else None
        if saved is not None:
            parallel.load_weights(saved.weights)  # before DeepSpeed makes its copy of them
        parallel.start(optimizer, cfg.deepspeed_config, cfg.max_grad_norm)
        if saved is not None:  # over the defaults: a run saved before a state key existed resumes too
            parallel.load_optimizer_state(optimizer, saved.optimizer)
            scheduler.load_state_dict(saved.scheduler)
            ckpt.set_rng_state(saved.rng_of(ranks.rank))
            state = {**state, **saved.state}
            if ranks.main:
                print(f"resumed from {resume_from} at step {state['step']}")
        # a resumed run's log keeps each step once: lines past its checkpoint are replayed
        log = (MetricsLog(run, state["step"] if resume_from is not None else None, cfg.report_to, asdict(cfg))
               if ranks.main else _NoLog())
        if resume_from is None:
            log.log(0, {"data/bad_records": len(data.bad),
                        **({"eval/decoding": Decoding.greedy(cfg.eval_max_new_tokens).to_dict()} if data.eval_records
                           else {})})
        return cls(run, cfg, gm, optimizer, scheduler, state, data.eval_records, log, on_step, parallel)

    def skip_unreadable(self, failed: list[str], drawn: int) -> None:
        """Samples of a batch that failed to load during the run (a file deleted or damaged since the
        check): left out, counted and listed; more than ``max_bad_fraction`` of a batch stops the run."""
        self.state["skipped_samples"] = self.state.get("skipped_samples", 0) + len(failed)
        if self.ranks.main:
            with open(RunFolder(self.run).bad_records, "a", encoding="utf-8") as f:
                f.writelines(json.dumps({"step": self.state["step"] + 1, "message": m}, ensure_ascii=False) + "\n"
                             for m in failed)
        self.log.log(self.state["step"] + 1, {"data/skipped": len(failed), "data/skipped_total": self.state["skipped_samples"]})
        if len(failed) > self.cfg.max_bad_fraction * drawn:
            if not self.ranks.many:  # (the other ranks are elsewhere: the last checkpoint is the one to resume)
                self._save_checkpoint()
            self.log.close()
            raise TrainingError(f"{len(failed)} of {drawn} samples of a batch failed to load (more than "
                                f"max_bad_fraction={self.cfg.max_bad_fraction}), e.g. {failed[0]}; check the data "
                                f"(groundtune data check {self.cfg.train_data}), then resume")

    def autocast(self):
        """bf16 autocast where the run trains in bf16 (trainable weights stay fp32), else nothing."""
        device = self.gm.device
        return (torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16(self.cfg, device)
                else contextlib.nullcontext())

    def evaluate(self, say=print) -> dict:
        """Greedy eval on the fixed subset of eval_data; a new best (by ``evaluate.headline``:
        Acc@0.5, or F1@0.5 / set_acc@0.5 on an eval set where Acc@0.5 counts nothing) is saved as
        the run's model. With several ranks, each answers its share and rank 0 scores them all
        (the others get {}). A box head's threshold is chosen here: the one of best F1@0.5 on this
        eval set (``evaluate.best_threshold``), which its answers are scored at and the head keeps."""
        from groundtune import evaluate, infer

        step, cfg, ranks = self.state["step"], self.cfg, self.ranks
        box_head = head.head_of(self.gm.model)
        if box_head is not None:  # every box any threshold could keep: the threshold is chosen below
            box_head.threshold = evaluate.THRESHOLD_CHOICES[0]
        with self.parallel.gathered():  # sharded weights gathered once for the whole eval
            mine = infer.predict_records(self.gm, self.eval_samples[ranks.rank :: ranks.world], cfg.eval_data,
                                         cfg.eval_batch_size, cfg.eval_max_new_tokens)
        shares = distributed.gather(mine, ranks)
        predictions = [None] * len(self.eval_samples)
        for rank, share in enumerate(shares or []):
            predictions[rank :: ranks.world] = share
        metrics, saved = {}, None
        if box_head is not None:  # the threshold of best F1@0.5 here, saved with the head
            chosen = evaluate.best_threshold(predictions, self.eval_samples) if ranks.main else None
            box_head.threshold = distributed.share(chosen, ranks)
            predictions = [pred.above(box_head.threshold) for pred in predictions] if ranks.main else predictions
        if ranks.main:
            report, rows = evaluate.evaluate(self.gm, self.eval_samples, cfg.eval_data,
                                             batch_size=cfg.eval_batch_size, progress=False,
                                             max_new_tokens=cfg.eval_max_new_tokens, predictions=predictions)
            # None where the eval set has nothing to count (acc and mIoU on a set of no-target samples)
            metrics = {k: report[k] for k in EVAL_LOGGED}
            best_by, value = evaluate.headline(report)
            chosen = {"eval/head_threshold": box_head.threshold} if box_head is not None else {}
            self.log.log(step, {**{f"eval/{k}": v for k, v in metrics.items()}, "eval/best_by": best_by, **chosen})
            self.log.report(step, report, rows)
            shown = " ".join(f"{label} {metrics[k]:.3f}" for k, label in EVAL_SHOWN.items() if metrics[k] is not None)
            why = "" if best_by == "acc@0.5" else f" (the best is kept by {best_by})"
            say(f"step {step}: eval {shown}{why}")
            if value is not None and value > self.state["best_acc"]:
                self.state["best_acc"] = value
                saved = {"step": step, "eval": {**metrics, "n": report["n"], "decoding": report["decoding"],
                                                "best_by": best_by}}
        # every rank knows the best so far (it decides what ``finish`` saves) and takes part in saving
        self.state["best_acc"], saved = distributed.share((self.state["best_acc"], saved), ranks)
        if saved is not None:
            self._save_model(saved)
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
            self.evaluate(say)  # every rank answers its share
        if self.on_step is not None:
            self.on_step(step, self.run, self.gm.model)
        reason = stop.reason
        if self.ranks.many and distributed.any_rank(reason is not None, self.ranks, self.gm.device):
            # every rank stops at the same step and says why: the reason of a rank that was asked (a
            # signal to the process group reaches a rank busy in a collective only after it)
            asked = distributed.everyone(reason, self.ranks)
            reason = reason or next(r for r in asked if r is not None)
        if (cfg.save_every and step % cfg.save_every == 0) or is_last or reason:
            self.state["finished"] = is_last
            self._save_checkpoint()
        if reason:
            if self.ranks.main:
                say(f"stopping at step {step} ({reason}); resume with: "
                    f"{resume_command(self.ranks, cfg.command, self.run)}")
            return True
        waited = thermal_pause(self.gm.device, cfg.thermal_pause_c, cfg.thermal_resume_c, log=say)
        if waited:
            self.log.log(step, {"thermal_pause_s": waited})
        return False

    def finish(self) -> Path:
        """The run's model is the best evaluated one, or the last when nothing was evaluated."""
        if not self.eval_samples or self.state["best_acc"] < 0:
            self._save_model({"step": self.state["step"]})
        self.log.close()
        return self.run

    def _save_model(self, extra: dict) -> None:
        weights = self.parallel.model_weights()  # gathered by every rank where no rank holds them whole
        if self.ranks.main:
            ckpt.save_model(self.run, self.gm, self.gm.model, extra, weights)

    def _save_checkpoint(self) -> None:
        """Written by rank 0 in the one-process form (any number of ranks resumes it), from whole
        weights and optimizer state, gathered first where the ranks each hold a part; with every
        rank's generators."""
        parallel, ranks = self.parallel, self.ranks
        weights = parallel.full_weights() if parallel.collective else None
        optimizer_state = parallel.full_optimizer_state(self.optimizer) if parallel.collective else None
        rng = distributed.gather(ckpt.rng_state(), ranks) if ranks.many else None
        if ranks.main:
            ckpt.save_checkpoint(self.run, self.gm.model, self.optimizer, self.scheduler, self.state,
                                 self.cfg.keep_last, weights, optimizer_state, rng)


class _NoLog:
    """The metrics log of a rank that is not rank 0: rank 0 writes the run's."""

    def log(self, step: int, values: dict) -> None:
        pass

    def report(self, step: int, report: dict, rows: list[dict] | None = None) -> None:
        pass

    def close(self) -> None:
        pass

