"""Training on several ranks (train/distributed.py, train/parallel.py): `torchrun --nproc-per-node 2
-m groundtune train` on the CPU (gloo), the real launcher in a subprocess, with each engine of the
``distributed`` setting: DDP, FSDP2, and DeepSpeed ZeRO-2/3 (DeepSpeed runs on CPUs over gloo too).

Two ranks of batch B train exactly as one process of batch 2B (fp32), and write the same checkpoints
(whole tensors, the one-process form, whatever the engine sharded); a sharded run stopped and
resumed equals one never stopped; accelerate's launcher starts the ranks too; a box head trains on
two ranks as in one process. (test_distributed_stops.py: a rank killed, SIGTERM, NaN, resuming on
one process; test_distributed_rl.py: RL; tests/ranks.py: what they share.)

Each launch costs two interpreters importing torch (~10 s of a 2-core machine), so one launch per
engine checks everything that engine must show (a sharded engine's run is stopped and resumed on
the way), and the reference is one process (a module fixture) rather than more launches."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from ranks import ENGINES, MARKS, SETTINGS, checkpoint, finish, logged, make_data, stop_after, train
from safetensors.torch import load_file

from groundtune.data import synth

pytestmark = MARKS


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory)


# the small random model writes junk to the token limit: 8 tokens an answer are enough to compare
EVAL = ("max_steps=4", "save_every=2", "eval_every=2", "eval_samples=11", "eval_batch_size=4",
        "eval_max_new_tokens=8")


@pytest.fixture(scope="module")
def one_process(data, small_model, tmp_path_factory):
    """The reference: one process of batch 4 (no launcher), evaluated on 11 samples every 2 steps."""
    run = tmp_path_factory.mktemp("one") / "run"
    finish(train(data, run, 0, "batch_size=4", f"eval_data={data}", *EVAL, model=small_model))
    return run


def answers(run: Path, step: int) -> list[str]:
    """The answers of the eval at ``step``, one a sample, as rank 0 scored them."""
    return [json.loads(line)["raw"] for line in (run / "eval" / f"step-{step:06d}.samples.jsonl").open()]


@pytest.mark.parametrize("engine", ENGINES)
def test_two_ranks_train_as_one_process_with_their_batches_together(engine, data, small_model, one_process,
                                                                     tmp_path):
    """DDP runs through; a sharded engine's run is stopped after its second step and resumed (its
    checkpoint gathered whole, then put back in each rank's shards, DeepSpeed's included). Either
    way the losses, evals and checkpoints are one uninterrupted process's with the global batch."""
    two = tmp_path / "two"
    process = train(data, two, 2, "batch_size=2", f"eval_data={data}", f"distributed={engine}", *EVAL,
                    model=small_model)
    watcher = stop_after(two, 2, process, lambda: (two / "STOP").touch()) if engine != "ddp" else None
    output = finish(process)
    assert output.count("run folder:") == 1 and "on 2 ranks (batch 2 each)" in output
    # written once, whole: the checkpoint is what one process writes (step 2's, before a resume's
    # checkpoints replace it: keep_last=2)
    weights, optimizer = checkpoint(two, 2)
    want_weights, want_optimizer = checkpoint(one_process, 2)
    assert weights.keys() == want_weights.keys()
    assert all(torch.allclose(weights[k], want_weights[k], atol=1e-6) for k in weights)
    assert optimizer["state"].keys() == want_optimizer["state"].keys()
    for index, state in want_optimizer["state"].items():
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(optimizer["state"][index][moment], state[moment], atol=1e-7), (index, moment)
    if watcher is not None:
        watcher.join()
        assert len(logged(two, "loss")) < 4
        finish(train(data, two, 2, resume=True))
    assert logged(two, "loss") == pytest.approx(logged(one_process, "loss"), rel=1e-5)
    # eval: the two ranks answer 6 and 5 of the 11 samples, rank 0 scores them all: one process's
    # answers (the random model's are all alike, its mIoU 0: test_distributed_rl.py checks that each
    # answer is scored with its own sample, with a trained model)
    assert logged(two, "step")[-1] == 4 and len(logged(two, "eval/miou")) == 2
    assert logged(two, "eval/miou") == pytest.approx(logged(one_process, "eval/miou"), abs=1e-6)
    for step in (2, 4):
        assert answers(two, step) == answers(one_process, step) and len(answers(two, step)) == 11
    assert logged(two, "samples") == [4, 8, 12, 16]  # both ranks' samples counted
    model = load_file(two / "model" / "adapter_model.safetensors")
    assert model.keys() == load_file(one_process / "model" / "adapter_model.safetensors").keys()


def test_accelerate_launch_starts_the_ranks_and_a_launcher_for_another_engine_is_named(data, small_model, tmp_path):
    accelerate = shutil.which("accelerate")
    if accelerate is None:
        pytest.skip("accelerate's launcher is not on PATH")
    config = Path(__file__).resolve().parents[1] / "configs" / "accelerate" / "multi-gpu.yaml"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["-m", "groundtune", "train", "quickstart", f"model={small_model}", f"train_data={data}", *SETTINGS,
            "max_steps=2", "batch_size=2"]
    done = subprocess.run([accelerate, "launch", "--config_file", str(config), *args, f"out_dir={tmp_path / 'a'}"],
                          check=False, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "on 2 ranks (batch 2 each)" in done.stdout and len(logged(tmp_path / "a", "loss")) == 2
    # accelerate's own DeepSpeed config would be ignored: refused, naming the setting to use instead
    done = subprocess.run([accelerate, "launch", "--config_file", str(config), *args, f"out_dir={tmp_path / 'b'}"],
                          check=False, capture_output=True, text=True, timeout=300,
                          env={**env, "ACCELERATE_USE_DEEPSPEED": "true"})
    assert done.returncode != 0 and "the engine is the run's setting (distributed=zero2|zero3)" in done.stderr


def test_a_box_head_trains_on_two_ranks_as_one_process(small_model, tmp_path):
    """head=box under DDP: the head's loss is summed over the global batch's samples, and its
    weights (trainable, in the checkpoint and in model/) come out as one process's."""
    # 168-px images: 6x6 cells. On the 112-px set's 4x4 every cell centre gives cos(8 pi x) = -1,
    # a feature the same for all of an image's tokens, which the head's softmax cannot use: its
    # weights' gradient is rounding noise, which Adam turns into steps that differ between runs.
    synth.make_synthetic_set(tmp_path / "data", n=16, seed=2, width=168, height=168, workers=1)
    data = tmp_path / "data" / "train.jsonl"
    settings = ("head=box", "max_steps=3", "save_every=3")
    one, two = tmp_path / "one", tmp_path / "two"
    finish(train(data, one, 0, "batch_size=4", *settings, model=small_model))
    finish(train(data, two, 2, "batch_size=2", "distributed=ddp", *settings, model=small_model))
    assert logged(two, "loss") == pytest.approx(logged(one, "loss"), rel=1e-5)
    weights, _ = checkpoint(two, 3)
    want, _ = checkpoint(one, 3)
    assert any("box_head" in k for k in want) and weights.keys() == want.keys()
    assert all(torch.allclose(weights[k], want[k], atol=1e-6) for k in want)
    saved = load_file(two / "model" / "box_head.safetensors")
    want_head = load_file(one / "model" / "box_head.safetensors")
    assert all(torch.allclose(saved[k], v, atol=1e-6) for k, v in want_head.items())
