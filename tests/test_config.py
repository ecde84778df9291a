"""Settings: YAML + key=value, types, and invalid combinations named by setting."""

import json
from pathlib import Path

import pytest

from groundtune.config import ConfigError, RLConfig, TrainConfig, load_config
from groundtune.train import parallel

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


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
        (["train_data=x", "batch_size=two"], "batch_size='two'.*whole number"),
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


@pytest.mark.parametrize("given, said", [
    ("lr=nan", "lr=nan: expected a finite number"), ("lr=.nan", "lr=nan: expected a finite number"),
    ("lr=inf", "lr=inf: expected a finite number"), ("lr=-.inf", "lr=-inf: expected a finite number"),
    ("lr=1e400", "lr=1e400: expected a finite number"), ("weight_decay=nan", "weight_decay=nan"),
    ("max_grad_norm=.inf", "max_grad_norm=inf"), (f"max_steps={2**31}", "max_steps=2147483648: out of range"),
    (f"seed={-2**40}", "seed=-1099511627776: out of range"),
])
def test_numbers_no_run_can_use_are_refused_naming_the_setting(given, said):
    with pytest.raises(ConfigError, match=f"^{said}"):
        load_config(TrainConfig, None, ["train_data=x", given])
    assert load_config(TrainConfig, None, ["train_data=x", f"max_steps={2**31 - 1}"]).max_steps == 2**31 - 1


def test_a_setting_given_twice_in_a_file_is_refused_with_its_lines(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train_data: x\nlr: 1.0e-3\nmax_steps: 5\nlr: 5.0\n")
    with pytest.raises(ConfigError, match=rf"^{path}:4:1: not valid YAML \('lr' is given twice \(first on line 2\)\)$"):
        load_config(TrainConfig, path)
    nested = tmp_path / "nested.yaml"  # a list of mappings: each mapping's keys on their own
    nested.write_text("train_data: x\nlora_targets: [llm_attn, llm_mlp]\n")
    assert load_config(TrainConfig, nested).lora_targets == ["llm_attn", "llm_mlp"]


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


# --------------------------------------------------------------------------------------------
# several ranks: the engine setting, the shipped DeepSpeed and accelerate configs


def test_the_engine_is_checked_and_qlora_is_not_sharded():
    with pytest.raises(ConfigError, match="distributed='zero4'"):
        TrainConfig(train_data="x", distributed="zero4")
    with pytest.raises(ConfigError, match="bitsandbytes' 4-bit weights cannot be sharded"):
        TrainConfig(train_data="x", method="qlora", distributed="fsdp2")
    with pytest.raises(ConfigError, match="deepspeed_config is set but distributed=ddp"):
        TrainConfig(train_data="x", deepspeed_config="configs/deepspeed/zero3-offload.json")
    assert TrainConfig(train_data="x", method="qlora", distributed="zero2").distributed == "zero2"
    assert RLConfig(train_data="x", distributed="fsdp2").distributed == "fsdp2"


def test_deepspeed_does_not_take_a_trained_vision_tower():
    """Measured: under zero2/zero3 a trained vision tower or merger has no optimizer state to
    checkpoint, and the run failed after its steps; it is refused before them instead."""
    for settings in (dict(lora_targets=["llm_attn", "vision"]), dict(lora_targets=["merger"]),
                     dict(method="full", freeze_vision=False), dict(method="full", freeze_merger=False)):
        for engine in ("zero2", "zero3"):
            with pytest.raises(ConfigError, match=f"distributed={engine} cannot train the vision tower"):
                TrainConfig(train_data="x", distributed=engine, **settings)
        assert TrainConfig(train_data="x", distributed="fsdp2", **settings).distributed == "fsdp2"
    assert TrainConfig(train_data="x", distributed="zero3", method="full").distributed == "zero3"


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "deepspeed").glob("*.json")), ids=lambda p: p.name)
def test_shipped_deepspeed_configs_name_real_options(path):
    """Each file merged over groundtune's settings is a config DeepSpeed accepts: its ZeRO options
    are parsed by DeepSpeed's own (strict) model, so a misspelt or removed option fails here."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    for stage in (2, 3):
        settings = parallel.deepspeed_settings(stage, 1.0, str(path))
        parsed = DeepSpeedConfig(settings)
        assert parsed.zero_optimization_stage == stage and parsed.gradient_clipping == 1.0
        read = parsed.zero_config.model_dump(by_alias=True)
        for key, value in json.loads(path.read_text())["zero_optimization"].items():
            if not isinstance(value, dict):  # the nested offload settings are models of their own
                assert read[key] == value, key
    with pytest.raises(Exception, match="overlap_comms"):  # and a misspelt option would not pass
        DeepSpeedConfig({**settings, "zero_optimization": {"stage": 2, "overlap_comms": True}})


def test_a_broken_deepspeed_config_is_named():
    with pytest.raises(ConfigError, match="deepspeed_config=nowhere.json"):
        parallel.deepspeed_settings(2, 1.0, "nowhere.json")


def test_the_shipped_accelerate_config_loads_as_accelerate_reads_it():
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(ROOT / "configs" / "accelerate" / "multi-gpu.yaml"))
    assert config.distributed_type == "MULTI_GPU" and config.num_processes == 2 and not config.use_cpu


def test_a_launcher_set_up_for_another_engine_is_refused(monkeypatch):
    parallel.check_launch("ddp")  # nothing said: a plain launch
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    parallel.check_launch("zero3")
    with pytest.raises(ConfigError, match="launcher asks for deepspeed but the run's distributed=ddp"):
        parallel.check_launch("ddp")
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ConfigError, match="asks for fsdp but the run's distributed=zero2"):
        parallel.check_launch("zero2")


def test_deepspeed_missing_is_said_before_anything_loads(monkeypatch):
    import importlib.util

    from groundtune.errors import MissingPackageError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    with pytest.raises(MissingPackageError, match="distributed=zero3 needs DeepSpeed: pip install deepspeed"):
        parallel.check_launch("zero3")
    parallel.check_launch("fsdp2")


def test_the_functions_behind_eval_predict_and_serve_default_to_infer_settings():
    """batch_size, max_new_tokens and device are defined once (config.InferSettings): every function
    that takes one defaults to it, as the commands' flags do."""
    import dataclasses
    import inspect

    from groundtune import evaluate, infer
    from groundtune.config import InferSettings
    from groundtune.deploy import serve

    shared = {f.name: f.default for f in dataclasses.fields(InferSettings)}
    functions = [infer.load, infer.predict, infer.predict_records, infer.predict_jsonl, infer.Decoding.greedy,
                 evaluate.evaluate, evaluate.filter_by_model, evaluate.run_eval, serve.serve]
    for fn in functions:
        taken = {name: p.default for name, p in inspect.signature(fn).parameters.items() if name in shared}
        assert taken and taken == {name: shared[name] for name in taken}, fn.__qualname__
    assert infer.Decoding().max_new_tokens == InferSettings.max_new_tokens
    assert serve.Limits().batch_size == InferSettings.batch_size  # the server's batch: its flag is --batch-size


def test_a_settings_file_is_bounded_before_yaml_expands_it(tmp_path):
    """An alias bomb (nine lines, 9**9 values: 120 s and 9 GB, then 2 GB of message) is refused at
    its line before anything is expanded; so are nesting past 16 levels, a file over 1 MB, and
    bytes that are not UTF-8 (named by line and byte offset)."""
    path = tmp_path / "bomb.yaml"
    path.write_text("train_data: x\na: &a [x, x, x, x, x, x, x, x, x]\n"
                    + "".join(f"{b}: &{b} [{', '.join(['*' + a] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi"))
                    + "lora_targets: *i\n")
    with pytest.raises(ConfigError, match=rf"^{path}:6:4: expands to more than 10,000 values \(YAML aliases repeat "):
        load_config(TrainConfig, path)
    path.write_text("train_data: x\na: &a [x, *a]\n")  # a list that holds itself never ends
    with pytest.raises(ConfigError, match=rf"^{path}:2:4: expands to more than 10,000 values"):
        load_config(TrainConfig, path)
    path.write_text("train_data: x\nlr: " + "[" * 100 + "]" * 100 + "\n")
    with pytest.raises(ConfigError, match=rf"^{path}:2:\d+: nested deeper than 16 levels"):
        load_config(TrainConfig, path)
    path.write_text("train_data: x\nprompt: '" + "x" * 2**20 + " {phrase}'\n")
    with pytest.raises(ConfigError, match=rf"^{path}: larger than 1,048,576 bytes; a settings file is a few KB$"):
        load_config(TrainConfig, path)
    path.write_bytes(b"train_data: x\nprompt: 'caf\xe9 {phrase}'\n")
    with pytest.raises(ConfigError, match=rf"^{path}:2: not UTF-8 text \(byte 0xE9 at byte offset 26\)"):
        load_config(TrainConfig, path)
    path.write_text("a: &a [x, y]\ntrain_data: x\nlora_targets: [llm_attn, llm_mlp]\nb: *a\n")  # aliases are fine
    with pytest.raises(ConfigError, match="unknown setting.* a, b;"):
        load_config(TrainConfig, path)


@pytest.mark.parametrize("given, said", [
    ("model=[&a [x,x,x,x,x,x,x,x,x], [*a,*a,*a,*a,*a,*a,*a,*a,*a]]",
     r"^model=\[\['x', 'x', 'x', 'x', 'x', 'x', 'x', 'x', 'x'\], \[\['x', 'x', \.\.\. \(a list of 2 items\): expected "
     r"str$"),
    ("report_to=[[tensorboard]]", r"^report_to=\[\['tensorboard'\]\]: expected names"),
    ("lora_targets=[[llm_attn]]", r"^lora_targets: unknown \[\['llm_attn'\]\]"),
    ("bad_records=" + "x" * 5000, r"^bad_records='x{59}\.\.\. \(5,000 characters\): expected one of refuse, skip$"),
    ("max_steps=" + "1" * 5000, r"override 'max_steps=1{49}\.\.\. \(5,010 characters\) on the command line: not valid "
                                r"YAML \(a number of more digits than a number has\)$"),
    ('model="a\\0b"', r"^model: 'a\\x00b' holds a NUL byte"),  # YAML's escape: a NUL itself is no YAML
    ("out_dir=" + "x" * 300, r"^out_dir: 'x{59}\.\.\. \(300 characters\) is longer than a file name can be"),
])
def test_a_value_an_error_echoes_is_cut_to_its_first_characters_and_its_size(given, said):
    with pytest.raises(ConfigError, match=said):
        load_config(TrainConfig, None, ["train_data=x", given])
