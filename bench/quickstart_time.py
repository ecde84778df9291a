"""The README's first run, as a newcomer types it: `groundtune quickstart` end to end, timed.

    python bench/quickstart_time.py --runs 3 --out bench/results/quickstart.json

Each run is the command itself (`groundtune quickstart --out DIR` in a process of its own, in a new
temporary folder: the synthetic data made, the tiny model evaluated, LoRA-tuned, evaluated again),
timed from its start to its exit. Writes the scores of each run (they do not change between runs
on one machine: the data and training are seeded) and its wall time; the wall time varies with the
machine and what else runs on it, so the README quotes the range.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import stamped


def one_run() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "quickstart"
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "groundtune", "quickstart", "--out", str(out)],
                              capture_output=True, text=True)
        seconds = time.monotonic() - start
        if done.returncode != 0:
            raise SystemExit(f"groundtune quickstart exited with {done.returncode}:\n{done.stderr[-3000:]}")
        report = json.loads((out / "report.json").read_text())
    return {"seconds": round(seconds, 1), "acc@0.5_before": report["before"]["acc@0.5"],
            "acc@0.5_after": report["after"]["acc@0.5"], "gain": round(report["gain"], 4),
            "n_eval": report["after"]["n"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1, help="runs one after another")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    runs = []
    for i in range(args.runs):
        runs.append(one_run())
        print(f"run {i + 1}: {json.dumps(runs[-1])}", flush=True)
    seconds = [r["seconds"] for r in runs]
    result = {"runs": runs, "seconds_min": min(seconds), "seconds_max": max(seconds),
              "acc@0.5_before": runs[0]["acc@0.5_before"], "acc@0.5_after": runs[0]["acc@0.5_after"],
              "same_scores_every_run": all((r["acc@0.5_before"], r["acc@0.5_after"]) ==
                                           (runs[0]["acc@0.5_before"], runs[0]["acc@0.5_after"]) for r in runs)}
    if args.out:
        args.out.write_text(json.dumps(stamped(result), indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))


if __name__ == "__main__":
    main()
