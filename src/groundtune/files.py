"""The user's files: what a command may read, and what it may write over.

- Reading: a path a command opens must be a regular file (or a link to one). A FIFO would block
  the open forever, a device could be read without end, a socket cannot be read at all: each is
  refused before it is opened, naming the path.
- Writing: a command never writes over its own input. An output file (``--out``, ``--fix-out``,
  ``--draw``) is refused when it is one of the files the command reads (the same file by another
  name included: a link, ``./x`` for ``x``); an output folder (``export --out``, a run's
  ``out_dir``) is refused when it is, holds or lies inside a file or folder the command reads.
  What an existing output folder may be replaced with is the command's own rule (export.py: only a
  previous export; train/loop.py: only a previous run).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from groundtune.errors import DataError, UsageError


def cache_dir() -> Path:
    """Where groundtune keeps what it can make again (image probes, converted hub data sets):
    ``$GROUNDTUNE_CACHE``, else ~/.cache/groundtune."""
    return Path(os.environ.get("GROUNDTUNE_CACHE") or Path.home() / ".cache" / "groundtune")


def regular_file(path: str | Path, what: str = "file") -> Path:
    """``path`` when it names a regular file; a DataError naming it when it is a FIFO, a socket or a
    device (``what`` says what the command wanted there: "image", "JSONL file"). A missing path is
    a FileNotFoundError, as ``open`` would raise; a folder passes (the caller says what to do)."""
    path = Path(path)
    mode = os.stat(path).st_mode  # follows links: a link to a FIFO is a FIFO
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
        raise DataError(f"{path}: {kind}, not a regular file; give the {what} itself")
    return path


def _same(a: Path, b: Path) -> bool:
    """Whether two paths name one file or folder (links and hard links included)."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them is not there yet: compare what they would resolve to
        return a.resolve() == b.resolve()


def relation(out: str | Path, other: str | Path) -> str | None:
    """How ``out`` stands to ``other``: "is", "holds" (``other`` lies inside it), "lies inside", or
    None when they are apart. Links are followed, so two spellings of one place are one place."""
    out, other = Path(out), Path(other)
    if _same(out, other):
        return "is"
    out_real, other_real = out.resolve(), other.resolve()
    if other_real.is_relative_to(out_real):
        return "holds"
    if out_real.is_relative_to(other_real):
        return "lies inside"
    return None


def not_an_input(out: str | Path, flag: str, inputs: dict[str, str | Path | None], folder: bool = False) -> Path:
    """``out`` (the value of ``flag``: "--out", or a setting as "out_dir="), refused with a UsageError
    naming both when it would write over one of ``inputs`` (what the command reads, by the flag or
    setting that names it; None: not given): an output FILE that is an input; an output FOLDER that
    is, holds or lies inside one. A file output inside an input folder is fine (a JSONL written
    beside the images it names)."""
    out = Path(out)
    given_as = f"{flag}{out}" if flag.endswith("=") else f"{flag} {out}"
    for name, given in inputs.items():
        if given is None or given == "":
            continue
        how = relation(out, given)
        if how == "is" or (folder and how is not None):
            why = {"is": "writing it would destroy what the command reads",
                   "holds": "an output folder must not hold what the command reads (replaced, it would take it along)",
                   "lies inside": "an output must not be written inside what the command reads"}[how]
            raise UsageError(f"{given_as} {how} {name} ({given}): {why}; choose another {flag.rstrip('=')}")
    return out
