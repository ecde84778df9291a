"""How fast the built-in synthetic set is made, on one core and on all of them.

    python bench/synth_speed.py            # 2000 samples, writes bench/results/synth_speed.json
    python bench/synth_speed.py --n 20000

Timed end to end through make_synthetic_set (draw, PNG encode, write, JSONL), into a temporary
folder, so it is what `groundtune data synth` costs. Training on the fly (iter_samples) skips the
PNG encode and is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from groundtune.data.synth import iter_samples, make_synthetic_set
from provenance import stamped


def samples_per_s(n: int, workers: int, seed: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        make_synthetic_set(tmp, n=n, seed=seed, workers=workers)
        return n / (time.perf_counter() - t0)


def in_memory_samples_per_s(n: int, seed: int) -> float:
    """What training on the fly gets from one core: draw only, no PNG, no disk."""
    t0 = time.perf_counter()
    for _ in iter_samples(seed, 0, n):
        pass
    return n / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2000, help="samples per measurement")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "synth_speed.json"))
    args = parser.parse_args()

    cores = os.cpu_count() or 1
    load_before = os.getloadavg()[0]
    samples_per_s(200, 1, args.seed + 1)  # warm-up: imports, mask cache, page cache
    one = samples_per_s(args.n, 1, args.seed)
    every = samples_per_s(args.n, cores, args.seed)
    in_memory = in_memory_samples_per_s(args.n, args.seed)
    result = {
        "cpu_count": cores,
        "samples_per_s_1_worker": round(one, 1),
        "samples_per_s_all": round(every, 1),
        "per_core": round(every / cores, 1),
        "in_memory_samples_per_s_1_worker": round(in_memory, 1),
        "n": args.n,
        # other processes on the machine skew the all-core number; the 1-minute load says how much
        "load_avg_1min_before": round(load_before, 2),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(stamped(result), indent=2) + "\n")
    print(
        f"synth: {one:.0f} samples/s on 1 worker, {every:.0f} samples/s on {cores} workers "
        f"({every / cores:.0f}/core); {in_memory:.0f}/s in memory (iter_samples) -> {out}"
    )


if __name__ == "__main__":
    main()
