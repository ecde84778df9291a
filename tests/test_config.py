"""Settings: YAML + key=value, types, and invalid combinations named by setting."""

from pathlib import Path

import pytest

from groundtune.config import ConfigError, RLConfig, TrainConfig, load_config

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train_data: a.jsonl\nlr: 1e-3\nlora_targets: [llm_attn]\n")
    cfg = load_config(TrainConfig, path, ["max_steps=7", "lr=0.5", "prompt=Find {phrase}", "lora_r=4"])
    assert cfg.train_data == "a.jsonl" and cfg.max_steps == 7 and cfg.lr == 0.5 and cfg.lora_r == 4
    assert cfg.prompt == "Find {phrase}" and cfg.lora_targets == ["llm_attn"]
    assert isinstance(cfg.lr, float)


def test_numbers_given_for_float_are_accepted():
    assert load_config(TrainConfig, None, ["train_data=x", "lr=1"]).lr == 1.0
    assert load_config(TrainConfig, None, ["train_data=x", "lr=2e-3"]).lr == 0.002  # YAML: a string
    with pytest.raises(ConfigError, match="lr='fast'"):
        load_config(TrainConfig, None, ["train_data=x", "lr=fast"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train_data=x", "bogus=1"], "unknown setting.* on the command line: bogus"),
        (["train_data=x", "save_every=-5"], "save_every=-5 must be 0 or more"),
        (["train_data=x", "warmup_steps=-1"], "warmup_steps=-1 must be 0 or more"),
        (["train_data=x", "log_every=0"], "log_every=0 must be positive"),
        (["train_data=x", "method=adapter"], "method='adapter'"),
        (["train_data=x", "lora_targets=[llm_attn, eyes]"], "lora_targets.*eyes"),
        (["train_data=x", "lora_targets=[]"], "lora_targets is empty"),
        (["train_data=x", "method=full", "freeze_vision=true", "freeze_merger=true", "freeze_llm=true"],
         "trains nothing"),
        (["train_data=x", "batch_size=0"], "batch_size=0"),
        (["train_data=x", "batch_size=two"], "batch_size='two'.*int"),
        (["train_data=x", "prompt=Find it"], r"\{phrase\}"),
        (["train_data=x", "min_pixels=100", "max_pixels=10"], "min_pixels=100"),
        (["train_data=x", "hflip_prob=2"], "hflip_prob"),
        (["train_data=x", "precision=fp8"], "precision"),
        (["lr=1"], "train_data is not set"),
        (["train_data"], "key=value"),
    ],
)
def test_invalid_settings_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TrainConfig, None, overrides)


def test_an_unknown_setting_is_named_where_it_was_given(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train_data: x\nbatchsize: 4\n")
    with pytest.raises(ConfigError, match=f"unknown setting.* in {path}: batchsize"):
        load_config(TrainConfig, path)
    path.write_text("train_data: x\n")
    with pytest.raises(ConfigError, match="unknown setting.* on the command line: lrate"):
        load_config(TrainConfig, path, ["lrate=1"])


def test_yaml_must_be_a_mapping(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(TrainConfig, path)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_is_valid(path):
    cls = RLConfig if path.stem.endswith("-rl") else TrainConfig  # groundtune rl's presets end in -rl
    cfg = load_config(cls, path, ["train_data=x.jsonl"])
    assert cfg.max_steps > 0


def test_configs_exist():
    assert any(p.name == "quickstart.yaml" for p in CONFIGS)
