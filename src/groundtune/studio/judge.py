"""The Judge tab: a real `groundtune eval --samples` process on a run (or the tiny model), then its
answers browsed one sample at a time, sorted by IoU (worst first), eval's own worst-first order,
phrase length or number of targets, filtered by split; and two evals side by side on the same
samples, where one is right and the other wrong.

Each eval the studio starts writes WORKDIR/studio/evals/NAME/report.json and samples.jsonl (every
answer, its image path absolute: evaluate.write_rows), so it is there after a restart.
"""

from __future__ import annotations

import io
import json
import re
import time
from pathlib import Path

from groundtune.studio.jobs import FOLDER
from groundtune.studio.safety import Refusal

EVALS = "evals"
PAGE = 40
ROWS_KEPT = 4  # answer files kept read (two compared, a run's latest, one more)
SORTS = ("iou", "badness", "phrase_length", "targets")
FILTERS = ("all", "a_right_b_wrong", "b_right_a_wrong", "both_wrong", "both_right")


def _evals_folder(studio) -> Path:
    return studio.paths.root / FOLDER / EVALS


def start_eval(studio, args: dict) -> dict:
    """`groundtune eval --model M --data F --out .../report.json --samples .../samples.jsonl`."""
    from groundtune.studio.data import data_file
    from groundtune.studio.launch import run_folder

    given = (args.get("model") or "").strip()
    model = "tiny" if given == "tiny" else str(run_folder(studio, given))
    data = str(args.get("data") or "").strip()
    data_path = data if data.startswith("hf:") else str(data_file(studio, data))
    limit = str(args.get("limit") or "").strip()
    if limit and not (limit.isdigit() and int(limit) > 0):
        raise Refusal(f"limit {limit!r}: a whole number of samples, or nothing for all")
    name = _new_name(studio, re.sub(r"[^\w.-]+", "-", f"{Path(given).name}--{Path(data).stem}")[:80]
                     + time.strftime("-%Y%m%d-%H%M%S"))
    out = _evals_folder(studio) / name
    argv = ["eval", "--model", model, "--data", data_path, "--out", str(out / "report.json"),
            "--samples", str(out / "samples.jsonl"), *(["--limit", limit] if limit else [])]
    return studio.jobs.start("eval", argv, eval=name, model=given).to_json()


def _new_name(studio, name: str) -> str:
    """``name``, or ``name-2``, ``name-3``...: an eval folder no other eval has or is writing."""
    taken = {j.about.get("eval") for j in studio.jobs.jobs.values()}
    found, n = name, 1
    while found in taken or (_evals_folder(studio) / found).exists():
        n += 1
        found = f"{name}-{n}"
    return found


def evals(studio, args: dict) -> dict:
    """The evals the studio made: finished ones with their headline numbers."""
    found = []
    for folder in sorted(_evals_folder(studio).glob("*/report.json"), key=lambda p: p.stat().st_mtime, reverse=True):
        report = json.loads(folder.read_text())
        report = report["models"][0] if "models" in report else report
        found.append({"eval": folder.parent.name, "model": report.get("model"), "data": report.get("data"),
                      "n": report.get("n"), **{k: report.get(k) for k in ("acc@0.5", "miou", "f1@0.5", "set_acc@0.5")}})
    return {"evals": found}


def _eval_rows_file(studio, name: str) -> Path:
    if not name or "/" in name or name.startswith("."):
        raise Refusal(f"eval {name!r}: pick one of the evals listed")
    path = studio.paths.inside(f"{FOLDER}/{EVALS}/{name}/samples.jsonl", "eval")
    if not path.is_file():
        raise Refusal(f"eval {name}: no answers written (is it still running, or did it fail?)")
    return path


def read_rows(studio, path: Path) -> list[dict]:
    """An eval's answers (evaluate.write_rows), read once per version of the file."""
    stat = path.stat()
    key, cache = (path, stat.st_mtime, stat.st_size), studio.cache.setdefault("rows", {})
    if key not in cache:
        rows = []
        for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            try:
                rows.append(json.loads(text))
            except ValueError:
                raise Refusal(f"{studio.paths.shown(path)}:{number}: not an answer line (not JSON)") from None
        while len(cache) >= ROWS_KEPT:  # an eval of a large set is large: the oldest read goes
            cache.pop(next(iter(cache)))
        cache[key] = rows
    return cache[key]


def _iou_key(row: dict) -> float:
    """A sample's IoU; a no-target sample's is 1 when answered exactly, else 0."""
    return row["iou"] if row.get("iou") is not None else (1.0 if row.get("set_hit") else 0.0)


def ranked(rows: list[dict], sort: str, descending: bool = False) -> list[int]:
    """Indices of ``rows`` in the order asked: iou (lowest first), badness (eval gallery's order),
    phrase_length (words), targets (true boxes); ``descending`` reverses it."""
    from groundtune.evaluate import badness

    keys = {"iou": _iou_key, "badness": badness, "phrase_length": lambda r: len(str(r.get("phrase", "")).split()),
            "targets": lambda r: len(r.get("true_boxes", []))}
    if sort not in keys:
        raise Refusal(f"sort {sort!r}: expected one of {', '.join(SORTS)}")
    order = sorted(range(len(rows)), key=lambda i: (keys[sort](rows[i]), badness(rows[i])))
    return order[::-1] if descending else order


def summary(row: dict, index: int, file: str) -> dict:
    from groundtune.evaluate import verdict

    return {"index": index, "file": file, "id": row.get("id"), "phrase": row.get("phrase"), "split": row.get("split"),
            "iou": row.get("iou"), "right": bool(row.get("set_hit")), "verdict": verdict(row),
            "targets": len(row.get("true_boxes", [])), "answered": len(row.get("pred_boxes", [])), "raw": row.get("raw")}


def answers(studio, args: dict) -> dict:
    """A page of an eval's answers, sorted and filtered by split."""
    path = _eval_rows_file(studio, args.get("eval", ""))
    rows, shown = read_rows(studio, path), studio.paths.shown(path)
    order = ranked(rows, args.get("sort") or "iou", args.get("order") == "desc")
    split = args.get("split") or ""
    order = [i for i in order if not split or str(rows[i].get("split") or "-") == split]
    offset = max(0, int(args.get("offset") or 0))
    return {"total": len(order), "offset": offset, "splits": sorted({str(r.get("split") or "-") for r in rows}),
            "answers": [summary(rows[i], i, shown) for i in order[offset:offset + PAGE]]}


def compare(studio, args: dict) -> dict:
    """Two evals' answers to the same samples side by side, where one is right and the other not."""
    a_path, b_path = _eval_rows_file(studio, args.get("a", "")), _eval_rows_file(studio, args.get("b", ""))
    a_rows, b_rows = read_rows(studio, a_path), read_rows(studio, b_path)
    b_index = {row["id"]: i for i, row in enumerate(b_rows)}
    shared = [i for i, row in enumerate(a_rows) if row["id"] in b_index]
    if not shared:
        raise Refusal("these two evals share no sample (ids): compare evals of the same data file")
    wanted = args.get("filter") or "all"
    if wanted not in FILTERS:
        raise Refusal(f"filter {wanted!r}: expected one of {', '.join(FILTERS)}")
    pairs = []
    for i in ranked([a_rows[i] for i in shared], "iou"):
        a, j = a_rows[shared[i]], b_index[a_rows[shared[i]]["id"]]
        right = (bool(a.get("set_hit")), bool(b_rows[j].get("set_hit")))
        if wanted == "all" or right == {"a_right_b_wrong": (True, False), "b_right_a_wrong": (False, True),
                                        "both_wrong": (False, False), "both_right": (True, True)}[wanted]:
            pairs.append({"a": summary(a, shared[i], studio.paths.shown(a_path)),
                          "b": summary(b_rows[j], j, studio.paths.shown(b_path))})
    offset = max(0, int(args.get("offset") or 0))
    return {"shared": len(shared), "total": len(pairs), "offset": offset, "pairs": pairs[offset:offset + PAGE]}


def answer_png(studio, args: dict) -> bytes:
    """One answer drawn against the truth (eval gallery's colours: evaluate.draw_answer)."""
    from groundtune.data.images import load_image
    from groundtune.evaluate import draw_answer

    path = studio.paths.inside(args.get("file", ""), "answers file")
    if not path.name.endswith(".samples.jsonl") and path.name != "samples.jsonl":
        raise Refusal(f"{studio.paths.shown(path)}: not an eval's answers file")
    rows = read_rows(studio, path)
    try:
        row = rows[int(args.get("index", ""))]
    except (ValueError, IndexError):
        raise Refusal(f"{studio.paths.shown(path)} has no answer {args.get('index')!r}") from None
    image = load_image(studio.paths.readable(Path(row["image"])), (row["width"], row["height"]))
    out = io.BytesIO()
    draw_answer(image, row["true_boxes"], row["pred_boxes"], row["matched"]).save(out, format="PNG")
    return out.getvalue()
