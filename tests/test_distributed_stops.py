"""Stopping a run on several ranks: a rank killed ends the run with a clear message and, resumed,
it equals one never stopped; SIGTERM to the launcher's process group stops every rank at one step,
rank 0 saves, and the run resumes; a sharded (FSDP2) run resumes on one process; a NaN on one rank
skips the step on every rank. Real torchrun processes (a signal or a kill is sent to a process);
the reference is an uninterrupted 2-rank run, a module fixture (tests/ranks.py: the launches)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
import torch
from ranks import MARKS, SETTINGS, TORCHRUN, checkpoint, finish, logged, make_data, ranks_of, stop_after, train

pytestmark = MARKS


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory)


@pytest.fixture(scope="module")
def whole(data, small_model, tmp_path_factory):
    """6 steps of the global batch 4 on 2 ranks, never stopped: the reference of the runs stopped on
    2 ranks. (Two ranks of batch 2 train as one process of batch 4, test_distributed.py shows, but
    not to the last bit: their gradients are summed in another order, and by step 6 of the built-in
    model, where the loss is ~3e-4, the two differed by 1.3e-5 of it on some CPUs. A stop and resume
    must change nothing, so the reference is the same world size.)"""
    run = tmp_path_factory.mktemp("whole") / "run"
    finish(train(data, run, 2, "max_steps=6", "batch_size=2", "save_every=1", model=small_model))
    return run


def test_a_killed_rank_ends_the_run_clearly_and_the_resumed_run_equals_an_uninterrupted_one(data, small_model, whole,
                                                                                             tmp_path):
    killed = tmp_path / "killed"
    process = train(data, killed, 2, "max_steps=6", "batch_size=2", "save_every=1", model=small_model)

    def kill_rank_1() -> None:
        os.kill(ranks_of(process.pid)[1], signal.SIGKILL)

    watcher = stop_after(killed, 2, process, kill_rank_1)
    started = time.time()
    output = process.communicate(timeout=300)[0]
    watcher.join()
    assert process.returncode != 0 and time.time() - started < 120  # no hang
    assert "rank 0: another rank of this run stopped" in output, output
    assert f"groundtune train --resume {killed}" in output
    assert len(logged(killed, "loss")) < 6
    finish(train(data, killed, 2, resume=True))
    assert logged(killed, "loss") == pytest.approx(logged(whole, "loss"), rel=1e-5)


def test_sigterm_to_the_process_group_stops_every_rank_at_one_step_and_the_run_resumes(data, small_model, whole,
                                                                                        tmp_path):
    """As a cluster scheduler preempts a job: SIGTERM to the launcher and its ranks at once. Every
    rank finishes its step, rank 0 saves, the ranks exit 0 (torchrun itself reports the signal)."""
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["quickstart", f"model={small_model}", f"train_data={data}", f"out_dir={run}", *SETTINGS, "max_steps=6",
            "batch_size=2", "save_every=0"]
    process = subprocess.Popen([TORCHRUN, "--nproc-per-node", "2", "-m", "groundtune", "train", *args], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    watcher = stop_after(run, 2, process, lambda: os.killpg(process.pid, signal.SIGTERM))
    output = process.communicate(timeout=300)[0]
    watcher.join()
    stopped = len(logged(run, "loss"))
    assert f"stopping at step {stopped} (SIGTERM)" in output and output.count("stopping at step") == 1, output
    assert "exitcode" not in output  # no rank failed: only the launcher reports the signal
    assert [p.name for p in (run / "checkpoints").iterdir()] == [f"step-{stopped:06d}"]  # save_every=0: the stop's
    finish(train(data, run, 2, resume=True))
    assert logged(run, "loss") == pytest.approx(logged(whole, "loss"), rel=1e-5)


def test_a_sharded_run_resumes_on_one_process(data, small_model, tmp_path):
    run = tmp_path / "fsdp2"
    process = train(data, run, 2, "max_steps=4", "batch_size=2", "save_every=1", "distributed=fsdp2",
                    model=small_model)
    watcher = stop_after(run, 2, process, lambda: (run / "STOP").touch())
    output = finish(process)
    watcher.join()
    assert output.count("stopping at step") == 1  # said once, by rank 0
    assert f"resume with: torchrun --nproc-per-node 2 -m groundtune train --resume {run}" in output
    stopped_at = len(logged(run, "loss"))
    weights, _ = checkpoint(run, stopped_at)
    output = finish(train(data, run, 0, resume=True))  # no launcher: one process
    assert f"resumed from {run / 'checkpoints' / f'step-{stopped_at:06d}'} at step {stopped_at}" in output
    assert logged(run, "step")[-1] == 4 and (run / "model").is_dir()
    assert all(torch.isfinite(t).all() for t in weights.values())


POISON = """
import os, sys, torch
from groundtune.config import TrainConfig, load_config, preset_path
from groundtune.train.sft import train

def poison(step, run, model):  # rank 1's adapter turns to NaN after step 2: only its losses are NaN
    if step == 2 and os.environ["RANK"] == "1":
        with torch.no_grad():
            next(p for n, p in model.named_parameters() if "lora_B" in n).fill_(float("nan"))

train(load_config(TrainConfig, preset_path("quickstart"), sys.argv[1:]), on_step=poison)
"""


def test_a_nan_on_one_rank_skips_the_step_on_every_rank(data, small_model, tmp_path):
    driver = tmp_path / "poison.py"
    driver.write_text(POISON)
    run = tmp_path / "run"
    done = subprocess.run([TORCHRUN, "--nproc-per-node", "2", str(driver), f"model={small_model}",
                           f"train_data={data}", f"out_dir={run}", *SETTINGS, "max_steps=6", "batch_size=2",
                           "save_every=0", "max_bad_steps=2"], check=False, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    output = done.stdout + done.stderr
    assert done.returncode != 0
    # both ranks gave up together, after the same two skipped steps (rank 0's own losses were finite)
    assert output.count("2 non-finite losses/gradients in a row at step 2") == 2, output
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["bad_steps"] for r in rows if "skipped_nonfinite" in r] == [1, 2]
    # the checkpoint written on giving up holds step 2's weights: no NaN reached rank 0's update
    weights, _ = checkpoint(run, 2)
    assert all(torch.isfinite(t).all() for t in weights.values())


