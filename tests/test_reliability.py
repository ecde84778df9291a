"""Nothing is lost: real `groundtune train` processes killed with -9 at random moments (one inside a
checkpoint write) resume to the losses and weights of an uninterrupted run, with each step logged
once; SIGTERM to the whole process group saves and exits 0; one writer per run folder; a refused
write (a full disk) leaves the run as it was; an image broken during a run is skipped and counted.
(tests/test_bad_input.py: what bad input gets, command by command.)
The processes are real where the process is the point (kill -9, signals, a file-size limit, the
first writer holding its lock); the second writer's refusal, and the runs before and after the
refused write, run the CLI in this process (tests/cli_in_process.py)."""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_in_process import groundtune
from safetensors.torch import load_file

from groundtune.config import TrainConfig
from groundtune.data import synth
from groundtune.data.samples import ResumableBatches
from groundtune.errors import TrainingError
from groundtune.runs import RunFolder
from groundtune.train import checkpoint as ckpt
from groundtune.train.sft import train

pytestmark = pytest.mark.slow

# full fine-tuning of the small model: its checkpoint (~2.3 MB, the optimizer's state with the weights)
# takes 10-20 ms to write, long enough to be caught in the middle by a watcher looking every millisecond
SETTINGS = ["eval_data=", "device=cpu", "method=full", "freeze_vision=false", "freeze_merger=false", "lr=1e-3", "max_steps=18",
            "batch_size=2", "save_every=3", "keep_last=2", "log_every=1", "warmup_steps=0", "num_workers=0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("reliability")
    synth.make_synthetic_set(out, n=16, seed=4, task="single", workers=1)
    return out / "train.jsonl"


def _start(args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "groundtune", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


def _new(model: str, data: Path, run: Path) -> list[str]:
    return ["train", "quickstart", f"model={model}", f"train_data={data}", f"out_dir={run}", *SETTINGS]


def _steps(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def _wait(proc: subprocess.Popen, ready, what: str, timeout: float = 120, every: float = 0.01) -> None:
    deadline = time.time() + timeout
    while not ready():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before {what}: {proc.stdout.read()}")
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(every)


def test_kill_9_at_five_moments_then_resume_equals_an_uninterrupted_run(small_model, data, tmp_path):
    straight = tmp_path / "straight"
    uninterrupted = _start(_new(small_model, data, straight))  # the reference runs beside the killed ones: two cores

    run = tmp_path / "killed"
    rng = random.Random(14)
    inside_a_write = rng.randrange(5)  # which of the five kills lands in a checkpoint write
    caught_in_write = False
    for kill in range(5):
        args = ["train", "--resume", str(run)] if ckpt.list_checkpoints(run) else _new(small_model, data, run)
        proc = _start(args)
        logged = len(_steps(run)) if (run / "metrics.jsonl").exists() else 0
        if kill == inside_a_write:
            parent = RunFolder(run).checkpoints

            def writing(parent=parent):  # a checkpoint being written: its hidden folder is there
                return parent.is_dir() and any(p.name.endswith(".tmp") for p in parent.iterdir())

            _wait(proc, writing, "a checkpoint write", every=0.001)  # seen early in the write: the kill lands in it
        else:  # a random moment: after 1 to 4 more steps are logged
            target = logged + rng.randint(1, 4)
            _wait(proc, lambda target=target: (run / "metrics.jsonl").exists() and len(_steps(run)) >= target,
                  f"step {target}")
        proc.kill()
        proc.wait()
        caught_in_write |= any(p.name.endswith(".tmp") for p in RunFolder(run).checkpoints.iterdir()) \
            if RunFolder(run).checkpoints.is_dir() else False
        assert RunFolder(run).lock.exists()  # a kill -9 leaves its lock: the next start must see it is stale
    assert caught_in_write, "no kill landed inside a checkpoint write"

    proc = _start(["train", "--resume", str(run)])
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    out, _ = uninterrupted.communicate(timeout=300)
    assert uninterrupted.returncode == 0, out

    theirs, ours = _steps(straight), _steps(run)
    assert [r["step"] for r in ours] == list(range(1, 19))  # each step once, however often resumed
    assert [r["loss"] for r in ours] == [r["loss"] for r in theirs]
    a, b = load_file(straight / "model" / "model.safetensors"), load_file(run / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not RunFolder(run).lock.exists()
    assert sorted(p.name for p in RunFolder(run).checkpoints.iterdir()) == ["step-000015", "step-000018"]


def test_sigterm_to_the_process_group_saves_and_exits_0(small_model, data, tmp_path):
    """What `timeout`, systemd and Slurm do: SIGTERM to every process of the group, the DataLoader's
    workers included. The workers leave it to the main process, which saves and exits cleanly."""
    run = tmp_path / "group"
    args = _new(small_model, data, run)[:-1] + ["num_workers=2", "max_steps=100000", "save_every=0"]
    proc = _start(args, start_new_session=True)  # its own process group, as a job under a scheduler
    _wait(proc, lambda: (run / "metrics.jsonl").exists() and len(_steps(run)) >= 3, "three steps")
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "SIGTERM" in out and f"groundtune train --resume {run}" in out
    saved = ckpt.list_checkpoints(run)
    assert len(saved) == 1 and not ckpt.is_finished(saved[0])
    assert json.loads((saved[0] / "state.json").read_text())["step"] >= 3
    assert not RunFolder(run).lock.exists()


def test_a_program_that_keeps_a_failed_predictions_error_still_exits(small_model, data, tmp_path):
    """The encoding workers leave the group's SIGTERM to the main process (above), but not their
    own main process's: that is how Python ends them at exit. A program that keeps the error of a
    batch that failed holds its loader, workers alive, until exit; deaf workers made that exit
    wait for them forever."""
    (tmp_path / "bad.png").write_bytes(b"not a png")
    program = f"""
from groundtune import infer
records = [{{"image": "{data.parent / 'images' / 'train-0000000.png'}", "phrase": "the shape"}}] * 3
records += [{{"image": "bad.png", "phrase": "the cat"}}]
try:
    infer.predict_records(infer.load("{small_model}", device="cpu"), records, "{tmp_path / 'val.jsonl'}", batch_size=2,
                          max_new_tokens=4, workers=2)
except infer.DataError as error:
    kept = error
    print("failed:", kept)
"""
    assert (data.parent / "images" / "train-0000000.png").exists()
    proc = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the program did not exit: its workers ignored their main process's SIGTERM at exit")
    assert proc.returncode == 0, out
    assert "failed:" in out and "bad.png" in out


@pytest.mark.skipif(not hasattr(signal, "sigwaitinfo"), reason="a worker tells who sent a signal by sigwaitinfo (Linux)")
def test_loader_workers_leave_the_groups_sigterm_but_not_their_own_processes():
    """The contract of every loader worker groundtune starts (training's, prediction's, the
    server's encoders), without a model: a SIGTERM to the whole process group leaves them serving
    the main process, and a program that still holds a loader when it ends exits."""
    program = """
import signal, time, torch
from groundtune.data.samples import stop_signal_workers
torch.set_num_threads(2)  # as groundtune's commands do: each worker then makes a thread before its init function
signalled = []
signal.signal(signal.SIGTERM, lambda *_: signalled.append(1))
loader = iter(torch.utils.data.DataLoader(range(1000), batch_size=None, num_workers=2,
                                          **stop_signal_workers(2)))
print("served", next(loader), next(loader), flush=True)  # one item from each worker: both have started
while not signalled:
    time.sleep(0.02)
time.sleep(0.5)
print("after the group's SIGTERM", next(loader), all(w.is_alive() for w in loader._workers), flush=True)
"""
    proc = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        assert proc.stdout.readline() == "served 0 1\n"
        os.killpg(proc.pid, signal.SIGTERM)  # sent by this process, as `timeout` or a scheduler would
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the program did not exit: its workers ignored their main process's SIGTERM at exit")
    assert proc.returncode == 0, out
    assert "after the group's SIGTERM 2 True" in out


def test_one_writer_per_run_folder(small_model, data, tmp_path):
    run = tmp_path / "busy"
    first = _start(_new(small_model, data, run)[:-5] + ["max_steps=100000", "save_every=0", "log_every=1",
                                                        "warmup_steps=0", "num_workers=0"])
    try:
        # its first step logged: by then its SIGTERM handler is in place (setup writes metrics.jsonl before)
        _wait(first, lambda: (run / "metrics.jsonl").exists() and len(_steps(run)) >= 1, "the first run's first step")
        second = groundtune("train", "quickstart", f"model={small_model}", f"train_data={data}", f"out_dir={run}",
                            "eval_data=", "max_steps=2")
        assert second.returncode == 2
        assert f"is being written by process {first.pid}" in second.stderr and "Traceback" not in second.stderr
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    assert first.returncode == 0  # the first run went on and stopped cleanly: nothing of it was touched
    assert not RunFolder(run).lock.exists()


def _no_bigger_files(limit: int):
    def preexec():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a refused write is an error, not a killed process
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return preexec


def test_a_write_the_disk_refuses_is_one_line_and_the_last_checkpoint_stays(small_model, data, tmp_path):
    """A file-size limit refuses the checkpoint of step 6 as a full disk would: exit 2, a message
    with where and how much, nothing half-written, the checkpoint of step 3 still resumes."""
    run = tmp_path / "full"
    first = groundtune(*_new(small_model, data, run)[:-8], "max_steps=3", "batch_size=2", "save_every=3", "log_every=1",
                       "warmup_steps=0", "num_workers=0", "lr=1e-3")
    assert first.returncode == 0, first.stdout + first.stderr
    config = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(config.replace("max_steps: 3", "max_steps: 9"))  # a longer run, resumed
    (RunFolder(run).checkpoint(3) / "state.json").write_text(
        (RunFolder(run).checkpoint(3) / "state.json").read_text().replace('"finished": true',
                                                                                 '"finished": false'))
    before = {p: p.read_bytes() for p in RunFolder(run).checkpoint(3).iterdir()}
    refused = subprocess.run([sys.executable, "-m", "groundtune", "train", "--resume", str(run)], check=False,
                             capture_output=True, text=True, timeout=300,
                             preexec_fn=_no_bigger_files(2**20))  # the optimizer's 1.5 MB state cannot be written
    assert refused.returncode == 2, refused.stdout + refused.stderr
    message = refused.stderr.strip().splitlines()[-1]
    assert message.startswith(f"error: could not write {RunFolder(run).checkpoint(6)}: the disk refused")
    assert "GiB is free there" in message and "Traceback" not in refused.stderr
    assert f"nothing is lost: {RunFolder(run).checkpoint(3)} is the last good checkpoint" in message
    assert sorted(p.name for p in RunFolder(run).checkpoints.iterdir()) == ["step-000003"]  # nothing half-written
    assert {p: p.read_bytes() for p in RunFolder(run).checkpoint(3).iterdir()} == before
    assert not RunFolder(run).lock.exists()
    resumed = groundtune("train", "--resume", run)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert [r["step"] for r in _steps(run)] == list(range(1, 10))


# --------------------------------------------------------------------------------------------
# an image broken during the run (in-process: the hook deletes it at a known step)


def _cfg(model: str, data: Path, out: Path, **kw) -> TrainConfig:
    base = {"model": model, "train_data": str(data), "out_dir": str(out), "method": "lora", "lr": 1e-3,
            "batch_size": 4, "max_steps": 8, "log_every": 1, "save_every": 0, "warmup_steps": 0, "device": "cpu"}
    return TrainConfig(**{**base, **kw})


def test_an_image_deleted_during_the_run_is_skipped_and_counted(small_model, data, tmp_path):
    records = [json.loads(line) for line in data.read_text().splitlines()]
    copy = tmp_path / "data"
    copy.mkdir()
    for r in records:
        (copy / r["image"]).parent.mkdir(exist_ok=True)
        (copy / r["image"]).write_bytes((data.parent / r["image"]).read_bytes())
    (copy / "train.jsonl").write_text(data.read_text())
    victim = copy / records[5]["image"]

    def delete_at_1(step, run, model):
        if step == 1:
            victim.unlink()

    # 8 steps of 4: every sample twice
    run = train(_cfg(small_model, copy / "train.jsonl", tmp_path / "run"), on_step=delete_at_1)
    # the steps after the first whose batch holds that sample, from the run's own order
    order = iter(ResumableBatches(16, 4, seed=0))
    expected = [step for step in range(1, 9) if 5 in [index for index, _ in next(order)] and step > 1]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    skipped = [r for r in rows if "data/skipped" in r]
    assert expected and [r["step"] for r in skipped] == expected and all(r["data/skipped"] == 1 for r in skipped)
    assert len([r for r in rows if "loss" in r]) == 8  # the run went on to its end
    listed = [json.loads(line) for line in (run / "bad_records.jsonl").read_text().splitlines()]
    assert [r["step"] for r in listed] == expected
    assert all(victim.name in r["message"] and "not found" in r["message"] for r in listed)

    # more than max_bad_fraction of a batch: the run stops, with its checkpoint and the reason
    (copy / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for i, r in enumerate(records) if i != 5))

    def delete_all_at_1(step, run, model):
        if step == 1:
            for r in records:
                (copy / r["image"]).unlink(missing_ok=True)

    with pytest.raises(TrainingError, match=r"4 of 4 samples of a batch failed to load .*max_bad_fraction=0.5"):
        train(_cfg(small_model, copy / "train.jsonl", tmp_path / "stopped", max_bad_fraction=0.5),
              on_step=delete_all_at_1)
    saved = ckpt.list_checkpoints(tmp_path / "stopped")
    assert [p.name for p in saved] == ["step-000001"] and not RunFolder(tmp_path / "stopped").lock.exists()


def test_resume_takes_a_corrected_file_of_the_same_records(small_model, data, tmp_path):
    records = [json.loads(line) for line in data.read_text().splitlines()]
    run = train(_cfg(small_model, data, tmp_path / "run", max_steps=4, save_every=2), on_step=lambda s, r, m: (
        (r / "STOP").touch() if s == 2 else None))
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step-000002"]
    fixed = data.parent / "fixed.jsonl"  # the same records, a phrase corrected
    fixed.write_text("".join(json.dumps({**r, "phrase": r["phrase"] + " "} if i == 3 else r) + "\n"
                             for i, r in enumerate(records)))
    train(resume=run, resume_overrides=(f"train_data={fixed}",))
    assert f"train_data: {fixed}" in (run / "config.yaml").read_text()
    assert [r["step"] for r in _steps(run)] == [1, 2, 3, 4]

    other = train(_cfg(small_model, data, tmp_path / "other", max_steps=4, save_every=2),
                  on_step=lambda s, r, m: (r / "STOP").touch() if s == 2 else None)
    fewer = data.parent / "fewer.jsonl"
    fewer.write_text("".join(json.dumps(r) + "\n" for r in records[:-1]))
    from groundtune.errors import DataError

    with pytest.raises(DataError, match="holds 15 usable records .* not the 16 the run started with"):
        train(resume=other, resume_overrides=(f"train_data={fewer}",))
    assert not RunFolder(other).lock.exists()
