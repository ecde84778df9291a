"""The command line: an explicit table of commands, each calling one Python function.

    groundtune data convert|check|show|synth|refgen
    groundtune plan | train | rl | eval | predict | export | serve | studio | quickstart

Each handler only turns flags into arguments; the work is in the function it calls, which is
what Python users call too. Imports are inside handlers so `groundtune --help` starts fast.
A module per command group: data.py (data ...), training.py (plan, train, rl, quickstart),
answers.py (eval, predict), deploy.py (export, serve), studio.py (studio); flags.py holds what
their flags share.
This module is the table of commands and ``main``.

A mistake of the user's (a groundtune error: a bad setting, file, record or model name) is one
line on stderr and exit code 2; anything else (a bug, CUDA out of memory, a broken install) keeps
its traceback and exits 1. ``groundtune --debug COMMAND`` shows the traceback of every error.
No line of an error is over 1,000 characters (errors.cut): each message cuts the values it echoes
(errors.shown), and what one misses is cut here.
A reader that closes stdout early (``| head``) ends the command quietly, exit code 141, as it
ends cat.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from groundtune.cli import answers, data, deploy, studio, training
from groundtune.cli.flags import Formatter
from groundtune.errors import GroundtuneError, RankLostError, cut


class _Parser(argparse.ArgumentParser):
    """argparse, with a mistake on the command line said as every other user mistake is: one line,
    ``error: ...``, exit 2 (argparse prints the whole usage first, several lines for most commands)."""

    def error(self, message: str):
        self.exit(2, cut(f"error: {self.prog}: {message} (see {self.prog} --help)") + "\n")


# --------------------------------------------------------------------------------------------
# The table

COMMANDS = {
    "data": data.add_data,
    "plan": training.add_plan,
    "train": training.add_train,
    "rl": training.add_rl,
    "eval": answers.add_eval,
    "predict": answers.add_predict,
    "export": deploy.add_export,
    "serve": deploy.add_serve,
    "studio": studio.add_studio,
    "quickstart": training.add_quickstart,
}


# The commands that run a model (and `data refgen --filter-model`): torch's threads are set to the
# cores this process may use before they start (cores.py); the others never import torch.
MODEL_COMMANDS = {"train", "rl", "eval", "predict", "export", "serve", "quickstart"}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="groundtune",
        description="Fine-tune Qwen-VL models for visual grounding: image + phrase -> bounding box.",
        formatter_class=Formatter,
    )
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of every error, the user's mistakes included")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS.values():
        add(sub)
    return parser


# Errors that name what the user gave, whoever raised them: a file or folder that is not there or
# cannot be read (their message holds the path).
_USER_OS_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            return _run(argv)
        finally:  # --help's text too: it is still buffered when argparse exits
            sys.stdout.flush()  # here, where a closed pipe is caught, not at exit, where it is not
    except BrokenPipeError:
        return _reader_gone()


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    # the command line's own bars say what is loading; transformers' draw one per weight file
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from groundtune import cores
    from groundtune.progress import progress_every, quiet_libraries

    quiet_libraries()
    cores.before_torch()
    try:
        progress_every()  # a wrong GROUNDTUNE_PROGRESS_EVERY said now, not when the first loop starts
        if args.command in MODEL_COMMANDS or getattr(args, "filter_model", None):
            cores.use_cores()
        return args.handler(args)
    except BrokenPipeError:
        raise  # the reader went away: nothing went wrong (main)
    except (GroundtuneError, *_USER_OS_ERRORS) as e:
        if args.debug:
            traceback.print_exc()
        print(cut(f"error: {e}"), file=sys.stderr)  # a value a message echoes whole stops here
        return 2
    except RankLostError as e:  # the rank that failed first printed why
        print(cut(f"error: {e}"), file=sys.stderr)
        return 1
    except Exception as e:  # a bug or the machine: the traceback is what a report needs
        traceback.print_exc()
        print(f"\nerror: {type(e).__name__} (above). {_hint(e)}", file=sys.stderr)
        return 1


def _reader_gone() -> int:
    """The reader of stdout closed it (``groundtune plan --json | head -c 600``): end quietly, as
    cat does, with the status a shell gives a command SIGPIPE ended (128 + 13). What is still
    buffered goes to /dev/null, or Python's flush at exit would report the same closed pipe."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):  # not a file (a caller's stream): nothing is flushed at exit
        return 141
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
    return 141


def _hint(error: Exception) -> str:
    import torch

    if isinstance(error, torch.OutOfMemoryError):
        return ("Out of GPU memory: lower batch_size (or eval_batch_size / --batch-size), max_pixels, or set "
                "gradient_checkpointing=-1; the presets in configs/ are measured for 24 GB cards.")
    return "This is not a known mistake in the input; please report it with the command and the traceback."


if __name__ == "__main__":
    sys.exit(main())
