"""Run folders: resumable checkpoints written atomically, and the model folder users load.

    RUN/config.yaml                 the resolved settings
    RUN/metrics.jsonl, RUN/tb/      logs
    RUN/checkpoints/step-000100/    trainable weights, optimizer, scheduler, RNG, loop state
    RUN/model/                      the model to use: best by Acc@0.5 when evaluating, else the last
                                    (a LoRA adapter or full weights, + processor + groundtune.json)

Every folder is written under a temporary name and renamed into place, so a kill -9 at any moment
leaves the previous checkpoint intact and never a half-written one under a real name.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from groundtune.models.loading import GroundingModel, write_metadata

CHECKPOINTS = "checkpoints"


def _replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished folder into place; the old one is removed only after the new one is whole."""
    old = final.with_name(f".{final.name}.old")
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    if old.exists():
        shutil.rmtree(old)


def _fresh_tmp(parent: Path, name: str) -> Path:
    tmp = parent / f".{name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)  # left by a run killed while writing
    tmp.mkdir(parents=True)
    return tmp


def _remove_leftovers(parent: Path) -> None:
    """Folders a run killed while writing left behind (.step-N.tmp, .step-N.old): a resumed run may
    never write that step again, and for full fine-tuning each holds gigabytes."""
    for path in parent.glob(".step-*"):
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


def save_checkpoint(run: Path, model, optimizer, scheduler, state: dict, keep_last: int) -> Path:
    """Write RUN/checkpoints/step-N atomically and delete all but the newest ``keep_last``."""
    parent = run / CHECKPOINTS
    name = f"step-{state['step']:06d}"
    if parent.is_dir():
        _remove_leftovers(parent)
    tmp = _fresh_tmp(parent, name)
    trainable = {n: p.detach().contiguous().cpu() for n, p in model.named_parameters() if p.requires_grad}
    save_file(trainable, tmp / "trainable.safetensors")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps(state, indent=2))
    _replace_dir(tmp, parent / name)
    for stale in list_checkpoints(run)[:-keep_last]:
        shutil.rmtree(stale)
    return parent / name


def list_checkpoints(run: Path) -> list[Path]:
    parent = run / CHECKPOINTS
    if not parent.is_dir():
        return []
    return sorted(p for p in parent.iterdir() if p.is_dir() and p.name.startswith("step-"))


def load_checkpoint(path: Path, model, optimizer, scheduler) -> dict:
    """Restore weights, optimizer, scheduler and RNG from a checkpoint; returns the loop state."""
    weights = load_file(path / "trainable.safetensors")
    params = dict(model.named_parameters())
    missing = [n for n, p in params.items() if p.requires_grad and n not in weights]
    if missing:
        raise ValueError(f"{path}: checkpoint lacks {len(missing)} trainable tensors (e.g. {missing[0]}); "
                         "was it written with other method/lora settings?")
    with torch.no_grad():
        for n, t in weights.items():
            params[n].copy_(t.to(params[n].device, params[n].dtype))
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", map_location="cpu", weights_only=False))
    set_rng_state(torch.load(path / "rng.pt", map_location="cpu", weights_only=False))
    return json.loads((path / "state.json").read_text())


def save_model(run: Path, gm: GroundingModel, model, extra: dict | None = None) -> Path:
    """Write RUN/model: the adapter (LoRA) or full weights, the processor and groundtune.json."""
    tmp = _fresh_tmp(run, "model")
    # an adapter model saves its trained adapter only (RL may hold a frozen reference copy beside it)
    model.save_pretrained(tmp, **({"selected_adapters": ["default"]} if hasattr(model, "peft_config") else {}))
    if not (tmp / "adapter_config.json").exists():  # full weights: make the folder self-contained
        gm.processor.tokenizer.chat_template = gm.processor.chat_template  # saved with the tokenizer
        gm.processor.tokenizer.save_pretrained(tmp)
        gm.processor.image_processor.save_pretrained(tmp)
    write_metadata(tmp, {**gm.metadata(), **(extra or {})})
    _replace_dir(tmp, run / "model")
    return run / "model"


def is_finished(path: Path) -> bool:
    """Whether a checkpoint is the last step of its run."""
    return bool(json.loads((path / "state.json").read_text()).get("finished"))
