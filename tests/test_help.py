"""`groundtune train --help` and `groundtune rl --help` document every setting with its default:
the dataclass is the config, and its help must not drift from it. One real `groundtune train
--help` process checks the console entry point prints what the parser says."""

import argparse
import ast
import dataclasses
import re
import subprocess
import sys

import pytest

from groundtune.cli import build_parser
from groundtune.config import RLConfig, TrainConfig

SETTING = re.compile(r"^  (\w+) = (.*?)(?:  # (.*))?$")


def _settings(help_text: str, cls) -> dict[str, tuple[object, str | None]]:
    """name -> (default, comment) from the help's settings section, one line per setting."""
    head = f"settings ({cls.__name__}) and their defaults:"
    assert head in help_text
    section = help_text.split(head, 1)[1].split("\n\n", 1)[0]
    found = {}
    for line in section.strip("\n").splitlines():
        match = SETTING.match(line)
        assert match, f"not a setting line: {line!r}"
        name, value, comment = match.groups()
        assert name not in found, f"{name} listed twice"
        found[name] = (ast.literal_eval(value), comment)
    return found


def _defaults(cls) -> dict[str, object]:
    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(cls)}


def _flat(text: str) -> str:
    """``text`` on one line, as argparse may wrap it: any run of whitespace one space, and none after
    a hyphen (its wrapping breaks words like liger-kernel there, at a place set by the width)."""
    return re.sub(r"-\s+", "-", " ".join(text.split()))


def _subcommand_help(*names: str) -> str:
    parser = build_parser()
    for name in names:  # "data", "refgen": a command of a command
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    return parser.format_help()


@pytest.mark.parametrize("command, cls", [("train", TrainConfig), ("rl", RLConfig)])
def test_help_lists_every_setting_with_its_default(command, cls):
    listed = _settings(_subcommand_help(command), cls)
    defaults = _defaults(cls)
    assert list(listed) == list(defaults)  # every field, in the dataclass's order, nothing else
    for name, default in defaults.items():
        value = listed[name][0]
        assert value == default and type(value) is type(default), name
    # a setting rl redefines shows rl's default and rl's comment, not train's
    if cls is RLConfig:
        assert listed["out_dir"][0] == "runs/rl" and listed["max_steps"][0] == 200
        assert "policy updates" in listed["max_steps"][1]
    else:
        assert listed["out_dir"][0] == "runs/sft" and listed["max_steps"][0] == 1000
        assert "optimizer steps" in listed["max_steps"][1]


def test_the_command_prints_the_same_help():
    out = subprocess.run([sys.executable, "-m", "groundtune", "train", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert _settings(out.stdout, TrainConfig) == _settings(_subcommand_help("train"), TrainConfig)


def test_every_setting_has_a_help():
    for cls in (TrainConfig, RLConfig):
        listed = _settings(_subcommand_help(cls.command), cls)
        assert [name for name, (_, comment) in listed.items() if not comment] == [], cls.__name__


@pytest.mark.parametrize("argv, names", [
    (["eval", "--model", "m", "--data", "d"], ["batch_size", "max_new_tokens", "device", "compile"]),
    (["predict", "--model", "m"], ["batch_size", "max_new_tokens", "device", "compile"]),
    (["serve", "--model", "m"], ["batch_size", "max_new_tokens", "device", "compile"]),
    (["data", "refgen", "--from", "coco", "--out", "x"], ["batch_size", "device"]),
])
def test_the_commands_that_answer_take_their_flags_from_infer_settings(argv, names):
    """Each flag is built from its InferSettings field: the default and the help are the field's."""
    from groundtune.config import InferSettings

    args = build_parser().parse_args(argv)
    shown = _flat(_subcommand_help(*argv[:2] if argv[0] == "data" else argv[:1]))
    for f in dataclasses.fields(InferSettings):
        flag = "--" + f.name.replace("_", "-")
        if f.name in names:
            assert getattr(args, f.name) == f.default
            assert _flat(f.metadata["help"]) in shown, flag
        else:
            assert flag not in shown


def test_serve_flags_are_the_limits_fields():
    """`groundtune serve`'s limits flags are Limits' fields, each with its default (sizes in MB) and
    help; the flags left as they are give Limits() itself, and a size given in MB is read in bytes."""
    from groundtune.cli.deploy import _limits
    from groundtune.deploy.limits import MB, Limits, flag

    shown = _flat(_subcommand_help("serve"))
    for f in dataclasses.fields(Limits):
        assert flag(f.name) in shown and _flat(f.metadata["help"]) in shown, f.name
    parser = build_parser()
    assert _limits(parser.parse_args(["serve", "--model", "m"])) == Limits()
    given = _limits(parser.parse_args(["serve", "--model", "m", "--max-body-mb", "1.5", "--workers", "0",
                                       "--max-wait-ms", "0", "--batch-size", "4"]))
    assert (given.max_body_bytes, given.workers, given.max_wait_ms, given.batch_size) == (int(1.5 * MB), 0, 0, 4)


def test_eval_help_explains_the_set_metrics():
    shown = _flat(_subcommand_help("eval"))
    assert "RefCOCO's meaning, over the samples with a target): Acc@0.5" in shown  # Acc@0.5 keeps its meaning
    for metric in ("F1@0.5", "precision", "recall", "set_acc@0.5", "N-acc", "T-acc", "AP and AP@0.5"):
        assert metric in shown, metric
    assert "when the model scores its boxes" in shown and "an answer [] was read" in shown


def test_synth_help_lists_the_every_task():
    from groundtune.data import synth
    from groundtune.data.synth import TASKS

    shown = _flat(_subcommand_help("data", "synth"))
    assert "every" in TASKS and "{" + ",".join(TASKS) + "}" in shown
    for task in TASKS:  # each task is explained, not only listed
        assert f"{task}: " in shown, task
    assert "every: sets," in shown and f"{synth.NO_TARGET_SHARE:.0%} of the samples naming nothing" in shown


def test_the_reward_settings_say_how_a_set_answer_is_scored():
    listed = _settings(_subcommand_help("rl"), RLConfig)
    assert "matched one to one with the true set" in listed["reward_box"][1]
    assert "[] to a phrase naming nothing: 1" in listed["reward_box"][1]
    assert "or []" in listed["reward_format"][1]
    assert "every: sets and no target" in _settings(_subcommand_help("train"), TrainConfig)["train_data"][1]
