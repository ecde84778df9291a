"""What training runs did, from their run folders alone, in one stamped JSON: each run's settings
(config.yaml), its wall time from its first to its last log line (metrics.jsonl: the model's load
before it is left out), and every eval it logged (a box head's chosen threshold among them,
``eval/head_threshold``).

    python bench/run_summary.py /tmp/m_text /tmp/m_box --out bench/results/tiny2/box_cells_runs.json

Runs measured side by side on a shared machine say so in their figures' text, not here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from groundtune.runs import RunFolder

sys.path.insert(0, str(Path(__file__).parent))
from provenance import stamped  # noqa: E402

SETTINGS = ("model", "train_data", "eval_data", "method", "head", "head_slots", "freeze_llm", "lr", "max_steps",
            "batch_size", "seed", "group_size", "temperature", "kl_coef")  # what one comparison's runs differ by


def summary(run: RunFolder) -> dict:
    config = yaml.safe_load(run.config.read_text())
    rows = [json.loads(line) for line in run.metrics.read_text().splitlines() if line.strip()]
    evals = [{k: v for k, v in r.items() if k == "step" or (k.startswith("eval/") and k != "eval/decoding")}
             for r in rows if any(k.startswith("eval/") and k != "eval/decoding" for k in r)]
    timed = [r["time"] for r in rows if "time" in r]
    return {"settings": {k: config.get(k) for k in SETTINGS if k in config},
            "logged_wall_s": round(timed[-1] - timed[0], 1) if len(timed) > 1 else None,
            "evals": evals}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run folders")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    for run in args.runs:
        folder = RunFolder(run)
        if not folder.config.is_file() or not folder.metrics.is_file():
            parser.error(f"{run}: not a run folder (no {folder.config.name} and {folder.metrics.name})")
    result = {run: summary(RunFolder(run)) for run in args.runs}
    Path(args.out).write_text(json.dumps(stamped(result), indent=1) + "\n")
    for run, row in result.items():
        last = row["evals"][-1] if row["evals"] else {}
        print(f"{run:<24} {row['logged_wall_s']} s  " + "  ".join(f"{k[5:]} {v:.3f}" for k, v in last.items()
                                                               if k.startswith("eval/") and isinstance(v, float)))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
