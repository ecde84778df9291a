"""The Data tab: open a canonical JSONL file (or ``hf:REPO:SPLIT``), a grid of its samples with their
boxes, filtered by split, source, number of targets and the problems `groundtune data check` finds;
one sample beside what the model sees after resizing, drawn by `data show`'s own function.

The records are read once per version of the file (no image is decoded to list them); the check
is a real `groundtune data check FILE --json` process (images are decoded: minutes on a large set),
which the page follows and can cancel.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

from groundtune import families
from groundtune.boxes import ResizeSpec
from groundtune.data import records, show
from groundtune.data.images import load_image
from groundtune.studio.safety import Refusal

PAGE = 60  # samples a page
TARGETS = ("0", "1", "2+")


@dataclass
class Opened:
    path: Path
    version: tuple[float, int]  # the file's mtime and size when it was read
    lines: dict[int, records.Line]


def data_file(studio, given: str) -> Path:
    """The JSONL file a page names: inside the work folder, or a hub data set's copy in the cache."""
    if str(given).startswith("hf:"):
        return records.jsonl_file(given)  # converted once into groundtune's cache (data/hub.py)
    return records.jsonl_file(studio.paths.inside(given, "data file"))


def _opened(studio, given: str) -> Opened:
    path = data_file(studio, given)
    stat = path.stat()
    cached = studio.cache.setdefault("data", {}).get(path)
    if cached is None or cached.version != (stat.st_mtime, stat.st_size):
        try:
            lines = {line.number: line for line in records.iter_jsonl(path)}
        except UnicodeDecodeError as e:
            raise Refusal(f"{studio.paths.shown(path)}: not UTF-8 text ({e.reason}); not a JSONL file") from None
        cached = studio.cache["data"][path] = Opened(path, (stat.st_mtime, stat.st_size), lines)
    return cached


def _about(line: records.Line) -> dict:
    """What the grid shows of a line and filters it by; ``error`` where it is not a usable record."""
    if line.error:
        return {"line": line.number, "error": line.error, "boxes": [], "targets": None}
    r = line.record
    error, boxes = None, []
    missing = records.missing_fields(r)
    if missing:
        error = f"missing field(s) {', '.join(missing)}"
    else:
        error = records.box_problem(r)
        boxes = [] if error else records.sample_boxes(r)
    size = records.record_size(r)
    return {"line": line.number, "id": str(r.get("id", "")), "phrase": str(r.get("phrase", "")),
            "split": str(r.get("split") or "-"), "source": str(r.get("source") or "-"), "error": error,
            "width": size[0] if size else None, "height": size[1] if size else None, "boxes": boxes,
            "targets": None if error else len(boxes)}


def _targets(n: int | None) -> str:
    return "-" if n is None else str(n) if n < 2 else "2+"


def open_file(studio, args: dict) -> dict:
    """Read the file; what it holds: lines, unusable lines, splits, sources, target counts, the check."""
    opened = _opened(studio, args.get("file", ""))
    abouts = [_about(line) for line in opened.lines.values()]
    if not abouts:
        raise Refusal(f"{studio.paths.shown(opened.path)}: no records (an empty file)")
    unusable = [a for a in abouts if a["error"]]
    if len(unusable) == len(abouts):
        first = unusable[0]
        raise Refusal(f"{studio.paths.shown(opened.path)}: none of its {len(abouts)} lines is a canonical record "
                      f"(line {first['line']}: {first['error']}); is it a canonical JSONL file? "
                      "`groundtune data convert` makes one")

    def counts(key) -> dict:
        found: dict[str, int] = {}
        for a in abouts:
            if not a["error"]:
                found[key(a)] = found.get(key(a), 0) + 1
        return dict(sorted(found.items()))

    given = str(args.get("file", ""))  # a hub data set is named again by its spec: its copy lies outside
    return {"file": given if given.startswith("hf:") else studio.paths.shown(opened.path), "lines": len(abouts), "unusable": len(unusable),
            "first_unusable": unusable[0] if unusable else None, "splits": counts(lambda a: a["split"]),
            "sources": counts(lambda a: a["source"]), "targets": counts(lambda a: _targets(a["targets"])),
            "check": check_state(studio, opened)}


def check_state(studio, opened: Opened) -> dict:
    """The state of the latest check of this version of the file: none, running, or its report
    (kinds -> lines)."""
    job_id, version = studio.cache.setdefault("checks", {}).get(opened.path, (None, None))
    if job_id is None or version != opened.version:  # a file changed since: its lines may be others
        return {"state": "none"}
    job = studio.jobs.get(job_id)
    state = job.to_json(tail=False) | {"tail": ""}
    if state["state"] == "done":
        report = _report(job.log)
        state["report"] = report
        if report is None:
            state["state"] = "failed"
    elif state["state"] == "failed":
        state["tail"] = job.to_json()["tail"]
    return state


def _report(log: Path) -> dict | None:
    """The JSON report `data check --json` printed last."""
    for text in reversed(log.read_text(encoding="utf-8", errors="replace").splitlines()):
        if text.startswith("{"):
            try:
                return json.loads(text)
            except ValueError:
                return None
    return None


def start_check(studio, args: dict) -> dict:
    opened = _opened(studio, args.get("file", ""))
    if check_state(studio, opened)["state"] == "running":
        raise Refusal("a check of this file is running already")
    job = studio.jobs.start("check", ["data", "check", str(opened.path), "--json"],
                            file=studio.paths.shown(opened.path))
    studio.cache["checks"][opened.path] = (job.id, opened.version)
    return job.to_json()


def _problems(studio, opened: Opened) -> dict[int, list[str]] | None:
    report = check_state(studio, opened).get("report")
    if report is None:
        return None
    found: dict[int, list[str]] = {}
    for level in ("errors", "warnings"):
        for kind, lines in report.get(level, {}).items():
            for number in lines:
                found.setdefault(number, []).append(kind)
    return found


def samples(studio, args: dict) -> dict:
    """A page of the samples that pass the filters (split, source, targets, problem)."""
    opened = _opened(studio, args.get("file", ""))
    problems = _problems(studio, opened)
    wanted = {k: args.get(k) or "" for k in ("split", "source", "targets", "problem")}
    if wanted["problem"] and problems is None:
        raise Refusal("run the data check first: the problems come from its report")
    chosen = []
    for line in opened.lines.values():
        about = _about(line) | {"problems": (problems or {}).get(line.number, [])}
        if _passes(about, wanted):
            chosen.append(about)
    offset = max(0, int(args.get("offset") or 0))
    return {"total": len(chosen), "offset": offset, "samples": chosen[offset:offset + PAGE],
            "checked": problems is not None}


def _passes(about: dict, wanted: dict) -> bool:
    if wanted["split"] and about.get("split") != wanted["split"]:
        return False
    if wanted["source"] and about.get("source") != wanted["source"]:
        return False
    if wanted["targets"] and _targets(about["targets"]) != wanted["targets"]:
        return False
    problem = wanted["problem"]
    if problem == "any":
        return bool(about["problems"]) or bool(about["error"])
    if problem == "none":
        return not about["problems"] and not about["error"]
    return not problem or problem in about["problems"]


def _line(studio, args: dict) -> tuple[Opened, records.Line]:
    opened = _opened(studio, args.get("file", ""))
    try:
        return opened, opened.lines[int(args.get("line", ""))]
    except (KeyError, ValueError):
        raise Refusal(f"{studio.paths.shown(opened.path)} has no record on line {args.get('line')!r}") from None


def _png(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def image(studio, args: dict) -> bytes:
    """The record's image fitted into a grid cell (its boxes are drawn by the page, over it)."""
    opened, line = _line(studio, args)
    if line.record is None or not isinstance(line.record.get("image"), str):
        raise Refusal(f"line {line.number}: no image to show")
    path = studio.paths.readable(records.image_path(line.record, opened.path))
    return _png(show.fit(load_image(path))[0])


def view(studio, args: dict) -> bytes:
    """`data show`'s cell: the sample with its boxes beside what the model sees after resizing."""
    opened, line = _line(studio, args)
    if line.record is not None and isinstance(line.record.get("image"), str):
        studio.paths.readable(records.image_path(line.record, opened.path))
    return _png(show.cell(line, opened.path, resize_of(args)))


def resize_of(args: dict) -> ResizeSpec:
    """The pixel budget the page chose: a family's, with its max/min pixels where given."""
    try:
        family = families.family(args.get("family") or "qwen2.5-vl")
        return ResizeSpec(family.factor, int(args.get("min_pixels") or family.min_pixels),
                          int(args.get("max_pixels") or family.max_pixels))
    except ValueError as e:
        raise Refusal(f"pixel budget: {e}") from None
