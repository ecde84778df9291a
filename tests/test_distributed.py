"""Data parallel training (train/distributed.py): `torchrun --nproc-per-node 2 -m groundtune train`
on the CPU (gloo), the real launcher in a subprocess. Two ranks of batch B train exactly as one
process of batch 2B (fp32), and a two-rank run stopped and resumed equals one never stopped."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from groundtune.data import synth

TORCHRUN = shutil.which("torchrun")
pytestmark = pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not on PATH")
SETTINGS = ["eval_data=", "lr=5e-3", "method=lora", "device=cpu", "log_every=1", "num_workers=0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_data")
    synth.make_synthetic_set(out, n=64, seed=0, task="single", workers=1)
    return out / "train.jsonl"


def _train(data: Path, out: Path, ranks: int, *settings: str, resume: bool = False) -> subprocess.Popen:
    launch = [TORCHRUN, "--nproc-per-node", str(ranks), "-m"] if ranks > 1 else [sys.executable, "-m"]
    args = ["--resume", str(out)] if resume else ["quickstart", f"train_data={data}", f"out_dir={out}", *SETTINGS,
                                                   *settings]  # (a later eval_data= wins over SETTINGS')
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([*launch, "groundtune", "train", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(process: subprocess.Popen) -> str:
    output = process.communicate(timeout=300)[0]
    assert process.returncode == 0, output
    return output


def _logged(run: Path, key: str) -> list:
    return [r[key] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_two_ranks_train_as_one_process_with_their_batches_together(data, tmp_path):
    # eval on 11 samples every 2 steps: the two ranks answer 6 and 5 of them, rank 0 scores all 11
    settings = ("max_steps=4", "save_every=0", f"eval_data={data}", "eval_samples=11", "eval_every=2",
                "eval_batch_size=4")
    one = _finish(_train(data, tmp_path / "one", 1, "batch_size=4", *settings))
    two = _finish(_train(data, tmp_path / "two", 2, "batch_size=2", *settings))
    assert _logged(tmp_path / "two", "loss") == pytest.approx(_logged(tmp_path / "one", "loss"), rel=1e-5)
    evals = [[r for r in map(json.loads, (tmp_path / run / "metrics.jsonl").read_text().splitlines())
              if "eval/miou" in r] for run in ("one", "two")]
    assert [r["step"] for r in evals[1]] == [2, 4]
    assert [r["eval/miou"] for r in evals[1]] == pytest.approx([r["eval/miou"] for r in evals[0]], abs=1e-6)
    assert _logged(tmp_path / "two", "samples") == [4, 8, 12, 16]  # both ranks' samples counted
    assert two.count("run folder:") == 1 and "on 2 ranks (batch 2 each)" in two and "on 2 ranks" not in one
    assert (tmp_path / "two" / "model").is_dir()


def test_two_ranks_stopped_and_resumed_equal_an_uninterrupted_run(data, tmp_path):
    whole = tmp_path / "whole"
    _finish(_train(data, whole, 2, "max_steps=6", "batch_size=2", "save_every=1"))
    stopped = tmp_path / "stopped"
    process = _train(data, stopped, 2, "max_steps=6", "batch_size=2", "save_every=1")

    def stop_after_two_steps() -> None:  # the STOP file, as a user drops it mid-run
        while process.poll() is None:
            if (stopped / "metrics.jsonl").exists() and len(_logged(stopped, "loss")) >= 2:
                (stopped / "STOP").touch()
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=stop_after_two_steps)
    watcher.start()
    output = _finish(process)
    watcher.join()
    assert "stopping at step" in output and output.count("stopping at step") == 1  # said once, by rank 0
    assert len(_logged(stopped, "loss")) < 6
    _finish(_train(data, stopped, 2, resume=True))
    assert _logged(stopped, "loss") == pytest.approx(_logged(whole, "loss"), rel=1e-5)


def test_rl_under_torchrun_is_refused_clearly(tmp_path):
    done = subprocess.run([TORCHRUN, "--nproc-per-node", "2", "-m", "groundtune", "rl", "quickstart-rl",
                           f"out_dir={tmp_path / 'rl'}"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode != 0 and "runs on one process for now" in done.stdout + done.stderr
