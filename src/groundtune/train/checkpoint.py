"""Run folders: one writer at a time, resumable checkpoints written atomically, and the model
folder users load (RUN/checkpoints/step-000100/, RUN/model/, RUN/.lock: the layout is
groundtune/runs.py's).

Every folder is written under a temporary name and renamed into place, so a kill -9 at any moment
leaves the previous checkpoint intact and never a half-written one under a real name. A write that
fails (a full disk, a quota, ``ulimit -f``) is a DiskFullError of one line saying how much was needed
where and which checkpoint is the last good one, and leaves nothing half-written.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import random
import resource
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from groundtune.errors import DiskFullError, RunBusyError
from groundtune.models import head
from groundtune.models.loading import GroundingModel, write_metadata
from groundtune.runs import STEP_PREFIX, RunFolder

# the errors of a write the disk, a quota or a file-size limit refused, and how libraries that wrap
# them word them (torch.save: "file write failed"; safetensors: "I/O error: ... (os error 28)")
_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
_FULL_SIGNS = ("No space left", "File too large", "Disk quota", "file write failed", "PytorchStreamWriter failed",
               *(f"os error {code})" for code in _FULL))


class RunLock:
    """RUN/.lock while a process writes the run: a second writer is refused with a message naming
    the first. A lock whose process is gone (killed, crashed; same host) is stale and taken over."""

    def __init__(self, run: Path, command: str = ""):
        self.path, self.command = RunFolder(run).lock, command
        self.mine = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "command": command}

    def __enter__(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is not None and self._alive(holder):
                    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
                    raise RunBusyError(
                        f"{self.path.parent} is being written by process {holder.get('pid')} on "
                        f"{holder.get('host')} since {since} ({holder.get('command') or 'groundtune'}); wait for it, "
                        f"or choose another out_dir (if that process is gone, delete {self.path})") from None
                self.path.unlink(missing_ok=True)  # stale: its process is gone
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.mine, f)
            return self

    def __exit__(self, *exc) -> None:
        if self._holder() == self.mine:
            self.path.unlink(missing_ok=True)

    def _holder(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None  # vanished, or half-written by a process killed while writing it

    @staticmethod
    def _alive(holder: dict) -> bool:
        if holder.get("host") != socket.gethostname():
            return True  # another machine's process cannot be checked from here
        try:
            os.kill(int(holder["pid"]), 0)
        except ProcessLookupError:
            return False
        except (PermissionError, KeyError, ValueError):
            return True
        return True


@contextlib.contextmanager
def _refused_writes_named(target: Path, needed_bytes: int, run: Path):
    """A write that failed (no space, a quota, a file-size limit: torch.save says "file write
    failed", or only "unexpected pos" when the file came out short; safetensors "I/O error") becomes
    a DiskFullError of one line: where, what it needed and what is free, and that nothing was lost,
    naming the last good checkpoint. The block holds writes only (what they write is made before
    it), so any OSError or RuntimeError in it is a write that failed, not a bug to trace."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, RuntimeError, SafetensorError) as e:
        text = str(e).strip()
        refused = (isinstance(e, OSError) and e.errno in _FULL) or any(sign in text for sign in _FULL_SIGNS)
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY:  # ulimit -f: a file larger than this is refused whatever the disk has
            refused, limited = True, f", and no file here may be over {limit / 2**20:.1f} MiB (ulimit -f)"
        else:
            limited = ""
        free = shutil.disk_usage(target.parent if target.parent.exists() else Path.cwd()).free
        earlier = list_checkpoints(run)
        way_out = "Free some space (or set out_dir on another disk), then"
        way_out = (f"nothing is lost: {earlier[-1]} is the last good checkpoint. {way_out} --resume {run} goes on "
                   "from it" if earlier else f"no checkpoint was written before it. {way_out} start the run again")
        reason = (text.splitlines() or [type(e).__name__])[-1].strip()[:160]
        raise DiskFullError(
            f"could not write {target}: {'the disk refused it' if refused else 'the write failed'} ({reason}); it "
            f"needs about {_amount(needed_bytes)} and {_amount(free)} is free there{limited}; {way_out}") from None


def _amount(size: int) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def _replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished folder into place; the old one is removed only after the new one is whole.
    A kill between the two renames leaves the old one as .NAME.old and no NAME: put back first."""
    old = final.with_name(f".{final.name}.old")
    restore_interrupted_swap(final)
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    if old.exists():
        shutil.rmtree(old)


def restore_interrupted_swap(final: Path) -> None:
    """Where a kill fell between moving NAME aside and moving its successor in, NAME is back."""
    old = final.with_name(f".{final.name}.old")
    if old.is_dir() and not final.exists():
        os.replace(old, final)


def _fresh_tmp(final: Path) -> Path:
    """Where ``final`` is written before it is renamed into place."""
    tmp = final.parent / f".{final.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)  # left by a run killed while writing
    tmp.mkdir(parents=True)
    return tmp


def _remove_leftovers(parent: Path) -> None:
    """Folders a run killed while writing left behind (.step-N.tmp, .step-N.old): a resumed run may
    never write that step again, and for full fine-tuning each holds gigabytes. A .step-N.old whose
    step-N is missing is that checkpoint, caught between two renames: it is put back instead."""
    for path in parent.glob(f".{STEP_PREFIX}*"):
        if path.is_dir() and path.suffix == ".old":
            restore_interrupted_swap(path.with_name(path.name[1:].removesuffix(".old")))
        if path.is_dir() and path.suffix in (".tmp", ".old"):
            shutil.rmtree(path)


def rng_state() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run: Path, model, optimizer, scheduler, state: dict, keep_last: int,
                    weights: dict | None = None, optimizer_state: dict | None = None,
                    rng: dict | list | None = None) -> Path:
    """Write RUN/checkpoints/step-N atomically and delete all but the newest ``keep_last``.
    ``weights``, ``optimizer_state``: whole ones gathered from several ranks (by default the
    model's trainable weights and the optimizer's state dict); ``rng``: every rank's generators
    (by default this process's)."""
    final = RunFolder(run).checkpoint(state["step"])
    if final.parent.is_dir():
        _remove_leftovers(final.parent)
    tmp = _fresh_tmp(final)
    trainable = weights if weights is not None else {
        n: p.detach().contiguous().cpu() for n, p in model.named_parameters() if p.requires_grad}
    size = sum(t.numel() * t.element_size() for t in trainable.values())
    optimizer_state = optimizer_state if optimizer_state is not None else optimizer.state_dict()
    scheduler_state, rng = scheduler.state_dict(), rng if rng is not None else rng_state()
    try:
        with _refused_writes_named(final, 3 * size, run):  # weights + Adam's two moments
            save_file(trainable, tmp / "trainable.safetensors")
            torch.save(optimizer_state, tmp / "optimizer.pt")
            torch.save(scheduler_state, tmp / "scheduler.pt")
            torch.save(rng, tmp / "rng.pt")
            (tmp / "state.json").write_text(json.dumps(state, indent=2))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written stays, not even under a hidden name
        raise
    _replace_dir(tmp, final)
    for stale in list_checkpoints(run)[:-keep_last]:
        shutil.rmtree(stale)
    return final


def list_checkpoints(run: Path) -> list[Path]:
    parent = RunFolder(run).checkpoints
    if not parent.is_dir():
        return []
    for old in parent.glob(f".{STEP_PREFIX}*.old"):  # a checkpoint caught between two renames counts as written
        restore_interrupted_swap(old.with_name(old.name[1:].removesuffix(".old")))
    return sorted(p for p in parent.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX))


@dataclass
class Checkpoint:
    """What a checkpoint holds, read back: whole weights and optimizer state (the one-process
    form, whatever number of ranks wrote it), scheduler, generators and the loop state."""

    weights: dict[str, torch.Tensor]
    optimizer: dict
    scheduler: dict
    rng: dict | list  # one process's generators, or a list of every rank's
    state: dict

    def rng_of(self, rank: int) -> dict:
        """The generators of ``rank`` (rank 0's for a rank the writing run did not have)."""
        return self.rng[rank if rank < len(self.rng) else 0] if isinstance(self.rng, list) else self.rng


def read_checkpoint(path: Path, model) -> Checkpoint:
    """A checkpoint's contents, its weights checked against ``model``'s trainable ones."""
    weights = load_file(path / "trainable.safetensors")
    missing = [n for n, p in model.named_parameters() if p.requires_grad and n not in weights]
    if missing:
        raise ValueError(f"{path}: checkpoint lacks {len(missing)} trainable tensors (e.g. {missing[0]}); "
                         "was it written with other method/lora settings?")
    load = functools.partial(torch.load, map_location="cpu", weights_only=False)
    return Checkpoint(weights, load(path / "optimizer.pt"), load(path / "scheduler.pt"), load(path / "rng.pt"),
                      json.loads((path / "state.json").read_text()))


def load_checkpoint(path: Path, model, optimizer, scheduler) -> dict:
    """Restore weights, optimizer, scheduler and RNG of one process from a checkpoint; returns the
    loop state. (Several ranks restore through train/parallel.py, each its part.)"""
    saved = read_checkpoint(path, model)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, t in saved.weights.items():
            params[n].copy_(t.to(params[n].device, params[n].dtype))
    optimizer.load_state_dict(saved.optimizer)
    scheduler.load_state_dict(saved.scheduler)
    set_rng_state(saved.rng_of(0))
    return saved.state


def save_model(run: Path, gm: GroundingModel, model, extra: dict | None = None,
               weights: dict[str, torch.Tensor] | None = None) -> Path:
    """Write RUN/model: the adapter (LoRA) or full weights, the processor and groundtune.json.
    ``weights``: whole ones gathered from ranks that each hold a part (else the model's own)."""
    final = RunFolder(run).model
    tmp = _fresh_tmp(final)
    adapter = hasattr(model, "peft_config")
    saved = list(weights.values()) if weights is not None else [
        p for n, p in model.named_parameters() if not adapter or "lora_" in n]
    box_head = head.head_of(model)
    if box_head is not None and not adapter:  # the head goes in a file of its own, not in the model's
        everything = weights if weights is not None else model.state_dict()
        weights = head.model_weights(everything)
    whole = {"state_dict": weights} if weights is not None else {}
    try:
        with _refused_writes_named(final, sum(p.numel() * p.element_size() for p in saved), run):
            # an adapter model saves its trained adapter only (RL may hold a frozen reference copy beside it)
            model.save_pretrained(tmp, **({"selected_adapters": ["default"]} if adapter else {}), **whole)
            if box_head is not None:
                head.save(box_head, tmp, everything if not adapter else weights)
            if not adapter:  # full weights: make the folder self-contained
                gm.processor.tokenizer.chat_template = gm.processor.chat_template  # saved with the tokenizer
                gm.processor.tokenizer.save_pretrained(tmp)
                gm.processor.image_processor.save_pretrained(tmp)
            write_metadata(tmp, {**gm.metadata(), **(extra or {})})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _replace_dir(tmp, final)
    return final


def is_finished(path: Path) -> bool:
    """Whether a checkpoint is the last step of its run."""
    return bool(json.loads((path / "state.json").read_text()).get("finished"))
