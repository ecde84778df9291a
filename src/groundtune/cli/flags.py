"""What several commands' flags share: the help formatter, argument types, the --model help, the
files a model flag names (which no output may be), and the flags of InferSettings fields (one
definition each, read by every command that takes them)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action):  # no "(default: None)": such a help says what happens unset
        return action.help if action.default is None else super()._get_help_string(action)


def int_at_least(minimum: int, name: str):
    """An argparse type: an integer of at least ``minimum``; argparse names it by ``name`` ("invalid
    positive integer value: 'x'")."""
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = name
    return parse


positive_int = int_at_least(1, "positive integer")
count = int_at_least(0, "count")
canvas_side = int_at_least(8, "canvas side")  # synth draws shapes of a few pixels at least


def port(text: str) -> int:
    """An argparse type: a TCP port, 1 to 65535 (serve's and studio's --port)."""
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be from 1 to 65535, got {value}")
    return value


def canvas_range(text: str) -> tuple[int, int]:
    """An argparse type: ``MIN-MAX`` canvas sides (synth.parse_canvas)."""
    from groundtune.data.synth import parse_canvas

    try:
        return parse_canvas(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# --overwrite of the commands that write one file: without it only a previous output of the same
# command (or an empty file) is replaced; with it any file but what the command reads
OVERWRITE_HELP = ("replace an existing {what} that this command did not write (one it wrote is replaced anyway); "
                  "never a file the command reads")

MODEL_HELP = (
    "the model: `tiny` (the built-in tiny model), a training run folder, a local Hugging Face "
    "folder (an export included) or a hub id such as Qwen/Qwen2.5-VL-3B-Instruct"
)


def model_files(*models: tuple[str, str | None]) -> list[tuple[str, Path]]:
    """The files loading each model reads ((flag, name) pairs; a name None is none): a folder's, a
    run's model/, the built-in tiny model's. No output may be one of them (``files.output_file``)."""
    from groundtune.models.loading import resolve
    from groundtune.runs import RunFolder

    files = []
    for flag, name in models:
        if name is None:
            continue
        kind, path = resolve(name)  # a missing model is said here, before anything is read
        folder = RunFolder(path).model if kind == "run" else path  # a hub model's cache: not ours to guard
        if folder is not None:
            files += [(f"a file of {flag} {name}", p) for p in sorted(folder.rglob("*"))[:10_000] if p.is_file()]
    return files


def infer_flag(p: argparse.ArgumentParser, name: str, when: str = "") -> None:
    """The flag of the InferSettings field ``name`` (--batch-size for batch_size), with the field's
    default and help; ``when`` opens the help of a flag that acts only with another. From
    config.py, not infer.py: that imports torch, and --help stays quick."""
    from groundtune.config import InferSettings

    f = next(f for f in dataclasses.fields(InferSettings) if f.name == name)
    if isinstance(f.default, bool):  # a switch (--compile)
        p.add_argument("--" + name.replace("_", "-"), action="store_true", help=when + f.metadata["help"])
        return
    p.add_argument("--" + name.replace("_", "-"), type=positive_int if isinstance(f.default, int) else str,
                   default=f.default, help=when + f.metadata["help"])

