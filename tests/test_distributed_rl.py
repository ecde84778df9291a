"""RL on two ranks (`torchrun --nproc-per-node 2 -m groundtune rl`, CPU, gloo) under every engine,
from one SFT run: each rank samples its own groups, and the KL term's frozen reference (the SFT
adapter) is sharded and gathered with the rest, so every engine's update equals DDP's; the ranks'
eval answers are scored each with its own sample. Real torchrun processes (tests/ranks.py); the
SFT run and the DDP run are module fixtures."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from ranks import ENGINES, MARKS, checkpoint, finish, launch, logged, train
from safetensors.torch import load_file

from groundtune.data import synth

pytestmark = MARKS


@pytest.fixture(scope="module")
def rl_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("rl_data")
    synth.make_synthetic_set(out, n=16, seed=1, width=168, height=168, workers=1)
    return out / "train.jsonl"


@pytest.fixture(scope="module")
def sft_run(rl_data, tmp_path_factory):
    """A short LoRA SFT run (one process): RL starts from it and keeps its adapter as the reference."""
    run = tmp_path_factory.mktemp("sft") / "run"
    # trained weights: a random model's answers never parse, so every answer of a group earns the same
    # reward, GRPO's advantages are all 0 and the policy never moves (kl stays 0, engines agree trivially)
    finish(train(rl_data, run, 0, "max_steps=2", "batch_size=4", "save_every=0", model="tiny"))
    return run


@pytest.fixture(scope="module")
def sft_answers(sft_run, rl_data) -> list[str]:
    """The SFT model's greedy answers to the RL runs' 3 eval samples, from one process."""
    from groundtune import infer
    from groundtune.config import MAX_NEW_TOKENS  # eval_max_new_tokens' default

    samples = [json.loads(line) for line in rl_data.read_text().splitlines()[:3]]
    return [p.raw for p in infer.predict_records(infer.load(str(sft_run), device="cpu"), samples, rl_data, 3,
                                                 MAX_NEW_TOKENS)]


def _rl(engine: str, sft_run: Path, data: Path, run: Path, sft_answers: list[str]) -> tuple[list, list, list]:
    """RL from ``sft_run`` on two ranks of ``engine``, checked for what every engine must show;
    returns its (losses, KL terms, evals' mIoU)."""
    output = finish(launch("rl", 2, ["quickstart-rl", f"model={sft_run}", f"train_data={data}",
                                       f"eval_data={data}", f"out_dir={run}", "device=cpu", "max_steps=2",
                                       "batch_size=2", "group_size=3", "max_new_tokens=24", "eval_samples=3",
                                       "eval_every=0", "save_every=1", "log_every=1", f"distributed={engine}",
                                       "kl_coef=0.1"]))
    assert "answers per step on each of 2 ranks" in output and output.count("run folder:") == 1
    assert logged(run, "samples") == [4, 8]  # 2 prompts on each of 2 ranks per step
    # every rank's groups are in the logs: 2 ranks x 2 prompts x 3 answers
    assert [sum(h) for h in logged(run, "rollout/iou_histogram")] == [12, 12]
    assert all(math.isfinite(v) for v in logged(run, "loss"))
    assert len(logged(run, "eval/miou")) == 2  # before the first step and at the end
    # before the first step: the ranks answer 2 and 1 of the 3 samples, rank 0 scores them all, each
    # answer with its own sample (a trained model's answers tell the samples apart; tests in
    # test_distributed.py train a random one, whose answers are all alike)
    rows = map(json.loads, (run / "eval" / "step-000000.samples.jsonl").read_text().splitlines())
    assert [r["raw"] for r in rows] == sft_answers
    assert (run / "model" / "adapter_model.safetensors").is_file()
    weights, _ = checkpoint(run, 2)
    assert weights and all(".default." in k for k in weights)  # the trained adapter, whole
    assert not any(".reference." in k for k in load_file(run / "model" / "adapter_model.safetensors"))
    return logged(run, "loss"), logged(run, "kl"), logged(run, "eval/miou")


@pytest.fixture(scope="module")
def rl_under_ddp(sft_run, rl_data, sft_answers, tmp_path_factory):
    return _rl("ddp", sft_run, rl_data, tmp_path_factory.mktemp("rl_ddp") / "run", sft_answers)


@pytest.mark.parametrize("engine", ENGINES)
def test_rl_on_two_ranks_samples_each_ranks_groups_and_keeps_its_frozen_reference(engine, sft_run, rl_data,
                                                                                  sft_answers, rl_under_ddp, tmp_path):
    """Each rank samples its own groups. The KL term's reference is a frozen copy of the SFT run's
    adapter (rl.py): under a sharded engine it is sharded and gathered with the rest, and the
    update, and the evals of the weights gathered whole, are the same as under DDP."""
    losses, kl, miou = rl_under_ddp if engine == "ddp" else _rl(engine, sft_run, rl_data, tmp_path / "rl",
                                                                 sft_answers)
    assert kl[-1] > 0  # the policy moved away from its reference
    assert (losses, kl) == (pytest.approx(rl_under_ddp[0], abs=1e-7), pytest.approx(rl_under_ddp[1], abs=1e-7))
    assert miou == pytest.approx(rl_under_ddp[2], abs=1e-6)


