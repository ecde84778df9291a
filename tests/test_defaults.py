"""A flag's default is the default of the function it feeds, defined once, in that function's module
(the command line reads it from there): `groundtune serve` and ``serve()`` listen on the same port. Each
(command, flag) is compared with the parameter of its owner that it becomes."""

import argparse
import importlib
import inspect

import pytest

from groundtune.cli import build_parser

# command -> {flag's dest: "module:callable" whose parameter of that name the flag is passed to}
OWNERS = {
    ("data", "convert"): {"negatives": "groundtune.data.sources:convert_coco",
                          "seed": "groundtune.data.sources:convert_coco"},
    ("data", "show"): {"n": "groundtune.data.show:show_grid", "seed": "groundtune.data.show:show_grid"},
    ("data", "synth"): {name: "groundtune.data.synth:make_synthetic_set"
                        for name in ("width", "height", "split", "task", "workers")},
    ("data", "refgen"): {"attribute_field": "groundtune.data.refgen:from_coco",
                         **{name: "groundtune.data.refgen:RefgenSettings" for name in ("per_box", "min_size", "seed")}},
    ("plan",): {"gpus": "groundtune.plan:plan_run"},
    ("eval",): {name: "groundtune.evaluate:run_eval"
                for name in ("protocol", "batch_size", "max_new_tokens", "device", "compile")},
    ("export",): {"dtype": "groundtune.deploy.export:export"},
    ("serve",): {name: "groundtune.deploy.serve:serve" for name in ("host", "port", "max_new_tokens", "device", "compile")},
    ("studio",): {name: "groundtune.studio.app:studio" for name in ("workdir", "host", "port", "token")},
    ("quickstart",): {name: "groundtune.quickstart:quickstart" for name in ("out", "n_train", "n_eval")},
}


def _command(*names: str) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in names:  # "data", "synth": a command of a command
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    return parser


def _owner_default(owner: str, parameter: str):
    module, name = owner.split(":")
    return inspect.signature(getattr(importlib.import_module(module), name)).parameters[parameter].default


@pytest.mark.parametrize("command", OWNERS, ids=" ".join)
def test_a_flag_defaults_to_its_owners_default(command):
    flags = {action.dest: action for action in _command(*command)._actions}
    wrong = []
    for dest, owner in OWNERS[command].items():
        assert dest in flags, f"groundtune {' '.join(command)} has no flag for {dest}: update OWNERS"
        flag, ours, theirs = flags[dest].option_strings[0], flags[dest].default, _owner_default(owner, dest)
        if ours != theirs or type(ours) is not type(theirs):
            wrong.append(f"groundtune {' '.join(command)} {flag}: the command line's default {ours!r}, "
                         f"{owner}'s {dest}={theirs!r}")
    assert not wrong, "\n".join(wrong)
