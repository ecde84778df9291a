"""RL for grounding: rewards, advantages and the policy loss as pure functions; sampled generation;
and the loop itself on the shipped tiny model, from an SFT run's adapter and from the model alone:
rewards are logged, the adapter moves, the KL reference stays where it started, resume is exact."""

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from groundtune import boxes, infer
from groundtune.config import ConfigError, RLConfig, TrainConfig, load_config
from groundtune.data import synth
from groundtune.infer import Decoding, Prediction, encode_prompts, generate, predict
from groundtune.models import qwen
from groundtune.models.loading import load_model
from groundtune.train import checkpoint as ckpt
from groundtune.train import rl as rl_module
from groundtune.train.rewards import RewardWeights, box_reward, format_reward, missed_share, reward
from groundtune.train.rl import advantages, mark_finished_groups, next_prompts, policy_loss, rl
from groundtune.train.sft import train

W = RewardWeights(box=1.0, format=0.1)


def test_reward_is_iou_plus_format_and_zero_without_a_box():
    truth = [[10.0, 10.0, 30.0, 30.0]]
    assert reward([[10, 10, 30, 30]], truth, (100, 100), W) == {"reward": 1.1, "iou": 1.0, "format": 1.0}
    half = reward([[10, 10, 30, 20]], truth, (100, 100), W)
    assert half["iou"] == pytest.approx(0.5) and half["reward"] == pytest.approx(0.6)
    assert reward(None, truth, (100, 100), W) == {"reward": 0.0, "iou": 0.0, "format": 0.0}
    outside = reward([[90, 90, 130, 130]], truth, (100, 100), W)  # runs off the image: no format credit
    assert outside == {"reward": 0.0, "iou": 0.0, "format": 0.0}
    # GIoU ranks two misses by their distance, IoU cannot
    near = reward([[32, 10, 52, 30]], truth, (100, 100), RewardWeights(format=0.0, giou=True))["reward"]
    far = reward([[70, 70, 90, 90]], truth, (100, 100), RewardWeights(format=0.0, giou=True))["reward"]
    assert 0 > near > far


def _todays_reward(pred_box, true_box, size, weights):
    """The single-box reward as it was before sets (written out here): IoU (or GIoU) of the one
    predicted box with the true box, plus the format weight when the box lies inside the image."""
    w, h = size
    inside = -1 <= pred_box[0] < pred_box[2] <= w + 1 and -1 <= pred_box[1] < pred_box[3] <= h + 1
    overlap = boxes.giou(pred_box, true_box) if weights.giou else boxes.iou(pred_box, true_box)
    return weights.box * overlap + weights.format * inside


_coord = st.floats(0, 120, allow_nan=False)


@st.composite
def _box(draw):
    x1, x2, y1, y2 = draw(_coord), draw(_coord), draw(_coord), draw(_coord)
    return [min(x1, x2), min(y1, y2), max(x1, x2) + 0.5, max(y1, y2) + 0.5]


@given(_box(), _box(), st.booleans())
def test_the_single_box_reward_is_the_set_rewards_special_case(pred, true, giou):
    weights = RewardWeights(box=1.0, format=0.1, giou=giou)
    got = reward([pred], [true], (100, 100), weights)
    assert got["reward"] == pytest.approx(_todays_reward(pred, true, (100, 100), weights), abs=1e-12)
    assert got["iou"] == pytest.approx(boxes.iou(pred, true), abs=1e-12)


def test_set_reward_is_the_matched_iou_over_the_larger_side():
    a, b = [0, 0, 10, 10], [20, 0, 30, 10]
    half_a = [0, 0, 10, 5]  # IoU 0.5 with a
    # the matching pairs half_a with a and b with b, whatever order the answer lists them in
    assert box_reward([b, half_a], [a, b]) == pytest.approx((0.5 + 1) / 2)
    assert box_reward([half_a], [a, b]) == pytest.approx(0.5 / 2)  # a true box missed
    assert box_reward([a, b, [50, 50, 60, 60]], [a, b]) == pytest.approx(2 / 3)  # one box extra
    assert box_reward([a, a], [a]) == pytest.approx(1 / 2)  # a box repeated counts once
    assert box_reward([], [a, b]) == 0 and box_reward(None, [a, b]) == 0
    # the optimal matching, not the greedy one: greedy pairs p1 with t1 (its best) and p2 with t2
    t1, t2, p1, p2 = [5, 0, 15, 10], [8, 0, 18, 10], [6, 0, 16, 10], [2, 0, 12, 10]
    optimal = boxes.iou(p1, t2) + boxes.iou(p2, t1)
    assert optimal > boxes.iou(p1, t1) + boxes.iou(p2, t2)
    assert box_reward([p1, p2], [t1, t2]) == pytest.approx(optimal / 2)
    # GIoU: each box missed or extra counts as GIoU's floor, -1, so an extra box never lifts a bad answer
    far = [80, 80, 90, 90]
    assert box_reward([far], [a], use_giou=True) == pytest.approx(boxes.giou(far, a))
    assert box_reward([far, [60, 60, 70, 70]], [a], use_giou=True) < box_reward([far], [a], use_giou=True)
    assert box_reward([far, a], [a, b], use_giou=True) == pytest.approx((1 + boxes.giou(far, b)) / 2)
    assert box_reward([a], [a, b], use_giou=True) == pytest.approx((1 - 1) / 2)
    assert box_reward(None, [a], use_giou=True) == -1  # unread: the floor


def test_no_target_reward_and_format():
    a = [0, 0, 10, 10]
    assert reward([], [], (100, 100), W) == {"reward": pytest.approx(1.1), "iou": 1.0, "format": 1.0}
    assert reward([a], [], (100, 100), W) == {"reward": pytest.approx(0.1), "iou": 0.0, "format": 1.0}
    assert reward([a, a], [], (100, 100), W)["iou"] == 0.0
    assert reward(None, [], (100, 100), W) == {"reward": 0.0, "iou": 0.0, "format": 0.0}  # unread: not "none"
    assert reward([], [a], (100, 100), W) == {"reward": pytest.approx(0.1), "iou": 0.0, "format": 1.0}
    assert box_reward([], [], use_giou=True) == 1 and box_reward([a], [], use_giou=True) == -1
    # format: read (boxes, or []), and every box inside the image
    assert format_reward([a, [90, 90, 130, 130]], (100, 100)) == 0 and format_reward([a, a], (100, 100)) == 1


def test_a_missed_box_costs_more_than_an_extra_one_only_when_asked():
    a, b, far = [0, 0, 10, 10], [20, 0, 30, 10], [60, 60, 70, 70]
    assert missed_share([a], [a, b]) == 0.5 and missed_share([a, b, far], [a, b]) == 0
    assert missed_share([[0, 0, 10, 4]], [a]) == 1  # IoU 0.4: not found at eval's 0.5
    assert missed_share(None, [a]) == 1 and missed_share([a], []) == 0 and missed_share([], []) == 0
    alike, missing_first = RewardWeights(format=0.0), RewardWeights(format=0.0, missed=0.5)
    one_missed, one_extra = [a], [a, b, far]  # against the truth [a, b]
    assert reward(one_missed, [a, b], (100, 100), alike)["reward"] == pytest.approx(1 / 2)
    assert reward(one_extra, [a, b], (100, 100), alike)["reward"] == pytest.approx(2 / 3)
    assert reward(one_missed, [a, b], (100, 100), missing_first)["reward"] == pytest.approx(1 / 2 - 0.25)
    assert reward(one_extra, [a, b], (100, 100), missing_first)["reward"] == pytest.approx(2 / 3)
    assert reward([], [], (100, 100), missing_first)["reward"] == 1  # the right "none" loses nothing


def test_grpo_advantages_normalise_each_group_and_ignore_equal_groups():
    cfg = RLConfig(train_data="synth:full")
    r = torch.tensor([[0.0, 1.0, 0.5, 0.5], [0.3, 0.3, 0.3, 0.3]])
    a = advantages(r, [0, 1], cfg, None)
    assert torch.allclose(a[0].mean(), torch.tensor(0.0), atol=1e-6)
    assert torch.allclose(a[0].std(), torch.tensor(1.0), atol=1e-3)
    assert a[0, 1] > a[0, 2] > a[0, 0]
    assert torch.equal(a[1], torch.zeros(4))  # nothing to learn from a group that all scored the same


def test_ema_advantages_keep_a_baseline_per_prompt():
    cfg = RLConfig(train_data="synth:full", advantage="ema", ema_decay=0.5)
    baselines = {}
    first = advantages(torch.tensor([[1.0, 0.0]]), [7], cfg, baselines)
    assert torch.allclose(first, torch.tensor([[0.5, -0.5]]))  # a new prompt: its group's mean
    assert baselines == {"7": 0.5}
    second = advantages(torch.tensor([[1.0, 1.0]]), [7], cfg, baselines)
    assert torch.allclose(second, torch.tensor([[0.5, 0.5]]))  # against the remembered 0.5
    assert baselines["7"] == pytest.approx(0.75)


def test_policy_loss_is_the_clipped_surrogate_plus_kl():
    adv = torch.tensor([1.0, -1.0, 1.0])
    old = torch.log(torch.tensor([0.5, 0.5, 0.5]))
    same, kl, clipped = policy_loss(old.clone(), old, adv, clip=0.2)
    assert torch.allclose(same, -adv) and not clipped.any() and torch.equal(kl, torch.zeros(3))
    # ratio 2 on a positive advantage is clipped to 1.2; on a negative one the unclipped term is the min
    up = torch.log(torch.tensor([1.0, 1.0, 0.5]))
    loss, _, clipped = policy_loss(up, old, adv, clip=0.2)
    assert torch.allclose(loss, torch.tensor([-1.2, 2.0, -1.0]))
    assert clipped.tolist() == [True, True, False]
    ref = torch.log(torch.tensor([0.25, 0.5, 0.5]))
    loss_kl, kl, _ = policy_loss(old.clone(), old, adv, clip=0.2, kl_coef=0.1, ref_logprobs=ref)
    expected = 0.5 - torch.log(torch.tensor(0.5)) - 1  # k3 with ref/policy = 0.5
    assert torch.allclose(kl, torch.tensor([expected, 0.0, 0.0]))
    assert torch.allclose(loss_kl, -adv + 0.1 * kl)


def test_rl_settings_are_checked():
    with pytest.raises(ConfigError, match="advantage='ppo'"):
        RLConfig(train_data="synth:full", advantage="ppo")
    with pytest.raises(ConfigError, match="method: rl always trains a LoRA adapter"):
        load_config(RLConfig, None, ["train_data=synth:full", "method=full"])
    with pytest.raises(ConfigError, match="group_size=1"):
        RLConfig(train_data="synth:full", group_size=1)
    with pytest.raises(ConfigError, match="hflip_prob: augmentations would change the truth"):
        load_config(RLConfig, None, ["train_data=synth:full", "hflip_prob=0.5"])
    with pytest.raises(ConfigError, match="top_k=-1"):
        RLConfig(train_data="synth:full", top_k=-1)
    with pytest.raises(ConfigError, match="temperature=0"):
        RLConfig(train_data="synth:full", temperature=0)
    with pytest.raises(ConfigError, match="curriculum=true with train_data=synth:full"):
        RLConfig(train_data="synth:full", curriculum=True)


def test_curriculum_lets_solved_and_hopeless_prompts_sit_out_one_turn():
    sitting_out = []
    ious = torch.tensor([[0.9, 0.8], [0.1, 0.0], [0.7, 0.2]])  # solved, hopeless, still learning
    mark_finished_groups(sitting_out, [5, 6, 7], ious)
    assert sitting_out == [5, 6]
    order = iter([(5, 0), (7, 1), (6, 2), (8, 3), (5, 4)])  # (sample index, position in the order)
    assert next_prompts(order, 2, sitting_out) == ([7, 8], 4) and sitting_out == []
    assert next_prompts(order, 1, sitting_out) == ([5], 1)  # back on the turn after
    assert next_prompts(iter([(5, 0), (6, 1)]), 2, None) == ([5, 6], 2)  # curriculum off: every prompt


def test_sampled_generation_gives_group_size_answers_per_prompt(small_model):
    gm = load_model(small_model)
    pairs = [synth.make_sample(3, i, task="full") for i in range(2)]
    encoded, sizes = encode_prompts(gm, [(image, sample["phrase"]) for image, sample in pairs])
    torch.manual_seed(0)
    # a temperature high enough that even a trained model's surest answers vary
    answers = generate(gm, encoded, sizes, Decoding.sampled(16, temperature=4.0), num_samples=3)
    assert len(answers) == 6
    stop = set(gm.processor.eos_token_ids) | {gm.processor.pad_token_id}
    for ids, _ in answers:
        assert not stop.intersection(ids[:-1])  # cut at the first stop token, which is kept
    assert len({tuple(ids) for ids, _ in answers[:3]}) > 1  # sampling varies the answers
    greedy = generate(gm, encoded, sizes, Decoding.greedy(16))
    images, phrases = [i for i, _ in pairs], [s["phrase"] for _, s in pairs]
    assert [p.raw for _, p in greedy] == [p.raw for p in predict(gm, images, phrases, max_new_tokens=16)]


def test_sampled_generation_on_every_family(any_family_model):
    """num_return_sequences expands the images too, in every family's generate."""
    gm = load_model(any_family_model)
    pairs = [synth.make_sample(3, i, width=84 + 28 * i, height=112) for i in range(2)]  # two image sizes
    encoded, sizes = encode_prompts(gm, [(image, sample["phrase"]) for image, sample in pairs])
    answers = generate(gm, encoded, sizes, Decoding.sampled(8, temperature=1.0), num_samples=2)
    assert len(answers) == 4 and all(1 <= len(ids) <= 8 for ids, _ in answers)


def _answer(raw, boxes_=(), no_target=False, error=None):
    boxes_ = [list(map(float, b)) for b in boxes_]
    return Prediction(bbox=boxes_[0] if boxes_ else None, boxes=boxes_, label=None, raw=raw, error=error,
                      no_target=no_target)


def test_a_no_target_answer_is_read_not_a_parse_failure(monkeypatch):
    """Rollouts score what infer.generate answered: ``[]`` is a read answer (full marks on a phrase
    that names nothing), only an unreadable one counts in rollout/parse_fail_rate."""
    answers = [_answer("[]", no_target=True), _answer("[[0, 0, 10, 10]]", [[0, 0, 10, 10]]),
               _answer("no idea", error="no box in the answer"),  # a prompt with no target, three answers
               _answer("[]", no_target=True), _answer("[[0, 0, 10, 10]]", [[0, 0, 10, 10]]),
               _answer("[[0, 0, 10", error="no box in the answer")]  # a prompt whose target is [0, 0, 10, 10]
    monkeypatch.setattr(infer, "encode_prompts", lambda gm, prompts: ([{}] * len(prompts), None))
    monkeypatch.setattr(infer, "generate", lambda *args, **kwargs: [([1, 2, 3], a) for a in answers])
    monkeypatch.setattr(qwen, "with_answer_ids", lambda processor, encoded, ids: {})
    image = synth.make_sample(3, 0)[0]
    pairs = [(image, {"phrase": "every green cross", "bboxes": []}),
             (image, {"phrase": "the red square", "bbox": [0, 0, 10, 10]})]
    gm = type("FakeModel", (), {"processor": None})()
    batch = rl_module.rollouts(gm, pairs, [0, 1], 3, Decoding.sampled(8, temperature=1.0), W)
    assert batch.parsed.tolist() == [[True, True, False], [True, True, False]]
    assert batch.rewards.tolist() == [[pytest.approx(1.1), pytest.approx(0.1), 0.0],
                                      [pytest.approx(0.1), pytest.approx(1.1), 0.0]]
    metrics = rl_module._rollout_metrics(batch, rollout_s=1.0)
    assert metrics["rollout/parse_fail_rate"] == pytest.approx(2 / 6)  # not 4 / 6: the two [] were read
    assert rl_module.answer_boxes(answers[0]) == [] and rl_module.answer_boxes(answers[2]) is None


@pytest.fixture(scope="module")
def variant_data(tmp_path_factory):
    """The quickstart's variant (168 px canvases), small."""
    out = tmp_path_factory.mktemp("rl_variant")
    synth.make_synthetic_set(out, n=48, seed=1, width=168, height=168, workers=1)
    synth.make_synthetic_set(out, n=16, seed=2, width=168, height=168, split="val", workers=1)
    return out


@pytest.fixture(scope="module")
def sft_run(variant_data, tmp_path_factory):
    """A short LoRA SFT run of the tiny model on the variant: the starting point of RL (trained
    weights, as in the RL tests below: rollouts that parse some of the time, so that a group's
    rewards differ, its advantages are not all zero and the adapter moves)."""
    return train(TrainConfig(model="tiny", train_data=str(variant_data / "train.jsonl"), method="lora",
                             out_dir=str(tmp_path_factory.mktemp("sft") / "run"), lr=2e-3, batch_size=8,
                             max_steps=4, save_every=0, log_every=1))


def _rl_cfg(model, data, out, **kw):
    base = {"model": str(model), "train_data": str(data / "train.jsonl"), "eval_data": str(data / "val.jsonl"),
            "out_dir": str(out), "lr": 1e-3, "max_steps": 3, "batch_size": 2, "group_size": 4, "micro_batch": 5,
            "max_new_tokens": 40, "temperature": 1.5, "eval_every": 0, "eval_samples": 8, "save_every": 0,
            "log_every": 1, "inner_updates": 2, "kl_coef": 0.1}
    base.update(kw)
    return RLConfig(**base)


def _adapter(model, name="default"):
    return {k: v.detach().clone() for k, v in model.named_parameters() if f".{name}." in k and "lora_" in k}


@pytest.mark.slow
def test_rl_from_an_sft_run_moves_the_adapter_and_keeps_the_reference(sft_run, variant_data, tmp_path):
    start = load_model(str(sft_run)).model
    before = _adapter(start)
    seen = {}

    def look(step, run, model):
        seen["reference"] = _adapter(model, "reference")
        seen["policy"] = _adapter(model)
        # after the reference passes, the trained adapter is trainable again and the copy is not
        lora = {n: p.requires_grad for n, p in model.named_parameters() if "lora_" in n}
        assert all(v for n, v in lora.items() if ".default." in n)
        assert not any(v for n, v in lora.items() if ".reference." in n)

    run = rl(_rl_cfg(sft_run, variant_data, tmp_path / "rl"), on_step=look)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 3
    for r in steps:
        assert 0 <= r["reward/mean"] <= 1.1 and 0 <= r["rollout/parse_fail_rate"] <= 1
        assert r["kl"] >= 0 and sum(r["rollout/iou_histogram"]) == 8
    assert any(r["kl"] > 0 for r in steps[1:])  # the policy left the reference after the first update
    evals = [r for r in rows if "eval/acc@0.5" in r]
    assert [r["step"] for r in evals] == [0, 3]  # before and after
    # the decoding of rollouts and of the eval, recorded once each
    decoding = {k: r[k] for r in rows for k in ("rollout/decoding", "eval/decoding") if k in r}
    assert decoding["rollout/decoding"] == {"max_new_tokens": 40, "do_sample": True, "temperature": 1.5,
                                            "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}
    assert decoding["eval/decoding"] == {"max_new_tokens": 64, "do_sample": False, "repetition_penalty": 1.0}
    # the trained adapter moved; the reference is the SFT adapter, untouched
    assert before.keys() == seen["policy"].keys() and before
    assert any(not torch.equal(before[k], seen["policy"][k]) for k in before)
    for k, v in seen["reference"].items():
        assert torch.equal(v, before[k.replace(".reference.", ".default.")])
    # the result loads like any run, on the SFT run's base model, without the reference copy
    loaded = load_model(str(run))
    assert json.loads((run / "model" / "groundtune.json").read_text())["base_model"] == "tiny"
    assert not any(".reference." in k for k in loaded.model.state_dict())


@pytest.mark.slow
def test_rl_resumes_exactly(variant_data, tmp_path):
    """From the tiny model alone (a new LoRA; the reference is that adapter switched off), with
    the moving-average baseline and the curriculum, on 3 prompts so that they come back (their
    baselines and sit-outs are state); stopped at step 2 and resumed = uninterrupted. Trained
    weights: a random model's rollouts never parse, every reward is 0, nothing moves and the
    resumed run would equal the straight one whatever resuming restored."""
    few = variant_data / "few.jsonl"
    few.write_text("".join((variant_data / "train.jsonl").read_text().splitlines(keepends=True)[:3]))
    kw = {"advantage": "ema", "curriculum": True, "max_steps": 3, "eval_data": "", "train_data": str(few)}
    straight = rl(_rl_cfg("tiny", variant_data, tmp_path / "straight", **kw))

    def stop_at_2(step, run, model):
        if step == 2:
            (run / "STOP").touch()

    interrupted = rl(_rl_cfg("tiny", variant_data, tmp_path / "interrupted", **kw), on_step=stop_at_2)
    assert [p.name for p in ckpt.list_checkpoints(interrupted)] == ["step-000002"]
    resumed = rl(resume=interrupted)

    def logged(run, key):
        return [r[key] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if key in r]

    assert logged(resumed, "reward/mean") == logged(straight, "reward/mean")
    assert logged(resumed, "curriculum/sat_out") == logged(straight, "curriculum/sat_out")
    assert len(logged(straight, "curriculum/sat_out")) == 3
    a, b = load_model(str(straight)).model.state_dict(), load_model(str(resumed)).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_an_sft_runs_adapter_keeps_its_own_lora_settings(tmp_path):
    """From an SFT run, the lora_* settings would be ignored (the run's adapter trains on as it was
    made): refused before anything loads, naming them."""
    run = tmp_path / "sft" / "model"
    run.mkdir(parents=True)
    (run / "adapter_config.json").write_text("{}")
    RLConfig(model=str(tmp_path / "sft"), train_data="synth:full")  # the defaults: nothing ignored
    with pytest.raises(ConfigError, match="lora_r, lora_targets: model=.* is an SFT run whose LoRA adapter"):
        RLConfig(model=str(tmp_path / "sft"), train_data="synth:full", lora_r=64, lora_targets=["llm_attn"])
    RLConfig(model="tiny", train_data="synth:full", lora_r=64)  # a new adapter takes them
