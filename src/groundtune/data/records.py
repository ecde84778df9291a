"""The canonical sample and its JSONL file: reading with line numbers, writing atomically.

One referring expression per line (design.md, "Canonical sample")::

    {"id": "refcoco-val-0", "image": "images/x.jpg", "width": 640, "height": 427,
     "phrase": "the lady with the blue shirt", "bbox": [103.9, 92.5, 231.2, 410.0],
     "split": "val", "source": "refcoco"}

``bbox`` is xyxy in absolute pixels of the original image; a phrase with several targets uses
``bboxes``, and ``"bboxes": []`` is a phrase with no target in its image (explicit: a record with
neither field is incomplete, never "no target"). ``image`` is relative to the JSONL file's folder,
or absolute. Extra fields pass through.

What a file may hold is bounded before anything costs memory or time: a line of at most
MAX_LINE_CHARS characters nested at most MAX_JSON_DEPTH deep, a phrase of at most
MAX_PHRASE_CHARS (the server's limit too: deploy/limits.py reads it here), an image path a file
can have (``record_problem``); a file that is not UTF-8 is named with line and byte offset.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable, Iterable, Iterator

from groundtune.boxes import as_box
from groundtune.errors import DataError, shown
from groundtune.files import not_utf8, path_problem, regular_file

# What a canonical record must have (design.md); "bbox" stands for "bbox or bboxes".
REQUIRED_FIELDS = ("id", "image", "width", "height", "phrase", "bbox")
# Data paths that name no local file, by prefix, and what makes each a local JSONL file. Records
# imports none of them: groundtune.data (the package) registers ``hf:`` (data/hub.py), which
# writes its records through this module, so an import of it from here would close a circle.
REMOTE_DATA: dict[str, Callable[[str], Path]] = {}
# The longest phrase a record (and a request to the server: deploy/limits.py) may have. A referring
# expression is a few words (RefCOCOg's longest: ~50); a 5 MB one made `predict` ask for a 25 GB
# KV cache, and every prompt the model reads costs memory by its length.
MAX_PHRASE_CHARS = 500
# A canonical record nests 4 deep (a record's objects, a box): far deeper is no record, and Python's
# JSON reader raises RecursionError past ~1,000 levels.
MAX_JSON_DEPTH = 64
# A record is a few hundred bytes (refgen's, with every box of its image, a few KB): a longer line
# is read no further than this, so a file without newlines costs no more memory than this.
MAX_LINE_CHARS = 16 * 2**20

__all__ = ["DataError", "REQUIRED_FIELDS", "REMOTE_DATA", "MAX_PHRASE_CHARS", "MAX_JSON_DEPTH", "MAX_LINE_CHARS",
           "Line", "jsonl_file", "iter_jsonl", "read_samples", "missing_fields", "box_problem", "record_problem",
           "phrase_too_long", "record_size", "sample_boxes", "image_path", "named_images", "first_record",
           "derived_from", "atomic_write", "dumps_sample", "write_samples"]


@dataclass
class Line:
    """One line of a JSONL file: its 1-based number and either the decoded record or the error."""

    number: int
    record: dict | None
    error: str | None = None


def jsonl_file(path: str | Path) -> Path:
    """``path`` as a data file to read, or a DataError saying what it is instead (a folder, nothing).
    THE place a data path becomes a file: ``hf:REPO:SPLIT`` (a data set of the Hugging Face Hub)
    becomes its converted copy in the cache here (data/hub.py, through ``REMOTE_DATA``), for every
    command that reads data."""
    for prefix, local_copy in REMOTE_DATA.items():
        if str(path).startswith(prefix):
            return local_copy(str(path))
    path = Path(path)
    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.jsonl"))[:5]
        hint = f" (it holds {', '.join(inside)})" if inside else ""
        raise DataError(f"{path} is a folder; give a JSONL file{hint}")
    if not path.exists():
        raise DataError(f"{path}: no such file")
    return regular_file(path, "JSONL file")


def iter_jsonl(path: str | Path) -> Iterator[Line]:
    """Yield every non-blank line of a JSONL file; a line that is not a JSON object (or longer than
    MAX_LINE_CHARS, or nested deeper than MAX_JSON_DEPTH) is yielded with ``error`` set instead of
    raising, so checks can count it and go on. A byte-order mark (which Windows editors write) is
    read as one, not as text that breaks the first line. A file that is not UTF-8 raises a
    DataError naming the line and byte offset (``files.not_utf8``)."""
    file = jsonl_file(path)
    with open(file, encoding="utf-8-sig") as f:
        number = 0
        while True:
            try:
                text = f.readline(MAX_LINE_CHARS + 1)
            except UnicodeDecodeError:
                raise not_utf8(file) from None
            if not text:
                return
            number += 1
            if len(text) > MAX_LINE_CHARS:
                while text and not text.endswith("\n"):  # the rest of the line, read and dropped
                    text = f.readline(MAX_LINE_CHARS)
                yield Line(number, None, f"a line longer than {MAX_LINE_CHARS:,} characters: no record is that long")
            elif text.strip():
                yield _decoded(number, text)


def _decoded(number: int, text: str) -> Line:
    """One non-blank line as a record, or with ``error`` saying why it is none."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        return Line(number, None, f"not valid JSON ({e.msg} at column {e.colno})")
    except RecursionError:  # nested past what Python's reader goes (~1,000 levels)
        return Line(number, None, f"nested deeper than {MAX_JSON_DEPTH} levels (a record nests 4)")
    if not isinstance(record, dict):
        return Line(number, None, f"a JSON {type(record).__name__}, not an object")
    # counting brackets is cheap; only a line with many is walked for its depth
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and _depth(record) > MAX_JSON_DEPTH:
        return Line(number, None, f"nested deeper than {MAX_JSON_DEPTH} levels (a record nests 4)")
    return Line(number, record)


def _depth(value) -> int:
    """How deep lists and objects nest in ``value`` (a number: 0, [1]: 1), walked without recursion
    and no further than MAX_JSON_DEPTH + 1."""
    deepest, todo = 0, [(value, 0)]
    while todo and deepest <= MAX_JSON_DEPTH:
        item, depth = todo.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, depth + 1)
            todo.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def read_samples(path: str | Path) -> list[dict]:
    """Every record of a canonical JSONL file; the first bad line raises, naming file and line: not
    JSON, a field missing, or boxes that are not boxes (``box_problem``), so no later step meets a
    box it cannot read (whether the boxes are right is ``groundtune data check``'s)."""
    samples = []
    for line in iter_jsonl(path):
        if line.error:
            raise DataError(f"{path}:{line.number}: {line.error}; run `groundtune data check {path}`")
        missing = missing_fields(line.record)
        if missing:
            raise DataError(
                f"{path}:{line.number}: missing field(s) {', '.join(missing)}; "
                f"convert the file with `groundtune data convert --from jsonl`"
            )
        problem = box_problem(line.record) or record_problem(line.record)
        if problem:
            raise DataError(f"{path}:{line.number}: {problem}; run `groundtune data check {path}`")
        samples.append(line.record)
    return samples


def record_problem(record: dict) -> str | None:
    """What no command can use in a record whose fields are there, or None: an image path no file
    can have (a NUL byte, a name too long: ``files.path_problem``), a phrase longer than
    MAX_PHRASE_CHARS. The one rule for eval, predict, convert and refgen, which refuse the line,
    and `data check` (and train), which count it (image_not_a_file, phrase_too_long)."""
    image = record.get("image")
    problem = path_problem(image) if isinstance(image, str) else None
    if problem:
        return f"image {problem}"
    phrase = record.get("phrase")
    if isinstance(phrase, str) and len(phrase) > MAX_PHRASE_CHARS:
        return phrase_too_long(phrase)
    return None


def phrase_too_long(phrase: str) -> str:
    return (f"phrase {shown(phrase, 40)} is longer than {MAX_PHRASE_CHARS} characters, the most a phrase may be (a "
            "referring expression is a few words)")


def missing_fields(record: dict, fields: Iterable[str] = REQUIRED_FIELDS) -> list[str]:
    """Which of ``fields`` a record lacks: absent or null; an image that is not a non-empty path; a
    width/height that is not a positive whole number; ``bbox`` when it has neither a ``bbox`` nor a
    ``bboxes`` (``"bboxes": []``, no target, has one). The one rule of "has what it needs" for
    reading, checking and converting (whether the values are right is ``groundtune data check``'s:
    data/check.py)."""
    missing = []
    for name in fields:
        if name == "bbox":
            absent = record.get("bboxes") is None and record.get("bbox") is None
        elif name == "image":
            absent = not (isinstance(record.get("image"), str) and record["image"])
        elif name in ("width", "height"):
            absent = _positive_int(record.get(name)) is None
        else:
            absent = record.get(name) is None
        if absent:
            missing.append(name)
    return missing


def box_problem(record: dict) -> str | None:
    """What is wrong with the shape of a record's boxes, or None: ``bboxes`` (where given) must be a
    list of boxes (``[]``: no target), ``bbox`` otherwise a box, a box being four finite numbers
    (``boxes.as_box``). The shape alone: whether a box has an area and lies inside its image is
    ``groundtune data check``'s, which reports all of these as ``bbox_nan``."""
    def shown(value) -> str:
        text = json.dumps(value, ensure_ascii=False)
        return text if len(text) <= 60 else text[:57] + "..."

    if record.get("bboxes") is not None:
        if not isinstance(record["bboxes"], list):
            return f"bboxes is {shown(record['bboxes'])}, not a list of boxes [[x1, y1, x2, y2], ...]"
        for k, box in enumerate(record["bboxes"]):
            if as_box(box) is None:
                return f"bboxes[{k}] is {shown(box)}, not a box: four finite numbers [x1, y1, x2, y2]"
        return None
    if record.get("bbox") is not None and as_box(record["bbox"]) is None:
        return f"bbox is {shown(record['bbox'])}, not a box: four finite numbers [x1, y1, x2, y2]"
    return None


def record_size(record: dict) -> tuple[int, int] | None:
    """The (width, height) a record gives its image, when both are positive whole numbers (640 or
    640.0), else None."""
    width, height = _positive_int(record.get("width")), _positive_int(record.get("height"))
    return (width, height) if width is not None and height is not None else None


def _positive_int(value) -> int | None:
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
          and value == int(value))
    return int(value) if ok else None


def sample_boxes(sample: dict) -> list[list[float]]:
    """The target boxes of a sample (``bbox`` or ``bboxes``), canonical xyxy original pixels; none
    for a no-target record (``"bboxes": []``)."""
    if sample.get("bboxes") is not None:
        return [list(map(float, b)) for b in sample["bboxes"]]
    return [list(map(float, sample["bbox"]))]


def image_path(sample: dict, jsonl_path: str | Path) -> Path:
    """Absolute path of a sample's image: relative paths are relative to the JSONL file's folder."""
    p = Path(sample["image"])
    return p if p.is_absolute() else Path(jsonl_path).resolve().parent / p


def named_images(path: str | Path, what: str) -> Iterator[tuple[str, Path]]:
    """(``what``, image) for every record of the JSONL file ``path`` that names an image: what no
    output of a command reading ``path`` may be (``files.output_file``'s ``reads``)."""
    for line in iter_jsonl(path):
        if line.record is not None and isinstance(line.record.get("image"), str):
            yield what, image_path(line.record, path)


def first_record(path: str | Path) -> dict | None:
    """The first line of ``path`` as a record; None when it is none (not UTF-8, not a JSON object,
    longer than MAX_LINE_CHARS, unreadable): what says which command wrote a JSONL file."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            text = f.readline(MAX_LINE_CHARS + 1)
    except (OSError, ValueError):  # ValueError: not UTF-8
        return None
    return _decoded(1, text).record if text.strip() and len(text) <= MAX_LINE_CHARS else None


def derived_from(out: str | Path, data: str | Path) -> bool:
    """Whether the first record of ``out`` is one of ``data``'s (the same id): a file a command
    wrote from ``data``'s records (``data check --fix-out``, ``data convert --from jsonl``), which
    the next such command may replace. A file of other records is someone else's."""
    first = first_record(out)
    if first is None or first.get("id") is None:
        return False
    try:
        return any(line.record is not None and line.record.get("id") is not None
                   and str(line.record["id"]) == str(first["id"]) for line in iter_jsonl(data))
    except DataError:  # not UTF-8, no such file: nothing of it can be in ``out``
        return False


@contextlib.contextmanager
def atomic_write(path: str | Path, mode: str = "w") -> Iterator[IO]:
    """Write to a temporary file beside ``path`` and rename it into place only on success, so a
    crash or kill never leaves a half-written file where a finished one is expected."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        # "x": a new file, with the usual mode (the umask's), never an existing one
        with open(tmp, mode.replace("w", "x"), **({} if "b" in mode else {"encoding": "utf-8"})) as f:
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
