"""The command line's error policy: a user's mistake is one line and exit 2; anything else keeps
its traceback (exit 1), CUDA out-of-memory with what to change; --debug shows every traceback.
And the speed-ups refuse a transformers they were not tested on, instead of breaking quietly.
The commands run the CLI's `main()` in this process (tests/cli_in_process.py); importing
groundtune is checked in a fresh interpreter, the only place an import's side effects show."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from cli_in_process import groundtune

from groundtune import cli
from groundtune.errors import UnsupportedVersionError, cut, shown
from groundtune.models import qwen, speedups


def _run(*args: str) -> subprocess.CompletedProcess:
    return groundtune(*args)  # the CLI's main() in this process (tests/cli_in_process.py)


def test_a_users_mistake_is_one_line_and_exit_2():
    done = _run("train", "quickstart", "train_data=synth:full", "kernels=fast")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: kernels='fast'")
    done = _run("--debug", "train", "quickstart", "train_data=synth:full", "kernels=fast")
    assert done.returncode == 2 and "Traceback" in done.stderr and "ConfigError" in done.stderr


@pytest.mark.parametrize("error, said", [
    (RuntimeError("an internal bug"), ["RuntimeError: an internal bug", "please report it"]),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), ["CUDA out of memory", "lower batch_size"]),
])
def test_an_unexpected_error_keeps_its_traceback(error, said, monkeypatch, capsys):
    def broken(args):
        raise error

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: _with_handler(parser, broken))
    assert cli.main(["data", "check", "x.jsonl"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and all(text in err for text in said)


def _with_handler(parser, handler):
    """The real parser, its `data check` command answering with ``handler`` (the error under test)."""
    for action in parser._subparsers._group_actions:
        data = action.choices["data"]
        for sub in data._subparsers._group_actions:
            sub.choices["check"].set_defaults(handler=handler)
    return parser


def test_a_value_an_error_echoes_is_its_first_characters_and_its_size():
    """Only the shown prefix is ever made: a YAML alias bomb's 9**9 values print as 60 characters."""
    bomb = ["x"] * 9
    for _ in range(8):
        bomb = [bomb] * 9
    assert shown(bomb) == "[[[[[[[[['x', 'x', 'x', 'x', 'x', 'x', 'x', 'x', 'x'], ['x',... (a list of 9 items)"
    assert shown("fast") == "'fast'" and shown(0.5) == "0.5" and shown((1,)) == "(1,)"
    assert shown({"a": [1]}) == "{'a': [1]}"
    assert shown("x" * 5_000_000) == "'" + "x" * 59 + "... (5,000,000 characters)"
    itself = []
    itself.append(itself)
    assert shown(itself).endswith("... (a list of 1 item)")


def test_no_line_of_an_error_is_over_1000_characters(monkeypatch, capsys):
    """The command line's last guard, behind each message's own cuts."""
    from groundtune.errors import DataError

    def long(args):
        raise DataError("x" * 5_000_000)

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: _with_handler(parser, long))
    assert cli.main(["data", "check", "x.jsonl"]) == 2
    err = capsys.readouterr().err
    assert err == "error: " + "x" * 953 + "... [cut: 5,000,007 characters]\n" and len(err) < 1000
    assert cut("short\n" + "y" * 2000).splitlines() == ["short", "y" * 960 + "... [cut: 2,000 characters]"]


def test_speedups_refuse_an_untested_transformers():
    speedups.check_transformers("5.17.0")
    speedups.check_transformers(speedups.TESTED_TRANSFORMERS[0])
    for version in ("4.57.1", "5.16.2", "6.0.0"):
        with pytest.raises(UnsupportedVersionError, match=f"transformers {version}: .*pip install"):
            speedups.check_transformers(version)


def test_speedups_check_what_they_replace_is_there():
    for family in qwen.FAMILIES.values():
        speedups.check_family_code(family)  # the real classes of this transformers
    renamed = dataclasses.replace(qwen.family("qwen2.5-vl"), vision_attention="Qwen2_5_VLVisionAttentionV2")
    with pytest.raises(UnsupportedVersionError, match="has no Qwen2_5_VLVisionAttentionV2"):
        speedups.check_family_code(renamed)
    # a class whose forward no longer takes what our replacement takes
    other = dataclasses.replace(qwen.family("qwen2.5-vl"), vision_attention="Qwen2_5_VLMLP")
    with pytest.raises(UnsupportedVersionError, match="no longer takes hidden_states, cu_seqlens"):
        speedups.check_family_code(other)


def test_importing_groundtune_changes_no_library_setting():
    code = ("import transformers.utils.logging as l, os; before = (l.is_progress_bar_enabled(), os.umask(0o22)); "
            "os.umask(before[1]);"
            "import groundtune.cli, groundtune.train.sft, groundtune.train.rl, groundtune.evaluate, groundtune.infer;"
            "after = (l.is_progress_bar_enabled(), os.umask(0o22));"
            "from transformers import AttentionInterface;"
            "assert 'groundtune' not in AttentionInterface._global_mapping, 'attention registered on import';"
            "assert before == after, (before, after)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def _pipe_without_reader() -> tuple[int, int]:
    """A real pipe whose reader has gone (``| head -c 600`` after its 600 bytes, ``| true``): every
    write to it fails, whenever it comes. (A reader that reads a little first leaves a race: on this
    kernel a writer may still get its whole output into the pipe before the reader closes it.)"""
    r, w = os.pipe()
    os.close(r)
    return w


def test_a_reader_that_closes_the_pipe_early_ends_the_command_quietly(tmp_path):
    """`groundtune plan ... --json | head -c 600`: exit 141 and nothing on stderr, as cat, not a
    traceback asking for a bug report. A real process: Python's flush at exit is part of it."""
    w = _pipe_without_reader()
    done = subprocess.run([sys.executable, "-m", "groundtune", "plan", "qwen2.5-vl-7b-qlora", "--json"], stdout=w,
                          stderr=subprocess.PIPE, timeout=60)
    os.close(w)
    assert done.returncode == 141 and done.stderr == b""


def test_help_to_a_closed_pipe_ends_quietly(monkeypatch, capsys):
    """The same for --help (argparse's text is still buffered when it exits), in this process."""
    pipe = open(_pipe_without_reader(), "w", encoding="utf-8")
    monkeypatch.setattr(sys, "stdout", pipe)
    try:
        assert cli.main(["train", "--help"]) == 141
    finally:
        monkeypatch.undo()
        pipe.close()  # what it still held went to /dev/null: no error here either
    assert capsys.readouterr().err == ""
