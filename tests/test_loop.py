"""What every training loop does around its updates (train/loop.py, checkpoint.py, monitor.py):
the learning-rate schedule, keeping the best evaluated model, pruning and atomic checkpoints, and
the thermal pause."""

import functools
import json
import math
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from groundtune.config import TrainConfig
from groundtune.models import adapt
from groundtune.models.loading import load_model
from groundtune.runs import RunFolder
from groundtune.train import checkpoint as ckpt
from groundtune.train.loop import lr_lambda
from groundtune.train.monitor import MetricsLog, thermal_pause
from groundtune.train.sft import train


def _cfg(data, out, model, **kw):
    base = {"model": model, "train_data": str(data / "train.jsonl"), "out_dir": str(out), "method": "full",
            "freeze_vision": False, "freeze_merger": False, "lr": 1e-3, "batch_size": 2, "max_steps": 4,
            "log_every": 1, "save_every": 0, "warmup_steps": 0,
            "device": "cpu"}  # fp32: weights compare exactly on any machine
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture
def cfg(small_model):
    """_cfg on the small random model."""
    return functools.partial(_cfg, model=small_model)


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# --------------------------------------------------------------------------------------------
# the learning-rate schedule


def _factors(**kw):
    factor = lr_lambda(TrainConfig(train_data="x", **kw))
    return lambda step: pytest.approx(factor(step), abs=1e-12)


def test_lr_warms_up_linearly_then_decays_along_a_cosine_to_its_floor():
    # warmup 4, decay over steps 4..10 (6 steps) to 0.1: cos(pi/3) = 0.5, cos(2pi/3) = -0.5
    f = _factors(warmup_steps=4, max_steps=10, min_lr_ratio=0.1)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]  # (step + 1) / warmup
    assert f(4) == 1.0  # the peak, where the cosine starts
    assert f(6) == 0.1 + 0.9 * 0.75  # progress 1/3: cosine factor (1 + 0.5) / 2
    assert f(7) == 0.55  # half way: half way between 1 and 0.1
    assert f(8) == 0.1 + 0.9 * 0.25  # progress 2/3: (1 - 0.5) / 2
    assert f(10) == 0.1  # the floor at max_steps
    assert f(11) == 0.1 and f(1000) == 0.1  # and flat after it


def test_lr_without_warmup_starts_at_the_peak():
    f = _factors(warmup_steps=0, max_steps=4, min_lr_ratio=0.0)
    assert f(0) == 1.0
    assert f(1) == (1 + math.cos(math.pi / 4)) / 2
    assert f(2) == 0.5 and f(4) == 0.0 and f(9) == 0.0


def test_lr_with_min_ratio_one_is_constant_after_warmup():
    f = _factors(warmup_steps=2, max_steps=6, min_lr_ratio=1.0)
    assert [f(s) for s in range(9)] == [0.5] + [1.0] * 8


def test_the_scheduler_gives_each_part_its_own_peak_times_the_factor(small_model):
    """Through a real LambdaLR over ``param_groups``: every group follows the same factor, each
    from its own peak (lr_merger here), as the training loop builds it."""
    cfg = TrainConfig(train_data="x", method="full", freeze_merger=False, lr=1e-3, lr_merger=4e-3,
                      warmup_steps=2, max_steps=5, min_lr_ratio=0.0)
    model = adapt.prepare_for_training(load_model(small_model).model, cfg)
    optimizer = torch.optim.AdamW(adapt.param_groups(model, cfg))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    expected = [0.5, 1.0, 1.0, 0.75, 0.25, 0.0, 0.0]  # warmup 1/2, 2/2, then (1 + cos(pi k/3)) / 2, then flat
    for factor in expected:
        lrs = {}
        for group in optimizer.param_groups:  # a part's decay and no-decay groups
            lrs.setdefault(group["part"], []).append(group["lr"])
        assert sorted(lrs) == ["llm", "merger"]
        assert lrs["merger"] == pytest.approx([4e-3 * factor] * len(lrs["merger"]), abs=1e-15)
        assert lrs["llm"] == pytest.approx([1e-3 * factor] * len(lrs["llm"]), abs=1e-15)
        optimizer.step()
        scheduler.step()


# --------------------------------------------------------------------------------------------
# the run's model: the best evaluated one, else the last


def _norm(model):
    """The LLM's final RMSNorm gain: zeroing it makes every logit 0, so greedy answers are
    garbage (no box: Acc@0.5 = 0) while losses and gradients stay finite."""
    return next(p for n, p in model.named_parameters() if n.endswith("language_model.norm.weight"))


def _weights(model):
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def test_the_model_is_the_best_evaluated_one_else_the_last(synth_single, tmp_path):
    # trained weights: the healthy tiny model's answers score (Acc@0.5 > 0), a random model's never do.
    # Only the merger trains, at a negligible lr: what the evals see is what the hook sets.
    quiet = {"freeze_vision": True, "freeze_merger": False, "freeze_llm": True, "lr": 1e-6}

    # 1. no eval_data: the model is the last step's (here: poisoned by the last hook call)
    last = {}

    def poison_at_2(step, run, model):
        if step == 2:
            with torch.no_grad():
                _norm(model).zero_()
            last.update(_weights(model))

    poisoned = train(_cfg(synth_single, tmp_path / "poisoned", "tiny", max_steps=2, **quiet), on_step=poison_at_2)
    assert json.loads((poisoned / "model" / "groundtune.json").read_text())["step"] == 2
    saved = load_model(str(poisoned), device="cpu").model.state_dict()
    assert saved.keys() == last.keys() and all(torch.equal(saved[k], last[k]) for k in saved)
    assert torch.count_nonzero(saved["model.language_model.norm.weight"]) == 0

    # 2. from that poisoned model, with an eval after every step: evals see poisoned (step 1),
    # healthy (2), poisoned (3), healthy (4). The best is step 2: step 4 at most ties it.
    healthy_norm = _norm(load_model("tiny", device="cpu").model).detach().clone()
    seen = {}

    def alternate(step, run, model):  # runs after the eval of `step`: sets what step + 1 sees
        seen[step] = _weights(model)  # what the eval of `step` saw
        with torch.no_grad():
            if step in (1, 3):
                _norm(model).copy_(healthy_norm)
            else:
                _norm(model).zero_()

    run = train(_cfg(synth_single, tmp_path / "best", model=str(poisoned), eval_data=str(synth_single / "val.jsonl"),
                     eval_every=1, eval_samples=6, eval_batch_size=6, eval_max_new_tokens=40, **quiet),
                on_step=alternate)
    evals = {r["step"]: r for r in _records(run) if "eval/acc@0.5" in r}
    assert sorted(evals) == [1, 2, 3, 4]
    acc = {step: r["eval/acc@0.5"] for step, r in evals.items()}
    assert acc[1] == acc[3] == 0.0 and acc[2] > 0 and acc[4] > 0  # the control worked
    best_step = max(sorted(acc), key=lambda s: acc[s])  # the first of the best
    assert best_step == 2
    meta = json.loads((run / "model" / "groundtune.json").read_text())
    assert meta["step"] == best_step
    for key in ("acc@0.5", "acc@0.75", "miou", "parse_fail_rate"):
        assert meta["eval"][key] == evals[best_step][f"eval/{key}"]
    assert meta["eval"]["n"] == 6
    best = load_model(str(run), device="cpu").model.state_dict()  # the weights step 2's eval saw, not the last ones
    assert best.keys() == seen[2].keys() and all(torch.equal(best[k], seen[2][k]) for k in best)
    assert not all(torch.equal(seen[4][k], seen[2][k]) for k in best)  # (the merger trained on)


def test_on_an_eval_set_of_no_target_phrases_the_best_is_kept_by_set_acc(synth_single, tmp_path, monkeypatch, cfg):
    """Acc@0.5 and mIoU count no sample of a set whose phrases all name nothing: they are logged as
    null, never compared; the best model is kept by set_acc@0.5, and the log and the model say so."""
    from groundtune import infer

    val = [json.loads(line) for line in (synth_single / "val.jsonl").read_text().splitlines()][:4]
    none = tmp_path / "none.jsonl"
    none.write_text("".join(json.dumps({**{k: v for k, v in r.items() if k != "bbox"}, "bboxes": [],
                                        "image": str(synth_single / r["image"])}) + "\n" for r in val))
    # what the model answers at each eval: a box everywhere (set_acc 0), [] everywhere (1), half and half
    box = infer.Prediction(bbox=[1.0, 1.0, 9.0, 9.0], boxes=[[1.0, 1.0, 9.0, 9.0]], label=None, raw="box", error=None)
    empty = infer.Prediction(bbox=None, boxes=[], label=None, raw="[]", error=None, no_target=True)
    answers = iter([[box] * 4, [empty] * 4, [empty, box] * 2])
    monkeypatch.setattr(infer, "predict_records", lambda gm, samples, *args, **kwargs: next(answers)[: len(samples)])
    run = train(cfg(synth_single, tmp_path / "run", max_steps=3, eval_data=str(none), eval_every=1, eval_samples=4,
                     freeze_vision=True, freeze_merger=False, freeze_llm=True, lr=1e-6))
    evals = {r["step"]: r for r in _records(run) if "eval/best_by" in r}
    assert sorted(evals) == [1, 2, 3]
    assert all(r["eval/acc@0.5"] is None and r["eval/miou"] is None for r in evals.values())
    assert {r["eval/best_by"] for r in evals.values()} == {"set_acc@0.5"}
    assert [evals[s]["eval/set_acc@0.5"] for s in (1, 2, 3)] == [0.0, 1.0, 0.5]
    meta = json.loads((run / "model" / "groundtune.json").read_text())
    assert meta["step"] == 2 and meta["eval"]["best_by"] == "set_acc@0.5" and meta["eval"]["acc@0.5"] is None
    assert meta["eval"]["n_acc"] == 1.0


def test_on_an_eval_set_of_sets_the_best_is_kept_by_f1(synth_single, tmp_path, monkeypatch, cfg):
    """On phrases naming several objects, Acc@0.5 reads the first box alone: an answer that finds the
    first and misses the rest scores as one that finds all. The best is kept by F1@0.5, which tells
    them apart (kept by Acc@0.5, a run on sets kept its first eval's model: RL's starting one)."""
    from groundtune import infer

    val = [json.loads(line) for line in (synth_single / "val.jsonl").read_text().splitlines()][:4]
    two = [[1.0, 1.0, 9.0, 9.0], [20.0, 20.0, 30.0, 30.0]]
    sets = tmp_path / "sets.jsonl"
    sets.write_text("".join(json.dumps({**{k: v for k, v in r.items() if k != "bbox"}, "bboxes": two,
                                        "image": str(synth_single / r["image"])}) + "\n" for r in val))
    first = infer.Prediction(bbox=two[0], boxes=two[:1], label=None, raw="first", error=None)
    both = infer.Prediction(bbox=two[0], boxes=two, label=None, raw="both", error=None)
    answers = iter([[first] * 4, [both] * 4, [first] * 4])
    monkeypatch.setattr(infer, "predict_records", lambda gm, samples, *args, **kwargs: next(answers)[: len(samples)])
    run = train(cfg(synth_single, tmp_path / "run", max_steps=3, eval_data=str(sets), eval_every=1, eval_samples=4,
                     freeze_vision=True, freeze_merger=False, freeze_llm=True, lr=1e-6))
    evals = {r["step"]: r for r in _records(run) if "eval/best_by" in r}
    assert [evals[s]["eval/acc@0.5"] for s in (1, 2, 3)] == [1.0, 1.0, 1.0]
    assert [evals[s]["eval/f1@0.5"] for s in (1, 2, 3)] == [pytest.approx(2 / 3), 1.0, pytest.approx(2 / 3)]
    meta = json.loads((run / "model" / "groundtune.json").read_text())
    assert meta["step"] == 2 and meta["eval"]["best_by"] == "f1@0.5"


# --------------------------------------------------------------------------------------------
# checkpoints


def test_keep_last_prunes_to_the_newest_checkpoints(synth_single, tmp_path, cfg):
    run = train(cfg(synth_single, tmp_path / "keep", method="lora", lora_r=4, save_every=1, keep_last=2))
    parent = RunFolder(run).checkpoints
    assert sorted(p.name for p in parent.iterdir()) == ["step-000003", "step-000004"]  # no leftovers either
    assert [json.loads((p / "state.json").read_text())["step"] for p in ckpt.list_checkpoints(run)] == [3, 4]


class _Unsaveable:
    """A value torch.save cannot write: pickling it fails, as a full disk would part-way."""

    def __reduce_ex__(self, protocol):
        raise OSError("no space left on device")


class _BrokenScheduler:
    """A real scheduler whose state holds one value that cannot be written."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def state_dict(self):
        return {**self.scheduler.state_dict(), "broken": _Unsaveable()}


def _lora_setup(model_name):
    cfg = TrainConfig(train_data="x", method="lora", lora_r=4, lr=1e-2, max_steps=10)
    model = adapt.prepare_for_training(load_model(model_name, device="cpu").model, cfg)
    optimizer = torch.optim.AdamW(adapt.param_groups(model, cfg))
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))


def _step(model, optimizer, scheduler):
    loss = sum((p.float() ** 2).sum() + p.sum() for p in model.parameters() if p.requires_grad)
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def test_a_crash_while_writing_a_checkpoint_leaves_the_previous_one_whole(tmp_path, small_model):
    run = tmp_path / "run"
    model, optimizer, scheduler = _lora_setup(small_model)
    _step(model, optimizer, scheduler)
    first = ckpt.save_checkpoint(run, model, optimizer, scheduler, {"step": 1, "samples": 4}, keep_last=2)
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    exp_avg = {k: v["exp_avg"].clone() for k, v in optimizer.state_dict()["state"].items()}
    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    files = {p.name: p.read_bytes() for p in first.iterdir()}

    _step(model, optimizer, scheduler)  # step 2 changes weights, optimizer and schedule
    with pytest.raises(OSError, match="no space left"):  # weights and optimizer written, then the crash
        ckpt.save_checkpoint(run, model, optimizer, _BrokenScheduler(scheduler), {"step": 2, "samples": 8}, 2)

    assert ckpt.list_checkpoints(run) == [first]  # nothing half-written under a real name
    visible = [p.name for p in RunFolder(run).checkpoints.iterdir() if not p.name.startswith(".")]
    assert visible == ["step-000001"]
    assert {p.name: p.read_bytes() for p in first.iterdir()} == files  # byte for byte as written

    # the previous checkpoint restores into a fresh model, optimizer and scheduler
    fresh_model, fresh_optimizer, fresh_scheduler = _lora_setup(small_model)
    torch.rand(3), random.random(), np.random.rand()  # the generators move on
    assert not all(torch.equal(p, weights[n]) for n, p in fresh_model.named_parameters() if n in weights)
    state = ckpt.load_checkpoint(first, fresh_model, fresh_optimizer, fresh_scheduler)
    assert state == {"step": 1, "samples": 4}
    restored = {n: p for n, p in fresh_model.named_parameters() if p.requires_grad}
    assert restored.keys() == weights.keys() and all(torch.equal(restored[n], weights[n]) for n in weights)
    got = fresh_optimizer.state_dict()["state"]
    assert got.keys() == exp_avg.keys() and all(torch.equal(got[k]["exp_avg"], exp_avg[k]) for k in exp_avg)
    assert fresh_scheduler.last_epoch == 1 and fresh_scheduler.get_last_lr() == pytest.approx(
        [1e-2 * lr_lambda(TrainConfig(train_data="x", max_steps=10))(1)] * len(fresh_optimizer.param_groups))
    assert torch.equal(torch.get_rng_state(), rng[0]) and random.getstate() == rng[1]
    assert (np.random.get_state()[1] == rng[2]).all()

    # a write that failed leaves nothing, not even under a hidden name; what a kill -9 leaves behind
    # (a .step-N.tmp) is cleared by the next save of any step (a resumed run may never write that
    # step again): tests/test_reliability.py kills real runs
    assert sorted(p.name for p in RunFolder(run).checkpoints.iterdir()) == ["step-000001"]
    (RunFolder(run).checkpoints / ".step-000002.tmp").mkdir()  # as a kill -9 in the middle would leave it
    second = ckpt.save_checkpoint(run, model, optimizer, scheduler, {"step": 3, "samples": 12}, keep_last=2)
    assert sorted(p.name for p in RunFolder(run).checkpoints.iterdir()) == ["step-000001", "step-000003"]
    saved = load_file(second / "trainable.safetensors")
    assert all(torch.equal(saved[n], p) for n, p in model.named_parameters() if p.requires_grad)


# --------------------------------------------------------------------------------------------
# the thermal pause (read only: the temperature comes from a reader function)


class _Sensor:
    def __init__(self, *temperatures):
        self.temperatures = list(temperatures)
        self.reads = []

    def __call__(self, device):
        self.reads.append(device)
        return self.temperatures[len(self.reads) - 1]


CUDA = torch.device("cuda", 0)


def test_thermal_pause_waits_until_the_gpu_is_back_at_the_resume_temperature():
    sensor, said = _Sensor(90, 88, 80, 74, 99), []
    waited = thermal_pause(CUDA, 85, 75, log=said.append, poll_s=0.01, read_temperature=sensor)
    assert sensor.reads == [CUDA] * 4  # 90 pauses, 88 and 80 wait, 74 resumes; nothing read after
    assert waited >= 3 * 0.01  # three polls
    assert len(said) == 1 and "90" in said[0] and "75" in said[0]

    at_the_limits = _Sensor(85, 76, 75, 10)  # pause_c itself pauses; resume_c itself resumes
    assert thermal_pause(CUDA, 85, 75, log=said.append, poll_s=0, read_temperature=at_the_limits) >= 0
    assert len(at_the_limits.reads) == 3 and len(said) == 2

    lost = _Sensor(90, None, 10)  # the sensor goes away mid-pause: stop waiting, never hang
    assert thermal_pause(CUDA, 85, 75, log=said.append, poll_s=0, read_temperature=lost) >= 0
    assert len(lost.reads) == 2


@pytest.mark.parametrize("pause_c, temperatures, reads", [
    (85, (84, 99), 1),  # below the pause temperature
    (85, (None, 99), 1),  # no reading (no NVML, a CPU)
    (0, (99, 99), 0),  # off
])
def test_thermal_pause_returns_at_once_when_cool_unreadable_or_off(pause_c, temperatures, reads):
    sensor, said = _Sensor(*temperatures), []
    assert thermal_pause(CUDA, pause_c, 75, log=said.append, poll_s=0, read_temperature=sensor) == 0.0
    assert len(sensor.reads) == reads and said == []


def test_metrics_jsonl_is_strict_json_a_nan_written_as_null_and_named(tmp_path):
    """A non-finite loss is logged as null with its name under "nonfinite": readers other than
    Python's (jq, JavaScript, pandas' strict mode) refuse a bare NaN."""
    log = MetricsLog(tmp_path)
    log.log(1, {"loss": float("nan"), "lr": 1e-3, "grad_norm": float("inf")})
    log.log(2, {"loss": 0.5, "lr": 1e-3})
    log.close()

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    lines = [json.loads(line, parse_constant=refuse) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["loss"] is None and lines[0]["grad_norm"] is None and lines[0]["lr"] == 1e-3
    assert lines[0]["nonfinite"] == ["loss", "grad_norm"]
    assert lines[1]["loss"] == 0.5 and "nonfinite" not in lines[1]
