"""The canonical sample and its JSONL file: reading with line numbers, writing atomically.

One referring expression per line (design.md, "Canonical sample")::

    {"id": "refcoco-val-0", "image": "images/x.jpg", "width": 640, "height": 427,
     "phrase": "the lady with the blue shirt", "bbox": [103.9, 92.5, 231.2, 410.0],
     "split": "val", "source": "refcoco"}

``bbox`` is xyxy in absolute pixels of the original image; a phrase with several targets uses
``bboxes``. ``image`` is relative to the JSONL file's folder, or absolute. Extra fields pass through.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterable, Iterator

REQUIRED_FIELDS = ("id", "image", "width", "height", "phrase")
_UMASK = os.umask(0)
os.umask(_UMASK)


class DataError(ValueError):
    """A bad input record or file. The message names the file and line and says what to do."""


@dataclass
class Line:
    """One line of a JSONL file: its 1-based number and either the decoded record or the error."""

    number: int
    record: dict | None
    error: str | None = None


def iter_jsonl(path: str | Path) -> Iterator[Line]:
    """Yield every non-blank line of a JSONL file; a line that is not a JSON object is yielded
    with ``error`` set instead of raising, so checks can count it and go on."""
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as e:
                yield Line(number, None, f"not valid JSON ({e.msg} at column {e.colno})")
                continue
            if not isinstance(record, dict):
                yield Line(number, None, f"a JSON {type(record).__name__}, not an object")
                continue
            yield Line(number, record)


def read_samples(path: str | Path) -> list[dict]:
    """Every record of a canonical JSONL file; the first bad line raises, naming file and line."""
    samples = []
    for line in iter_jsonl(path):
        if line.error:
            raise DataError(f"{path}:{line.number}: {line.error}; run `groundtune data check {path}`")
        missing = [k for k in REQUIRED_FIELDS if k not in line.record]
        if "bbox" not in line.record and "bboxes" not in line.record:
            missing.append("bbox")
        if missing:
            raise DataError(
                f"{path}:{line.number}: missing field(s) {', '.join(missing)}; "
                f"convert the file with `groundtune data convert --from jsonl`"
            )
        samples.append(line.record)
    return samples


def sample_boxes(sample: dict) -> list[list[float]]:
    """The target boxes of a sample (``bbox`` or ``bboxes``), canonical xyxy original pixels."""
    if "bboxes" in sample:
        return [list(map(float, b)) for b in sample["bboxes"]]
    return [list(map(float, sample["bbox"]))]


def image_path(sample: dict, jsonl_path: str | Path) -> Path:
    """Absolute path of a sample's image: relative paths are relative to the JSONL file's folder."""
    p = Path(sample["image"])
    return p if p.is_absolute() else Path(jsonl_path).resolve().parent / p


@contextlib.contextmanager
def atomic_write(path: str | Path, mode: str = "w") -> Iterator[IO]:
    """Write to a temporary file beside ``path`` and rename it into place only on success, so a
    crash or kill never leaves a half-written file where a finished one is expected."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600 files; finished files get the usual mode
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def dumps_sample(sample: dict) -> str:
    return json.dumps(sample, ensure_ascii=False, separators=(", ", ": "))


def write_samples(path: str | Path, samples: Iterable[dict]) -> int:
    """Write records as JSONL atomically; returns how many were written."""
    n = 0
    with atomic_write(path) as f:
        for sample in samples:
            f.write(dumps_sample(sample) + "\n")
            n += 1
    return n
