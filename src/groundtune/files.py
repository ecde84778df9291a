"""The user's files: what a command may read, and what it may write over.

- Reading: a path a command opens must be a regular file (or a link to one). A FIFO would block
  the open forever, a device could be read without end, a socket cannot be read at all: each is
  refused before it is opened, naming the path. A path no file can have (a NUL byte, a name over
  255 bytes) is said as such (``path_problem``), not left to the OS call that chokes on it; a file
  that is not UTF-8 is named with the line and byte offset where it stops being so (``not_utf8``).
- Writing: a command never writes over its own input. An output file (``--out``, ``--fix-out``,
  ``--draw``, each file of ``eval --gallery``) is refused when it is one of the files the command
  reads (the same file by another name included: a link, ``./x`` for ``x``); an output folder
  (``export --out``, a run's ``out_dir``) is refused when it is, holds or lies inside a file or
  folder the command reads.
  What an existing output folder may be replaced with is the command's own rule (export.py: only a
  previous export; train/loop.py: only a previous run). An output file is never one of the files
  the command reads however it is named (``not_one_of``: an image of the data, a model's file), and
  an existing one is replaced only when the same command wrote it, or with ``--overwrite``
  (``output_file``).
"""

from __future__ import annotations

import codecs
import os
import stat
from pathlib import Path
from typing import Callable, Iterable

from groundtune.errors import DataError, GroundtuneError, UsageError, shown

# What Linux takes: a name (one part of a path) of at most 255 bytes, a path of at most 4,096
NAME_MAX, PATH_MAX = 255, 4096


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


def path_problem(path: str | Path) -> str | None:
    """Why no file can have the name ``path`` (None when one can): a NUL byte (every OS call
    refuses it, Python with a ValueError, not the OSError a missing file is), text that has no bytes
    (a lone surrogate of JSON's ``\\ud800``), a name over NAME_MAX or a path over PATH_MAX bytes."""
    try:
        raw = os.fsencode(path)
    except UnicodeEncodeError:
        return f"{shown(str(path))} is not text a file name can hold (a lone surrogate)"
    if b"\0" in raw:
        return f"{shown(str(path))} holds a NUL byte, which no file name can"
    if len(raw) > PATH_MAX or any(len(part) > NAME_MAX for part in raw.split(b"/")):
        return (f"{shown(str(path))} is longer than a file name can be (a path of at most {PATH_MAX:,} bytes, each "
                f"name at most {NAME_MAX})")
    return None


def not_utf8(path: str | Path, error: type[GroundtuneError] = DataError) -> GroundtuneError:
    """The error for a text file that is not UTF-8: ``PATH:LINE: not UTF-8 text (byte 0xE9 at
    byte offset N)``. Read again in binary for the place: a text reader's UnicodeDecodeError counts
    from the start of its own buffer, not of the file."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, line = 0, 1
    with open(path, "rb") as f:
        while chunk := f.read(2**20):
            pending = len(decoder.getstate()[0])  # bytes of a character cut by the last chunk's end
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                where = offset - pending + e.start
                line += chunk[:max(0, where - offset)].count(b"\n")
                return error(f"{path}:{line}: not UTF-8 text (byte 0x{e.object[e.start]:02X} at byte offset "
                             f"{where:,}); save the file as UTF-8")
            offset += len(chunk)
            line += chunk.count(b"\n")
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return error(f"{path}:{line}: not UTF-8 text (it ends inside a character, byte offset {offset:,}); save the "
                     "file as UTF-8")
    return error(f"{path}: not UTF-8 text; save the file as UTF-8")


def not_one_of(out: str | Path, flag: str, inputs: Iterable[tuple[str, str | Path]]) -> None:
    """A UsageError when the existing file ``out`` (the value of ``flag``) is one of ``inputs``
    ((what it is, path) pairs: "an image of --data", "a file of --model"), compared as files
    (device and inode: a link, a hard link, another spelling are the same file). An ``out`` not
    there yet is none of them."""
    try:
        mine = os.stat(out)
    except (OSError, ValueError):
        return
    for what, path in inputs:
        try:
            theirs = os.stat(path)
        except (OSError, ValueError):
            continue
        if (theirs.st_dev, theirs.st_ino) == (mine.st_dev, mine.st_ino):
            raise UsageError(f"{flag} {out} is {what} ({path}): writing it would destroy what the command reads; "
                             f"choose another {flag}")


def output_file(out: str | Path, flag: str, command: str, reads: Iterable[tuple[str, str | Path]],
                written_by_it: Callable[[Path], bool], overwrite: bool) -> Path:
    """``out`` when ``command`` may write its file there: nothing is there (or an empty file), or
    what is there is a previous output of the same command (``written_by_it``), or ``overwrite``
    says to replace it, and in no case one of the files the command reads (``reads``: ``not_one_of``;
    its data file, named by its flag, is ``not_an_input``'s). A folder, a FIFO, another file: refused,
    naming it and the way out."""
    out = Path(out)
    if not os.path.lexists(out):
        return out
    if out.is_dir():
        raise UsageError(f"{flag} {out} is a folder; name the file to write")
    regular_file(out, f"{flag} file")
    if out.stat().st_size and written_by_it(out):  # what the command reads is never its own output
        return out
    not_one_of(out, flag, reads)
    if out.stat().st_size and not overwrite:
        raise UsageError(f"{flag} {out} exists and was not written by `groundtune {command}`: it would be replaced; "
                         f"choose another {flag}, or give --overwrite to replace it")
    return out
