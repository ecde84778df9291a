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
