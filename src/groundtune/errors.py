"""The errors a user can fix. The command line prints their message alone (exit 2); anything else
is a bug or a problem of the machine (out of GPU memory, a broken install) and keeps its traceback.

Each also derives from the built-in exception a Python caller would expect (a bad value is a
ValueError, a missing run folder a FileNotFoundError), so ``except ValueError`` keeps working.
"""

from __future__ import annotations


class GroundtuneError(Exception):
    """A problem with what the user gave (a setting, a file, a model name); the message says what
    and where, and what to do."""


class UsageError(GroundtuneError, ValueError):
    """A command line whose flags do not go together (a flag missing, two that exclude each other)."""


class ConfigError(GroundtuneError, ValueError):
    """A setting that is unknown, of the wrong type, or clashes with another; names the setting."""


class DataError(GroundtuneError, ValueError):
    """A bad input record or file. The message names the file and line and says what to do."""


class ModelError(GroundtuneError, ValueError):
    """A model that cannot be used: not a Qwen-VL model, an unknown architecture, a bad folder."""


class MissingError(GroundtuneError, FileNotFoundError):
    """Something the user named is not there: a model folder, a run, a checkpoint, a preset."""


class RunExistsError(GroundtuneError, FileExistsError):
    """A run folder that already holds a run."""


class RunBusyError(GroundtuneError, RuntimeError):
    """A run folder another live process is writing (its lock names the process)."""


class DiskFullError(GroundtuneError, OSError):
    """A write the disk (or a file-size limit) refused; the message says how much was needed, where."""


class MissingPackageError(GroundtuneError, ImportError):
    """An optional package a setting needs is not installed; the message gives the pip command."""


class TrainingError(GroundtuneError, RuntimeError):
    """A run that cannot go on (repeated non-finite losses, a setting this machine cannot run)."""


class UnsupportedVersionError(GroundtuneError, RuntimeError):
    """A library version groundtune's speed-ups were not tested on."""


class RankLostError(RuntimeError):
    """Another rank of a run launched on several processes stopped (crashed, killed, out of
    memory), so this one cannot go on. Not the user's mistake (exit 1), but the traceback of the
    broken connection says nothing the message does not: the failed rank's own output does."""


# --------------------------------------------------------------------------------------------
# A value an error message echoes


def shown(value, chars: int = 60) -> str:
    """``value`` as an error message echoes it: its repr when that is at most ``chars`` long, else
    the first ``chars`` characters of it, ``...`` and its size ("(5,000,000 characters)", "(a list
    of 9 items)"). Only the shown prefix is ever built: a YAML alias bomb's list (millions of items
    behind a few shared ones) or a phrase of 50 MB costs what its first characters cost."""
    pieces = list(_first(_pieces(value), chars + 1))
    text = "".join(pieces)
    if len(text) <= chars:
        return text
    return f"{text[:chars]}... ({_size(value)})"


def _first(pieces, chars: int):
    """The pieces of text until they hold ``chars`` characters."""
    taken = 0
    for piece in pieces:
        yield piece
        taken += len(piece)
        if taken >= chars:
            return


def _pieces(value):
    """repr(value), a piece at a time, so a caller can stop early."""
    if isinstance(value, str):
        yield repr(value[:200])[: -1 if len(value) > 200 else None]  # a long one is cut: no closing quote
    elif isinstance(value, dict):
        yield "{"
        for i, (key, item) in enumerate(value.items()):
            if i:
                yield ", "
            yield from _pieces(key)
            yield ": "
            yield from _pieces(item)
        yield "}"
    elif isinstance(value, (list, tuple)):
        yield "[" if isinstance(value, list) else "("
        for i, item in enumerate(value):
            if i:
                yield ", "
            yield from _pieces(item)
        yield "]" if isinstance(value, list) else ("," if len(value) == 1 else "") + ")"
    else:
        yield repr(value)[:200]


def _size(value) -> str:
    if isinstance(value, str):
        return f"{len(value):,} characters"
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value):,} item{'s' * (len(value) != 1)}"
    if isinstance(value, dict):
        return f"a mapping of {len(value):,} key{'s' * (len(value) != 1)}"
    return f"a {type(value).__name__}"


MESSAGE_CHARS = 1000  # the longest line an error prints (the command line cuts any longer one)


def cut(message: str, chars: int = MESSAGE_CHARS) -> str:
    """``message`` with each line cut to ``chars`` characters, saying how long it was: the command
    line's last guard, behind the values each message cuts itself (``shown``)."""
    return "\n".join(line if len(line) <= chars else f"{line[:chars - 40]}... [cut: {len(line):,} characters]"
                     for line in message.splitlines() or [""])
