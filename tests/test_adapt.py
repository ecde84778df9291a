"""What to train (models/adapt.py) on a small random Qwen2.5-VL (2 LM layers, 2 vision layers):
the optimizer's parameter groups (weight decay, per-part learning rates) and where LoRA adapters
go."""

import copy
import re
from collections import Counter

import pytest
import torch
from peft.tuners.lora import LoraLayer

from groundtune.config import TrainConfig
from groundtune.data import synth
from groundtune.infer import predict
from groundtune.models import adapt, qwen
from groundtune.models.loading import load_model

FAMILY = qwen.family("qwen2.5-vl")  # the small model's
LLM_LAYER = re.compile(r"language_model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)$")


@pytest.fixture(scope="module")
def small(small_model):
    return load_model(small_model).model


def _groups_by_name(model, groups):
    names = {id(p): n for n, p in model.named_parameters()}
    return [(names[id(p)], p, g) for g in groups for p in g["params"]]


def test_param_groups_of_full_fine_tuning(small):
    model = copy.deepcopy(small)
    # untie the LM head (as in the large models) so that it is a parameter of its own
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    cfg = TrainConfig(train_data="x", method="full", freeze_vision=False, freeze_merger=False, lr=1e-3,
                      lr_vision=1e-5, lr_merger=3e-4, lr_llm=0.0, weight_decay=0.1)
    model = adapt.prepare_for_training(model, cfg)
    entries = _groups_by_name(model, adapt.param_groups(model, cfg))

    # every trainable parameter exactly once, and nothing else
    counts = Counter(name for name, _, _ in entries)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == len(list(model.parameters())) and set(counts) == set(trainable)
    assert set(counts.values()) == {1}

    peak = {"vision": 1e-5, "merger": 3e-4, "llm": 1e-3}  # lr_llm=0: the base lr
    seen = {"decay": set(), "no_decay": set()}
    for name, p, group in entries:
        part = FAMILY.part_of(name)
        assert group["part"] == part and group["lr"] == peak[part], name
        no_decay = (p.ndim == 1 or name.endswith(".bias") or name.endswith("embed_tokens.weight")
                    or name == "lm_head.weight")
        assert group["weight_decay"] == (0.0 if no_decay else 0.1), name
        seen["no_decay" if no_decay else "decay"].add(name)
    # each kind really occurs (the rule above is not vacuous)
    for must in ("model.language_model.embed_tokens.weight", "lm_head.weight", "model.language_model.norm.weight",
                 "model.visual.merger.ln_q.weight", "model.visual.blocks.0.attn.qkv.bias",
                 "model.language_model.layers.0.input_layernorm.weight"):
        assert must in seen["no_decay"]
    for must in ("model.language_model.layers.1.mlp.down_proj.weight", "model.visual.merger.mlp.0.weight",
                 "model.visual.patch_embed.proj.weight",  # a convolution kernel, not an embedding table
                 "model.visual.blocks.1.attn.qkv.weight", "model.language_model.layers.0.self_attn.q_proj.weight"):
        assert must in seen["decay"]
    # one group per (part, decay): the three parts, each with both kinds
    assert sorted({(g["part"], g["weight_decay"]) for _, _, g in entries}) == [
        (part, wd) for part in ("llm", "merger", "vision") for wd in (0.0, 0.1)]


def test_param_groups_of_frozen_parts_and_of_lora(small):
    # method=full with the defaults: vision tower and merger frozen, so not in any group
    cfg = TrainConfig(train_data="x", method="full", lr=2e-3, weight_decay=0.05)
    model = adapt.prepare_for_training(copy.deepcopy(small), cfg)
    entries = _groups_by_name(model, adapt.param_groups(model, cfg))
    assert {FAMILY.part_of(n) for n, _, _ in entries} == {"llm"}
    assert sorted(n for n, _, _ in entries) == sorted(n for n, p in model.named_parameters() if p.requires_grad)

    # LoRA on every part: only the adapters, each once, all decayed (matrices), each part its own lr
    cfg = TrainConfig(train_data="x", method="lora", lora_r=2, lora_targets=["llm_attn", "merger", "vision"],
                      lr=1e-3, lr_vision=2e-5, lr_merger=5e-4, weight_decay=0.01)
    model = adapt.prepare_for_training(copy.deepcopy(small), cfg)
    entries = _groups_by_name(model, adapt.param_groups(model, cfg))
    names = [n for n, _, _ in entries]
    assert len(names) == len(set(names))
    assert set(names) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert all(".lora_A." in n or ".lora_B." in n for n in names)
    peak = {"vision": 2e-5, "merger": 5e-4, "llm": 1e-3}
    assert {FAMILY.part_of(n) for n in names} == set(peak)
    for name, _, group in entries:
        assert group["part"] == FAMILY.part_of(name) and group["lr"] == peak[group["part"]]
        assert group["weight_decay"] == 0.01


@pytest.mark.parametrize("trained", ["vision", "merger"])
def test_one_of_vision_tower_and_merger_trained_on_a_bf16_base_answers(any_family_model, trained):
    # The evals during training answer outside autocast, and nothing casts between the vision tower
    # and the merger: an fp32 tower (trained) before a bf16 merger (frozen), or the reverse, failed
    # the merger's first matmul. Each merger now reads its input in its own dtype; no frozen part is
    # copied to fp32.
    gm = load_model(any_family_model, dtype="bf16")
    cfg = TrainConfig(train_data="x", method="full", freeze_vision=trained != "vision",
                      freeze_merger=trained != "merger", freeze_llm=True)
    model = adapt.prepare_for_training(gm.model, cfg)
    adapt.keep_trainable_fp32(model)
    family = qwen.family_of(model)
    dtypes = {part: {p.dtype for n, p in model.named_parameters() if family.part_of(n) == part}
              for part in ("vision", "merger", "llm")}
    assert dtypes == {part: {torch.float32 if part == trained else torch.bfloat16}
                      for part in ("vision", "merger", "llm")}
    image, record = synth.make_sample(5, 0)
    [answer] = predict(gm, [image], [record["phrase"]], max_new_tokens=48)
    assert answer.raw  # it answered (random weights: what they say is not the point)


def _adapted(model) -> set[str]:
    """Names (in the base model's terms) of the modules that carry a LoRA adapter."""
    return {n.removeprefix("base_model.model.") for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def _linears(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


@pytest.mark.parametrize("targets, last_n, layers", [
    (["llm_attn"], 1, {1}),
    (["llm_mlp"], 1, {1}),
    (["llm_attn", "llm_mlp"], 1, {1}),
    (["llm_attn", "llm_mlp"], 2, {0, 1}),
    (["llm_attn", "llm_mlp"], 0, {0, 1}),
])
def test_lora_on_the_last_llm_layers(small, targets, last_n, layers):
    assert len(adapt.decoder_layers(small)) == 2
    kinds = {"llm_attn": "self_attn", "llm_mlp": "mlp"}
    expected = set()
    for name in _linears(small):
        match = LLM_LAYER.search(name)
        if match and int(match.group(1)) in layers and match.group(2) in {kinds[t] for t in targets}:
            expected.add(name)
    per_layer = (4 if "llm_attn" in targets else 0) + (3 if "llm_mlp" in targets else 0)  # q k v o / gate up down
    assert len(expected) == per_layer * len(layers)
    cfg = TrainConfig(train_data="x", method="lora", lora_r=2, lora_targets=targets, lora_last_n_layers=last_n)
    model = adapt.prepare_for_training(copy.deepcopy(small), cfg)
    assert _adapted(model) == expected  # nothing in the vision tower, the merger or the LM head
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {n.removeprefix("base_model.model.").split(".lora_")[0] for n in trainable} == expected


@pytest.mark.parametrize("target", ["merger", "vision"])
def test_lora_on_the_vision_side(small, target):
    expected = {n for n in _linears(small) if FAMILY.part_of(n) == target}
    assert expected and all(n.startswith("model.visual.") for n in expected)
    cfg = TrainConfig(train_data="x", method="lora", lora_r=2, lora_targets=[target],
                      lora_last_n_layers=1)  # counts LLM layers only: the vision side is adapted whole
    model = adapt.prepare_for_training(copy.deepcopy(small), cfg)
    adapted = _adapted(model)
    assert adapted == expected
    other = {"merger": "vision", "vision": "merger"}[target]
    assert not any(FAMILY.part_of(n) in (other, "llm") for n in adapted)
