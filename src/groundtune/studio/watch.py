"""The Watch tab: the runs of the work folder, their curves from metrics.jsonl (loss, learning rate,
throughput, GPU memory, eval; several runs overlaid), and the latest training-time eval's best
and worst answers (RUN/eval/step-N.samples.jsonl). Read only: nothing here writes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from groundtune.runs import STEP_PREFIX, RunFolder, is_run, step_of
from groundtune.studio import judge
from groundtune.studio.launch import command_for, run_folder, saved_settings

MAX_DEPTH = 4  # how deep under the work folder runs are looked for
MAX_FOLDERS = 5000  # ... and how many folders at most (a folder of images is not walked)
SKIPPED = {"images", "node_modules", "__pycache__"}
SHOWN = 4  # best and worst answers shown


def find_runs(root: Path) -> list[Path]:
    """Run folders under ``root``: a run's own folders and hidden ones are not walked."""
    found, seen = [], 0
    for folder, subfolders, _ in os.walk(root):
        seen += 1
        path = Path(folder)
        if is_run(path):
            found.append(path)
            subfolders[:] = []  # runs do not nest
            continue
        depth = len(path.relative_to(root).parts)
        subfolders[:] = [] if depth >= MAX_DEPTH or seen > MAX_FOLDERS else sorted(
            s for s in subfolders if not s.startswith(".") and s not in SKIPPED)
    return found


def _last_step(metrics: Path) -> int | None:
    try:
        with open(metrics, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except FileNotFoundError:
        return None
    for text in reversed(lines):
        try:
            return json.loads(text)["step"]
        except (ValueError, KeyError, TypeError):
            continue
    return None


def runs(studio, args: dict) -> dict:
    """Every run of the work folder: its command, last logged step, model, and whether it runs."""
    running = {j.about.get("run") for j in studio.jobs.running()}
    found = []
    for path in find_runs(studio.paths.root):
        folder, shown, saved = RunFolder(path), studio.paths.shown(path), saved_settings(path)
        eval_data = str(saved.get("eval_data") or "")
        found.append({"run": shown, "command": command_for(saved) if folder.config.is_file() else "?",
                      "step": _last_step(folder.metrics), "has_model": folder.has_model,
                      "running": shown in running or folder.lock.exists(),
                      # what Judge proposes to evaluate it on: what it was evaluated on while training
                      # (relative: to where it was started, the work folder when the studio started it)
                      "eval_data": eval_data if eval_data.startswith("hf:") or not eval_data
                      else studio.paths.shown(studio.paths.root / eval_data)})
    return {"runs": found}


def metrics(studio, args: dict) -> dict:
    """Every number of each run's metrics.jsonl as [step, value] series, by name."""
    series = {}
    for given in filter(None, (args.get("runs") or "").split(",")):
        path = run_folder(studio, given)
        by_name: dict[str, list] = {}
        try:
            text = RunFolder(path).metrics.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            text = ""
        for line in text.splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # the line a running process is writing
                continue
            for name, value in record.items():
                if name not in ("step", "time") and isinstance(value, (int, float)) and not isinstance(value, bool):
                    by_name.setdefault(name, []).append([record["step"], value])
        series[studio.paths.shown(path)] = by_name
    return {"series": series}


def latest_eval(studio, args: dict) -> dict:
    """The newest training-time eval's best and worst answers of a run."""
    path = run_folder(studio, args.get("run", ""))
    files = sorted(RunFolder(path).eval_reports.glob(f"{STEP_PREFIX}*.samples.jsonl"))
    if not files:
        return {"step": None, "worst": [], "best": []}
    rows = judge.read_rows(studio, files[-1])
    ranked = judge.ranked(rows, "badness")
    shown = studio.paths.shown(files[-1])
    worst = [judge.summary(rows[i], i, shown) for i in ranked[:SHOWN]]
    best = [judge.summary(rows[i], i, shown) for i in reversed(ranked[-SHOWN:]) if i not in ranked[:SHOWN]]
    return {"step": step_of(files[-1]), "file": shown,
            "worst": worst, "best": best}
