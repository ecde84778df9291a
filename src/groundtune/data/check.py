"""`groundtune data check`: find every record that would train on a wrong box, with its line number.

Each problem has a kind. An **error** is a record that cannot be trained on as it is: it is left out
of ``--fix-out``. A **warning** is a record that is usable after an automatic fix: it is written to
``--fix-out`` with the fix applied, and the line is listed under ``fixed``. (A line with a warning
and an error is listed under both ``warnings`` and ``errors`` but not under ``fixed``: it is dropped.)

=====================  =======  ===================================================================
kind                   level    what it means and what to do
=====================  =======  ===================================================================
invalid_json           error    the line is not one JSON object; fix or delete the line
missing_field          error    no id, image, phrase or boxes (``bbox``, or ``bboxes``: a list of
                                boxes, ``[]`` for a phrase with no target in the image); add it, or
                                re-run ``groundtune data convert``
missing_size           warning  width/height missing or not a positive integer; filled in from the
                                stored pixels of the image
image_missing          error    no file at the image path (relative to the JSONL file's folder);
                                put the image there or fix ``image``
image_unreadable       error    the file does not decode to the end (corrupt, truncated, not an
                                image); re-download or re-encode it
image_not_a_file       error    the path is a folder, a FIFO, a socket or a device: never opened
                                (a FIFO would wait forever), or no file can have it (a NUL byte, a
                                name over 255 bytes); point ``image`` at the image file
size_mismatch          error    the decoded size disagrees with width/height and EXIF orientation
                                does not explain it; the boxes may be for another size of the image
exif_transposed        warning  the decoded size is width/height swapped and the EXIF orientation
                                explains it; the loader applies the EXIF rotation so the pixels
                                match the recorded size (nothing changes in the record)
bbox_nan               error    a box is not four finite numbers (NaN, inf, strings, wrong length),
                                or ``bboxes`` is not a list of boxes
bbox_empty             error    x2 <= x1 or y2 <= y1 and it is not an xywh box either
bbox_outside           error    the box goes more than 2 px past the image; check it was drawn on
                                this image at this size (not resized, not normalised to 0-1000)
bbox_clipped           warning  the box goes at most 2 px past the image; clipped to the image
bbox_looks_xywh        error    as xyxy the box is empty, but read as [x, y, w, h] it is a valid box
                                inside the image; convert the file's boxes with boxes.xywh_to_xyxy
phrase_empty           error    the phrase is empty, only whitespace, or not a string
phrase_too_long        error    longer than 500 characters (records.MAX_PHRASE_CHARS, the server's
                                limit too): a referring expression is a few words
phrase_html            warning  HTML tags (``<b>``) or entities (``&amp;``); tags stripped,
                                entities decoded
phrase_control_chars   warning  control characters (``\\x07``, tabs, newlines); removed (whitespace
                                ones become a space)
aspect_ratio           error    longer side / shorter side >= 200: smart_resize refuses the image;
                                crop or pad it, or drop the record
image_mode             warning  not 8-bit RGB (L, CMYK, RGBA/LA/P, 16-bit I;16/I, ...); converted to
                                RGB by images.to_rgb at load (nothing changes in the record)
=====================  =======  ===================================================================

Each distinct image is decoded once (in a thread pool: Pillow releases the GIL while decoding), in
full, so a truncated file is caught here and not in a data-loader worker in the middle of a run.
What decoding found is cached by the image's path, size and modification time (``ProbeCache``), so
checking a file again, or training on it after `data check`, reads only images that changed.

`groundtune train` and `groundtune rl` run the same checks before their first step
(``check_records``): with ``bad_records=refuse`` a file with errors stops the run before the model
loads, with this table; with ``bad_records=skip`` the run trains on the usable records.
"""

from __future__ import annotations

import html
import io
import json
import os
import re
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from stat import S_ISREG


from groundtune.boxes import MAX_RATIO, as_box, box_area, clip_box, has_area, xywh_to_xyxy
from groundtune.cores import cores
from groundtune.data.images import opened
from groundtune.data.records import (MAX_PHRASE_CHARS, image_path, iter_jsonl, jsonl_file, missing_fields,
                                     record_size, write_samples)
from groundtune.files import cache_dir, path_problem
from groundtune.progress import track

ERROR, WARNING = "error", "warning"

# kind -> (level, what the user should do). The order is the order of the report.
KINDS: dict[str, tuple[str, str]] = {
    "invalid_json": (ERROR, "Make the line one JSON object, or delete it."),
    "missing_field": (ERROR, "Add the missing id/image/phrase/bbox (bboxes: [] for no target), or re-run "
                             "`groundtune data convert`."),
    "missing_size": (WARNING, "width/height are filled in from the image in --fix-out."),
    "image_missing": (ERROR, "Put the image at the path given (relative to the JSONL folder) or fix `image`."),
    "image_unreadable": (ERROR, "The file is corrupt, truncated or not an image: re-download or re-encode it."),
    "image_not_a_file": (ERROR, "The path is a folder, FIFO, socket or device, or no file can have it (a NUL "
                                "byte, a name over 255 bytes): point `image` at the image file."),
    "size_mismatch": (ERROR, "The image's size disagrees with width/height: use the image the boxes were "
                             "drawn on, or fix width/height (and the boxes) in the record."),
    "exif_transposed": (WARNING, "Fine: the EXIF rotation is applied at load so the pixels match width/height."),
    "bbox_nan": (ERROR, "Each box must be four finite numbers [x1, y1, x2, y2] (bboxes: a list of them): fix or "
                        "drop the record."),
    "bbox_empty": (ERROR, "The box has no area (x2 <= x1 or y2 <= y1): fix or drop the record."),
    "bbox_outside": (ERROR, "The box goes > 2 px past the image: check it is in pixels of this image at "
                            "this size (not resized, not normalised to 0-1000)."),
    "bbox_clipped": (WARNING, "Within 2 px of the image: clipped to the image in --fix-out."),
    "bbox_looks_xywh": (ERROR, "The box reads as [x, y, w, h]: convert the file's boxes to xyxy with "
                               "groundtune.boxes.xywh_to_xyxy ([x, y, x + w, y + h])."),
    "phrase_empty": (ERROR, "Write the referring expression, or drop the record."),
    "phrase_too_long": (ERROR, f"Longer than {MAX_PHRASE_CHARS} characters: a referring expression is a few "
                               "words; shorten it, or drop the record."),
    "phrase_html": (WARNING, "HTML tags are stripped and entities decoded in --fix-out."),
    "phrase_control_chars": (WARNING, "Control characters are removed in --fix-out."),
    "aspect_ratio": (ERROR, f"Longer side >= {MAX_RATIO}x the shorter: smart_resize refuses it; crop or "
                            "pad the image, or drop the record."),
    "image_mode": (WARNING, "Fine: converted to 8-bit RGB at load (alpha over white, 16-bit scaled)."),
}

# A box may overshoot the image by this much and still be a rounding slip (annotation tools write
# the far edge as x + w, pixel centres vs edges, ...) rather than a box drawn on another image.
CLIP_TOLERANCE = 2.0

EXIF_ORIENTATION = 0x0112
_SWAPPING_ORIENTATIONS = {5, 6, 7, 8}  # the EXIF rotations that turn a WxH picture into HxW

_TAG = re.compile(r"</?[A-Za-z][^<>]*>")
_ENTITY = re.compile(r"&(?:#\d+|#x[0-9A-Fa-f]+|[A-Za-z]+);")
_CONTROL_SPACE = re.compile(r"[\t\n\r\v\f]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")

Finding = tuple[str, "dict | None"]  # (kind, the record with the fix applied; None for an error)


@dataclass(frozen=True)
class ImageInfo:
    """What decoding one image file told us; the pixels themselves are not kept."""

    error: str | None = None  # "image_missing", "image_unreadable" or "image_not_a_file"
    size: tuple[int, int] | None = None  # stored (width, height)
    mode: str | None = None
    transposed_size: tuple[int, int] | None = None  # (width, height) after its EXIF rotation, if it swaps


@dataclass
class CheckReport:
    """Line numbers (1-based, as an editor counts them) of every problem, by kind."""

    path: str
    lines: int = 0
    errors: dict[str, list[int]] = field(default_factory=dict)
    warnings: dict[str, list[int]] = field(default_factory=dict)
    fixed: dict[str, list[int]] = field(default_factory=dict)
    kept: int = 0  # records written (or that would be written) to fix_out
    no_target: int = 0  # usable records whose phrase names nothing in the image ("bboxes": [])

    @property
    def trainable(self) -> bool:
        """The verdict `groundtune train` reaches on this file with bad_records=refuse: it starts
        only on a file with records and no errors."""
        return self.lines > 0 and not self.errors

    def to_dict(self) -> dict:
        def ordered(d: dict) -> dict:  # the KINDS table's order, whatever line came first
            return {kind: list(d[kind]) for kind in KINDS if kind in d}

        return {
            "lines": self.lines,
            "no_target": self.no_target,
            "errors": ordered(self.errors),
            "warnings": ordered(self.warnings),
            "fixed": ordered(self.fixed),
        }

    def summary(self) -> str:
        import shutil

        from rich import box as rich_box
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        error_lines = {n for lines in self.errors.values() for n in lines}
        warning_lines = {n for lines in self.warnings.values() for n in lines}
        head = (
            f"{self.path}: {self.lines} records, {len(error_lines)} with errors, "
            f"{len(warning_lines)} with warnings, {self.kept} usable"
            + (f" ({self.no_target} with no target)" if self.no_target else "")
        )
        if not self.lines:
            return head + "\nThe file holds no records: there is nothing to train on (groundtune train refuses it)."
        if not self.errors and not self.warnings:
            return head + "\nNo problems found: the file can be trained on as it is."
        table = Table(box=rich_box.SIMPLE, show_edge=False)
        for name in ("kind", "level", "count", "fixed", "lines"):
            table.add_column(name, justify="right" if name in ("count", "fixed") else "left", no_wrap=True)
        table.add_column("what to do")
        for kind, (level, todo) in KINDS.items():
            lines = (self.errors if level == ERROR else self.warnings).get(kind)
            if not lines:
                continue
            fixed = str(len(self.fixed.get(kind, []))) if level == WARNING else "-"
            shown = ", ".join(map(str, lines[:5])) + (f", ... (+{len(lines) - 5})" if len(lines) > 5 else "")
            # Text, not str: rich would read "[x1, y1, x2, y2]" as markup and drop it.
            table.add_row(*map(Text, (kind, level, str(len(lines)), fixed, shown, todo)))
        out = io.StringIO()
        width = max(80, shutil.get_terminal_size((120, 24)).columns)
        Console(file=out, width=width, color_system=None).print(table)
        rendered = "\n".join(line.rstrip() for line in out.getvalue().splitlines())
        tail = (
            f"{len(error_lines)} records have errors: they are left out of --fix-out; fix them at the source."
            if self.errors
            else "No errors."
        )
        if self.warnings:
            tail += " Warnings are fixed automatically in --fix-out (or at load)."
        return f"{head}\n{rendered}\n{tail}"

    def _add(self, kind: str, number: int, kept: bool) -> None:
        level = KINDS[kind][0]
        (self.errors if level == ERROR else self.warnings).setdefault(kind, []).append(number)
        if level == WARNING and kept:
            self.fixed.setdefault(kind, []).append(number)


@dataclass
class Checked:
    """A checked file: its report, the usable records (automatic fixes applied) with their line
    numbers, and every unusable line with its kinds and what to do."""

    report: CheckReport
    usable: list[tuple[int, dict]]
    bad: list[dict]  # {"line": n, "kinds": [...], "message": "..."}

    def refusal(self, role: str) -> str:
        """Why a run will not start on this file (bad_records=refuse), with the table and the way out."""
        path = self.report.path
        return (f"{role}: {len(self.bad)} of {self.report.lines} records of {path} cannot be trained on "
                f"(bad_records=refuse):\n{self.report.summary()}\n"
                f"Fix them at the source, or keep the usable ones: groundtune data check {path} --fix-out "
                f"{Path(path).with_suffix('')}-clean.jsonl (or set bad_records=skip)")


def check_records(path: str | Path, cache: "ProbeCache | None" = None) -> Checked:
    """Check every line of a canonical JSONL file (images decoded in parallel, what they showed
    cached); nothing is written."""
    path = jsonl_file(path)
    lines = list(iter_jsonl(path))  # a file that is not UTF-8 is a DataError naming line and byte

    # Many records share an image (RefCOCO: ~7 phrases per picture), so decode each one once.
    paths = {line.number: _image_file(line.record, path) for line in lines if line.record is not None}
    infos = probe_images(sorted({p for p in paths.values() if p is not None}), cache or ProbeCache())

    report = CheckReport(path=str(path), lines=len(lines))
    usable, bad = [], []
    for line in track(lines, "checking records"):
        kinds, record = (["invalid_json"], None) if line.record is None else _check_record(
            line.record, infos.get(paths[line.number]))
        ok = all(KINDS[k][0] == WARNING for k in kinds)
        for kind in kinds:
            report._add(kind, line.number, kept=ok)
        if ok:
            usable.append((line.number, record))
        else:
            errors = [k for k in kinds if KINDS[k][0] == ERROR]
            bad.append({"line": line.number, "kinds": errors,
                        "message": " ".join(f"{k}: {KINDS[k][1]}" for k in errors)})
    report.kept = len(usable)
    report.no_target = sum(record.get("bboxes") == [] for _, record in usable)
    return Checked(report, usable, bad)


def check_file(path: str | Path, fix_out: str | Path | None = None) -> CheckReport:
    """Check every line of a canonical JSONL file; write the usable records, fixed, to ``fix_out``."""
    checked = check_records(path)
    path, kept = Path(checked.report.path), [record for _, record in checked.usable]
    if fix_out is not None:
        src, dst = path.resolve().parent, Path(fix_out).resolve().parent
        if src != dst:  # relative image paths are relative to the JSONL file: keep them pointing right
            kept = [_rebase_image(r, src, dst) for r in kept]
        write_samples(fix_out, kept)
    return checked.report


# --------------------------------------------------------------------------------------------
# Images


def _image_file(record: dict, jsonl_path: Path) -> Path | None:
    image = record.get("image")
    return image_path(record, jsonl_path) if isinstance(image, str) and image else None


def probe_images(paths: list[Path], cache: "ProbeCache") -> dict[Path, ImageInfo]:
    """What decoding each image shows, from the cache where the file is unchanged, else decoded
    (in a thread pool, with a progress bar) and cached."""
    infos, stats = {}, {}
    for path in paths:
        if path_problem(path):  # a NUL byte, a name too long: no file has it (stat would raise ValueError)
            infos[path] = ImageInfo(error="image_not_a_file")
            continue
        try:
            stat = path.stat()
        except FileNotFoundError:
            infos[path] = ImageInfo(error="image_missing")
            continue
        except OSError:
            infos[path] = ImageInfo(error="image_unreadable")
            continue
        if not S_ISREG(stat.st_mode):  # opening a FIFO would wait for a writer forever
            infos[path] = ImageInfo(error="image_not_a_file")
            continue
        stats[path] = (stat.st_size, stat.st_mtime_ns)
    infos.update(cache.get(stats))
    todo = [p for p in stats if p not in infos]
    with ThreadPoolExecutor(max_workers=min(16, cores())) as pool:
        decoded = dict(zip(todo, track(pool.map(_probe_image, todo), "decoding images", total=len(todo))))
    cache.put({p: (stats[p], info) for p, info in decoded.items()})
    return {**infos, **decoded}


class ProbeCache:
    """What decoding an image showed (``ImageInfo``), by its absolute path, size and modification
    time, in an SQLite file under ``$GROUNDTUNE_CACHE`` (default ~/.cache/groundtune). A cache only:
    where it cannot be opened or written, images are decoded again, silently."""

    def __init__(self, folder: str | Path | None = None):
        folder = Path(folder) if folder else cache_dir()
        self.path = folder / "image_probes.sqlite"

    def _connect(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=30)
        db.execute("CREATE TABLE IF NOT EXISTS probe (path TEXT PRIMARY KEY, size INTEGER, mtime_ns INTEGER, "
                   "info TEXT)")
        return db

    def get(self, stats: dict[Path, tuple[int, int]]) -> dict[Path, ImageInfo]:
        try:
            with self._connect() as db:
                found = {}
                for path, (size, mtime) in stats.items():
                    row = db.execute("SELECT info FROM probe WHERE path = ? AND size = ? AND mtime_ns = ?",
                                     (str(path.resolve()), size, mtime)).fetchone()
                    if row is not None:
                        found[path] = ImageInfo(**{k: tuple(v) if isinstance(v, list) else v
                                                   for k, v in json.loads(row[0]).items()})
                return found
        except (sqlite3.Error, OSError):
            return {}

    def put(self, entries: dict[Path, tuple[tuple[int, int], ImageInfo]]) -> None:
        try:
            with self._connect() as db:
                db.executemany("INSERT OR REPLACE INTO probe VALUES (?, ?, ?, ?)",
                               [(str(p.resolve()), size, mtime, json.dumps(asdict(info)))
                                for p, ((size, mtime), info) in entries.items()])
        except (sqlite3.Error, OSError):
            pass


def _probe_image(path: Path) -> ImageInfo:
    """Decode one image to the last byte and note its size, mode and EXIF orientation (the bytes
    read bounded: images.opened)."""
    try:
        with opened(path) as im:
            im.load()  # a truncated file only fails when the missing bytes are needed
            size, mode = im.size, im.mode
            try:
                orientation = im.getexif().get(EXIF_ORIENTATION)
            except Exception:  # broken EXIF block: the pixels are still fine, ignore the rotation
                orientation = None
    except FileNotFoundError:
        return ImageInfo(error="image_missing")
    except Exception:  # any decoder error, a decompression bomb, a folder: counted, never a crash
        return ImageInfo(error="image_unreadable")
    transposed = (size[1], size[0]) if orientation in _SWAPPING_ORIENTATIONS else None
    return ImageInfo(size=size, mode=mode, transposed_size=transposed)


def _rebase_image(record: dict, src: Path, dst: Path) -> dict:
    if Path(record["image"]).is_absolute():
        return record
    return {**record, "image": os.path.relpath(src / record["image"], dst)}


# --------------------------------------------------------------------------------------------
# Checks: each takes the record (with earlier fixes applied) and the decoded image (None when the
# record names no image) and returns findings. They run in order: the image check fills in a
# missing width/height before the box check needs them.


def _check_record(record: dict, image: ImageInfo | None) -> tuple[list[str], dict]:
    kinds = []
    for check in (check_fields, check_image, check_phrase, check_boxes):
        for kind, fixed in check(record, image):
            kinds.append(kind)
            if fixed is not None:
                record = fixed
    return kinds, record


def check_fields(record: dict, image: ImageInfo | None) -> list[Finding]:
    # width/height are not required here: a missing size is a warning, filled in from the image
    return [("missing_field", None)] if missing_fields(record, ("id", "image", "phrase", "bbox")) else []


def check_image(record: dict, image: ImageInfo | None) -> list[Finding]:
    if image is None:  # no usable `image` field: already a missing_field
        return []
    if image.error:
        return [(image.error, None)]
    findings: list[Finding] = []
    recorded = record_size(record)
    if recorded is None:
        record = _with_size(record, image.size)
        findings.append(("missing_size", record))
    elif recorded != image.size:
        # images.load_image applies the EXIF rotation exactly when it makes the sizes agree.
        if recorded == image.transposed_size:
            findings.append(("exif_transposed", record))
        else:
            findings.append(("size_mismatch", None))
    w, h = image.size
    # smart_resize refuses ratios above MAX_RATIO; at the limit itself we refuse too, conservatively.
    if max(w, h) / min(w, h) >= MAX_RATIO:
        findings.append(("aspect_ratio", None))
    if image.mode != "RGB":
        findings.append(("image_mode", record))
    return findings


def check_phrase(record: dict, image: ImageInfo | None) -> list[Finding]:
    phrase = record.get("phrase")
    if phrase is None:  # already a missing_field
        return []
    if not isinstance(phrase, str):
        return [("phrase_empty", None)]
    if len(phrase) > MAX_PHRASE_CHARS:  # nothing else of it matters (nor is worth a regular expression's pass)
        return [("phrase_too_long", None)]
    findings: list[Finding] = []
    if _CONTROL.search(phrase):
        phrase = _squeeze(_CONTROL.sub("", _CONTROL_SPACE.sub(" ", phrase)))
        findings.append(("phrase_control_chars", {**record, "phrase": phrase}))
    if _TAG.search(phrase) or _ENTITY.search(phrase):
        phrase = _squeeze(html.unescape(_TAG.sub("", phrase)))
        findings.append(("phrase_html", {**record, "phrase": phrase}))
    if not phrase.strip():
        findings.append(("phrase_empty", None))
    return findings


def check_boxes(record: dict, image: ImageInfo | None) -> list[Finding]:
    key = "bboxes" if record.get("bboxes") is not None else "bbox"
    value = record.get(key)
    if value is None or value == []:  # a missing_field, or a record with no target: nothing to check
        return []
    if key == "bboxes" and not isinstance(value, list):
        return [("bbox_nan", None)]
    boxes = value if key == "bboxes" else [value]
    size = record_size(record)  # None when the image is unreadable and no size is recorded
    kinds, fixed_boxes = [], []
    for box in boxes:
        kind, fixed_box = _check_box(box, size)
        if kind is not None and kind not in kinds:
            kinds.append(kind)
        fixed_boxes.append(fixed_box)
    fixed = {**record, key: fixed_boxes if key == "bboxes" else fixed_boxes[0]}
    return [(kind, fixed if KINDS[kind][0] == WARNING else None) for kind in kinds]


def _check_box(box, size: tuple[int, int] | None) -> tuple[str | None, list]:
    """(kind or None, the box to write) for one box of a record; ``size`` is the image's (w, h)."""
    if not isinstance(box, list) or as_box(box) is None:
        return "bbox_nan", box
    if not has_area(box):
        # Read as xywh? Only an image size can tell a plausible xywh box from a broken one.
        as_xyxy = xywh_to_xyxy(box)
        if size is not None and box_area(as_xyxy) > 0 and _overshoot(as_xyxy, size) <= CLIP_TOLERANCE:
            return "bbox_looks_xywh", box
        return "bbox_empty", box
    if size is None:
        return None, box
    overshoot = _overshoot(box, size)
    if overshoot > CLIP_TOLERANCE:
        return "bbox_outside", box
    if overshoot > 0:
        clipped = clip_box([float(v) for v in box], size)
        # A sliver lying wholly outside the image has nothing left once clipped.
        return ("bbox_clipped", clipped) if box_area(clipped) > 0 else ("bbox_outside", box)
    return None, box


# --------------------------------------------------------------------------------------------
# Small helpers


def _overshoot(box, size: tuple[int, int]) -> float:
    """How far (px) the box goes past the image's edges; <= 0 when it is inside."""
    w, h = size
    return max(-box[0], -box[1], box[2] - w, box[3] - h)


def _with_size(record: dict, size: tuple[int, int]) -> dict:
    """The record with width/height set, placed right after `image` as convert writes them."""
    out = {}
    for k, v in record.items():
        if k in ("width", "height"):
            continue
        out[k] = v
        if k == "image":
            out["width"], out["height"] = size
    return out


def _squeeze(text: str) -> str:
    return " ".join(text.split())
