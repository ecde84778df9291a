"""What the tests of training on several ranks share: torchrun launches of `groundtune train|rl` on
the CPU (gloo), one OMP thread per rank, and reading what a run logged and checkpointed. The tests
are in test_distributed.py (the engines against one process), test_distributed_stops.py (a rank
killed, SIGTERM, NaN, resuming elsewhere) and test_distributed_rl.py (RL under every engine): three
modules, so that the test workers run them side by side."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from groundtune.data import synth

TORCHRUN = shutil.which("torchrun")
MARKS = [pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not on PATH"), pytest.mark.slow]
# the quickstart preset's adapter minus its vision and merger parts (DeepSpeed's engines refuse them)
SETTINGS = ["eval_data=", "lr=5e-3", "method=lora", "lora_targets=[llm_attn,llm_mlp]", "device=cpu", "log_every=1",
            "num_workers=0"]
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
ENGINES = ["ddp", "fsdp2",
           *(pytest.param(k, marks=pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed"))
             for k in ("zero2", "zero3"))]


def make_data(tmp_path_factory) -> Path:
    """64 one-shape samples, the data of the SFT runs."""
    out = tmp_path_factory.mktemp("ddp_data")
    synth.make_synthetic_set(out, n=64, seed=0, task="single", workers=1)
    return out / "train.jsonl"


def launch(command: str, ranks: int, args: list[str]) -> subprocess.Popen:
    launcher = [TORCHRUN, "--nproc-per-node", str(ranks), "-m"] if ranks else [sys.executable, "-m"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([*launcher, "groundtune", command, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def train(data: Path, out: Path, ranks: int, *settings: str, model: str | None = None,
          resume: bool = False) -> subprocess.Popen:
    """``ranks`` processes under torchrun (0: one plain process, no launcher). ``model``: named by
    every new run (the preset's default, the built-in model, costs more per step than the tests'
    small random one); a resumed run reads its own."""
    if not resume and model is None:
        raise ValueError("a new run names its model")
    args = ["--resume", str(out)] if resume else ["quickstart", f"model={model}", f"train_data={data}",
                                                   f"out_dir={out}", *SETTINGS, *settings]
    return launch("train", ranks, args)  # (a later eval_data= wins over SETTINGS')


def finish(process: subprocess.Popen) -> str:
    output = process.communicate(timeout=300)[0]
    assert process.returncode == 0, output
    return output


def logged(run: Path, key: str) -> list:
    return [r[key] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if key in r]


def checkpoint(run: Path, step: int) -> tuple[dict, dict]:
    folder = run / "checkpoints" / f"step-{step:06d}"
    return (load_file(folder / "trainable.safetensors"),
            torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=False))



def stop_after(run: Path, steps: int, process: subprocess.Popen, act) -> threading.Thread:
    """``act()`` once ``run`` has logged ``steps`` steps (as a user would, watching it)."""
    def watch() -> None:
        while process.poll() is None:
            if (run / "metrics.jsonl").exists() and len(logged(run, "loss")) >= steps:
                act()
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    return watcher


def ranks_of(launcher: int) -> list[int]:
    """The processes torchrun started for its ranks, in the order it started them (rank 0 first)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if parent == launcher and b"groundtune" in command:
            found.append(int(proc.name))
    return sorted(found)


