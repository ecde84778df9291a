"""Training on several ranks (train/distributed.py, train/parallel.py): `torchrun --nproc-per-node 2
-m groundtune train|rl` on the CPU (gloo), the real launcher in a subprocess, with each engine of the
``distributed`` setting: DDP, FSDP2, and DeepSpeed ZeRO-2/3 (DeepSpeed runs on CPUs over gloo too).

Two ranks of batch B train exactly as one process of batch 2B (fp32), and write the same checkpoints
(whole tensors, the one-process form, whatever the engine sharded); a run whose rank is killed ends
with a clear message and, resumed, equals one never stopped; a sharded run stopped and resumed
equals one never stopped, and resumes on one process too; RL runs on two ranks, each sampling its
own groups; a box head trains on two ranks as in one process."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
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
pytestmark = [pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not on PATH"), pytest.mark.slow]
SETTINGS = ["eval_data=", "lr=5e-3", "method=lora", "device=cpu", "log_every=1", "num_workers=0"]
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
ENGINES = ["ddp", "fsdp2",
           *(pytest.param(k, marks=pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed"))
             for k in ("zero2", "zero3"))]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_data")
    synth.make_synthetic_set(out, n=64, seed=0, task="single", workers=1)
    return out / "train.jsonl"


def _launch(command: str, ranks: int, args: list[str]) -> subprocess.Popen:
    launch = [TORCHRUN, "--nproc-per-node", str(ranks), "-m"] if ranks else [sys.executable, "-m"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([*launch, "groundtune", command, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _train(data: Path, out: Path, ranks: int, *settings: str, resume: bool = False) -> subprocess.Popen:
    """``ranks`` processes under torchrun (0: one plain process, no launcher)."""
    args = ["--resume", str(out)] if resume else ["quickstart", f"train_data={data}", f"out_dir={out}", *SETTINGS,
                                                   *settings]  # (a later eval_data= wins over SETTINGS')
    return _launch("train", ranks, args)


def _finish(process: subprocess.Popen) -> str:
    output = process.communicate(timeout=300)[0]
    assert process.returncode == 0, output
    return output


def _logged(run: Path, key: str) -> list:
    return [r[key] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if key in r]


def _checkpoint(run: Path, step: int) -> tuple[dict, dict]:
    folder = run / "checkpoints" / f"step-{step:06d}"
    return (load_file(folder / "trainable.safetensors"),
            torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=False))


EVAL = ("max_steps=4", "save_every=2", "eval_every=2", "eval_samples=11", "eval_batch_size=4")


@pytest.fixture(scope="module")
def one_process(data, tmp_path_factory):
    """The reference: one process of batch 4 (no launcher), evaluated on 11 samples every 2 steps."""
    run = tmp_path_factory.mktemp("one") / "run"
    _finish(_train(data, run, 0, "batch_size=4", f"eval_data={data}", *EVAL))
    return run


@pytest.mark.parametrize("engine", ENGINES)
def test_two_ranks_train_as_one_process_with_their_batches_together(engine, data, one_process, tmp_path):
    two = tmp_path / "two"
    output = _finish(_train(data, two, 2, "batch_size=2", f"eval_data={data}", f"distributed={engine}", *EVAL))
    assert _logged(two, "loss") == pytest.approx(_logged(one_process, "loss"), rel=1e-5)
    # eval: the two ranks answer 6 and 5 of the 11 samples, rank 0 scores them all
    assert _logged(two, "step")[-1] == 4 and len(_logged(two, "eval/miou")) == 2
    assert _logged(two, "eval/miou") == pytest.approx(_logged(one_process, "eval/miou"), abs=1e-6)
    assert _logged(two, "samples") == [4, 8, 12, 16]  # both ranks' samples counted
    assert output.count("run folder:") == 1 and "on 2 ranks (batch 2 each)" in output
    # written once, whole: the checkpoint and the model are what one process writes
    weights, optimizer = _checkpoint(two, 2)
    want_weights, want_optimizer = _checkpoint(one_process, 2)
    assert weights.keys() == want_weights.keys()
    assert all(torch.allclose(weights[k], want_weights[k], atol=1e-6) for k in weights)
    assert optimizer["state"].keys() == want_optimizer["state"].keys()
    for index, state in want_optimizer["state"].items():
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(optimizer["state"][index][moment], state[moment], atol=1e-7), (index, moment)
    model = load_file(two / "model" / "adapter_model.safetensors")
    assert model.keys() == load_file(one_process / "model" / "adapter_model.safetensors").keys()


def _stop_after(run: Path, steps: int, process: subprocess.Popen, act) -> threading.Thread:
    """``act()`` once ``run`` has logged ``steps`` steps (as a user would, watching it)."""
    def watch() -> None:
        while process.poll() is None:
            if (run / "metrics.jsonl").exists() and len(_logged(run, "loss")) >= steps:
                act()
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    return watcher


def _ranks_of(launcher: int) -> list[int]:
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


@pytest.fixture(scope="module")
def whole(data, tmp_path_factory):
    """Two ranks of batch 2 for 6 steps, never stopped."""
    run = tmp_path_factory.mktemp("whole") / "run"
    _finish(_train(data, run, 2, "max_steps=6", "batch_size=2", "save_every=1"))
    return run


def test_a_killed_rank_ends_the_run_clearly_and_the_resumed_run_equals_an_uninterrupted_one(data, whole, tmp_path):
    killed = tmp_path / "killed"
    process = _train(data, killed, 2, "max_steps=6", "batch_size=2", "save_every=1")

    def kill_rank_1() -> None:
        os.kill(_ranks_of(process.pid)[1], signal.SIGKILL)

    watcher = _stop_after(killed, 2, process, kill_rank_1)
    started = time.time()
    output = process.communicate(timeout=300)[0]
    watcher.join()
    assert process.returncode != 0 and time.time() - started < 120  # no hang
    assert "rank 0: another rank of this run stopped" in output, output
    assert f"groundtune train --resume {killed}" in output
    assert len(_logged(killed, "loss")) < 6
    _finish(_train(data, killed, 2, resume=True))
    assert _logged(killed, "loss") == pytest.approx(_logged(whole, "loss"), rel=1e-5)


@pytest.mark.parametrize("engine", ENGINES[1:])
def test_a_sharded_run_stopped_and_resumed_trains_as_one_process(engine, data, one_process, tmp_path):
    """Its checkpoint gathered whole, then put back in each rank's shards (DeepSpeed's included):
    the resumed run's losses are those of one uninterrupted process with the global batch."""
    run = tmp_path / "run"
    process = _train(data, run, 2, "max_steps=4", "batch_size=2", "save_every=1", f"distributed={engine}")
    watcher = _stop_after(run, 2, process, lambda: (run / "STOP").touch())
    _finish(process)
    watcher.join()
    assert len(_logged(run, "loss")) < 4
    _finish(_train(data, run, 2, resume=True))
    assert _logged(run, "loss") == pytest.approx(_logged(one_process, "loss"), rel=1e-5)


def test_sigterm_to_the_process_group_stops_every_rank_at_one_step_and_the_run_resumes(data, whole, tmp_path):
    """As a cluster scheduler preempts a job: SIGTERM to the launcher and its ranks at once. Every
    rank finishes its step, rank 0 saves, the ranks exit 0 (torchrun itself reports the signal)."""
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["quickstart", f"train_data={data}", f"out_dir={run}", *SETTINGS, "max_steps=6", "batch_size=2",
            "save_every=0"]
    process = subprocess.Popen([TORCHRUN, "--nproc-per-node", "2", "-m", "groundtune", "train", *args], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    watcher = _stop_after(run, 2, process, lambda: os.killpg(process.pid, signal.SIGTERM))
    output = process.communicate(timeout=300)[0]
    watcher.join()
    stopped = len(_logged(run, "loss"))
    assert f"stopping at step {stopped} (SIGTERM)" in output and output.count("stopping at step") == 1, output
    assert "exitcode" not in output  # no rank failed: only the launcher reports the signal
    assert [p.name for p in (run / "checkpoints").iterdir()] == [f"step-{stopped:06d}"]  # save_every=0: the stop's
    _finish(_train(data, run, 2, resume=True))
    assert _logged(run, "loss") == pytest.approx(_logged(whole, "loss"), rel=1e-5)


def test_a_sharded_run_resumes_on_one_process(data, tmp_path):
    run = tmp_path / "fsdp2"
    process = _train(data, run, 2, "max_steps=4", "batch_size=2", "save_every=1", "distributed=fsdp2")
    watcher = _stop_after(run, 2, process, lambda: (run / "STOP").touch())
    output = _finish(process)
    watcher.join()
    assert output.count("stopping at step") == 1  # said once, by rank 0
    assert f"resume with: torchrun --nproc-per-node 2 -m groundtune train --resume {run}" in output
    stopped_at = len(_logged(run, "loss"))
    weights, _ = _checkpoint(run, stopped_at)
    output = _finish(_train(data, run, 0, resume=True))  # no launcher: one process
    assert f"resumed from {run / 'checkpoints' / f'step-{stopped_at:06d}'} at step {stopped_at}" in output
    assert _logged(run, "step")[-1] == 4 and (run / "model").is_dir()
    assert all(torch.isfinite(t).all() for t in weights.values())


@pytest.mark.parametrize("engine", ENGINES)
def test_rl_on_two_ranks_samples_each_ranks_groups(engine, tmp_path):
    out = tmp_path / "data"
    synth.make_synthetic_set(out, n=16, seed=1, width=168, height=168, workers=1)
    run = tmp_path / "rl"
    process = _launch("rl", 2, ["quickstart-rl", "model=tiny", f"train_data={out / 'train.jsonl'}",
                                f"eval_data={out / 'train.jsonl'}", f"out_dir={run}", "device=cpu", "max_steps=2",
                                "batch_size=2", "group_size=3", "max_new_tokens=24", "eval_samples=3",
                                "eval_every=0", "save_every=1", "log_every=1", f"distributed={engine}",
                                "kl_coef=0.1"])
    output = _finish(process)
    assert "answers per step on each of 2 ranks" in output and output.count("run folder:") == 1
    assert _logged(run, "samples") == [4, 8]  # 2 prompts on each of 2 ranks per step
    # every rank's groups are in the logs: 2 ranks x 2 prompts x 3 answers
    assert [sum(h) for h in _logged(run, "rollout/iou_histogram")] == [12, 12]
    assert all(map(lambda v: v == v, _logged(run, "loss")))  # finite
    assert len(_logged(run, "eval/miou")) == 2  # before the first step and at the end
    assert (run / "model" / "adapter_model.safetensors").is_file()
    weights, _ = _checkpoint(run, 2)
    assert weights and all(".default." in k for k in weights)  # the trained adapter, whole


@pytest.mark.parametrize("engine", ["fsdp2", *ENGINES[3:]])
def test_rl_from_an_sft_run_on_sharded_ranks_keeps_its_frozen_reference(engine, tmp_path):
    """The KL term's reference is a frozen copy of the SFT run's adapter (rl.py): under a sharded
    engine it is sharded and gathered with the rest; the update is the same as under DDP."""
    out = tmp_path / "data"
    synth.make_synthetic_set(out, n=16, seed=1, width=168, height=168, workers=1)
    sft = tmp_path / "sft"
    _finish(_train(out / "train.jsonl", sft, 0, "max_steps=2", "batch_size=4", "save_every=0"))
    logged = {}
    for kind in ("ddp", engine):
        run = tmp_path / kind
        _finish(_launch("rl", 2, ["quickstart-rl", f"model={sft}", f"train_data={out / 'train.jsonl'}", "eval_data=",
                                  f"out_dir={run}", "device=cpu", "max_steps=2", "batch_size=2", "group_size=3",
                                  "max_new_tokens=24", "save_every=0", "log_every=1", f"distributed={kind}",
                                  "kl_coef=0.1"]))
        logged[kind] = (_logged(run, "loss"), _logged(run, "kl"))
        assert not any(".reference." in k for k in load_file(run / "model" / "adapter_model.safetensors"))
    assert logged[engine][1][-1] > 0  # the policy moved away from its reference
    assert logged[engine] == (pytest.approx(logged["ddp"][0], abs=1e-7), pytest.approx(logged["ddp"][1], abs=1e-7))


def test_accelerate_launch_starts_the_ranks_and_a_launcher_for_another_engine_is_named(data, tmp_path):
    accelerate = shutil.which("accelerate")
    if accelerate is None:
        pytest.skip("accelerate's launcher is not on PATH")
    config = Path(__file__).resolve().parents[1] / "configs" / "accelerate" / "multi-gpu.yaml"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["-m", "groundtune", "train", "quickstart", f"train_data={data}", *SETTINGS, "max_steps=2", "batch_size=2"]
    done = subprocess.run([accelerate, "launch", "--config_file", str(config), *args, f"out_dir={tmp_path / 'a'}"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "on 2 ranks (batch 2 each)" in done.stdout and len(_logged(tmp_path / "a", "loss")) == 2
    # accelerate's own DeepSpeed config would be ignored: refused, naming the setting to use instead
    done = subprocess.run([accelerate, "launch", "--config_file", str(config), *args, f"out_dir={tmp_path / 'b'}"],
                          capture_output=True, text=True, timeout=300,
                          env={**env, "ACCELERATE_USE_DEEPSPEED": "true"})
    assert done.returncode != 0 and "the engine is the run's setting (distributed=zero2|zero3)" in done.stderr


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


def test_a_nan_on_one_rank_skips_the_step_on_every_rank(data, tmp_path):
    driver = tmp_path / "poison.py"
    driver.write_text(POISON)
    run = tmp_path / "run"
    done = subprocess.run([TORCHRUN, "--nproc-per-node", "2", str(driver), f"train_data={data}", f"out_dir={run}",
                           *SETTINGS, "max_steps=6", "batch_size=2", "save_every=0", "max_bad_steps=2"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    output = done.stdout + done.stderr
    assert done.returncode != 0
    # both ranks gave up together, after the same two skipped steps (rank 0's own losses were finite)
    assert output.count("2 non-finite losses/gradients in a row at step 2") == 2, output
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["bad_steps"] for r in rows if "skipped_nonfinite" in r] == [1, 2]
    # the checkpoint written on giving up holds step 2's weights: no NaN reached rank 0's update
    weights, _ = _checkpoint(run, 2)
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_a_box_head_trains_on_two_ranks_as_one_process(tmp_path):
    """head=box under DDP: the head's loss is summed over the global batch's samples, and its
    weights (trainable, in the checkpoint and in model/) come out as one process's."""
    # 168-px images: 6x6 cells. On the 112-px set's 4x4 every cell centre gives cos(8 pi x) = -1,
    # a feature the same for all of an image's tokens, which the head's softmax cannot use: its
    # weights' gradient is rounding noise, which Adam turns into steps that differ between runs.
    synth.make_synthetic_set(tmp_path / "data", n=16, seed=2, width=168, height=168, workers=1)
    data = tmp_path / "data" / "train.jsonl"
    settings = ("head=box", "max_steps=3", "save_every=3")
    one, two = tmp_path / "one", tmp_path / "two"
    _finish(_train(data, one, 0, "batch_size=4", *settings))
    _finish(_train(data, two, 2, "batch_size=2", "distributed=ddp", *settings))
    assert _logged(two, "loss") == pytest.approx(_logged(one, "loss"), rel=1e-5)
    weights, _ = _checkpoint(two, 3)
    want, _ = _checkpoint(one, 3)
    assert any("box_head" in k for k in want) and weights.keys() == want.keys()
    assert all(torch.allclose(weights[k], want[k], atol=1e-6) for k in want)
    saved = load_file(two / "model" / "box_head.safetensors")
    want_head = load_file(one / "model" / "box_head.safetensors")
    assert all(torch.allclose(saved[k], v, atol=1e-6) for k, v in want_head.items())
