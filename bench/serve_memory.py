"""Memory of `groundtune serve` under limit-sized 16-bit PNGs: idle, peak while N arrive at once, after.

    python bench/serve_memory.py --out bench/results/serve_memory.json          # 6 at once, 50 MP, tiny, CPU
    python bench/serve_memory.py --old-src /tmp/old-gt/src --out ...            # the same against older code

Starts the real server (``serve.launch``: tiny model, CPU, 127.0.0.1) with --max-image-pixels
PIXELS, answers one small request (a warm server: tokenizer, plugins, the first batch), then
sends CONCURRENCY /v1/ground requests at once, each a square 16-bit greyscale PNG of at most
PIXELS (a gradient: ~100 KB for 50 MP), and samples the resident memory (RSS) of the server
and every process under it (the model's, encoding workers) every 20 ms. Reports idle (before),
peak and after (2 s after the last answer), in MB, and each answer's status.

``--old-src DIR`` also runs a source tree of older code the same way (PYTHONPATH=DIR, e.g. a
clone at the commit before a change: ``git clone /work/main /tmp/old-gt``), for the before/after
figures. ``--kill-above-gb`` stops a server whose memory passes it (the old code took 7.7-9.2 GB
for six): its peak is then reported as "at least" that.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import io
import json
import math
import os
import subprocess
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from groundtune.deploy.limits import Limits
from serving import launch
from provenance import stamped

REPO = Path(__file__).resolve().parent.parent


def sixteen_bit_png(pixels: int) -> bytes:
    """A square 16-bit greyscale PNG of at most ``pixels``: every row the same gradient (PNG's "up"
    filter makes it compress to ~2 bytes a row)."""
    side = math.isqrt(pixels)
    row = np.linspace(0, 65535, side).astype(np.uint16)
    image = Image.fromarray(np.broadcast_to(row, (side, side)).copy())
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=9)
    return buffer.getvalue()


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and every process under it (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def measure(src: Path | None, png: bytes, pixels: int, concurrency: int, budget_mb: float | None,
            kill_above: float) -> dict:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(src) + os.pathsep + env.get("PYTHONPATH", "")
    flags = ["--device", "cpu", "--max-image-pixels", str(pixels), "--queue-size", str(4 * concurrency)]
    flags += ["--decode-budget-mb", str(budget_mb)] if budget_mb is not None else []
    process, url = launch("tiny", *flags, timeout_s=300, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    small = io.BytesIO()
    Image.new("RGB", (168, 168), (200, 30, 30)).save(small, format="PNG")
    body = {"image": base64.b64encode(png).decode(), "phrase": "the bright band"}
    try:
        warm = httpx.post(url + "/v1/ground", json={"image": base64.b64encode(small.getvalue()).decode(),
                                                    "phrase": "the red square"}, timeout=300)
        assert warm.status_code == 200, warm.text
        time.sleep(2)
        idle = min(tree_rss(process.pid) for _ in range(5) if not time.sleep(0.1))
        samples, done, killed = [], threading.Event(), False

        def sample() -> None:
            nonlocal killed
            while not done.is_set():
                samples.append(tree_rss(process.pid))
                if samples[-1] > kill_above:
                    killed = True
                    process.kill()
                    return
                time.sleep(0.02)

        sampler = threading.Thread(target=sample)
        sampler.start()
        start = time.perf_counter()

        def send(_) -> str:
            try:
                return str(httpx.post(url + "/v1/ground", json=body, timeout=600).status_code)
            except httpx.HTTPError as e:
                return type(e).__name__

        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            statuses = list(pool.map(send, range(concurrency)))
        seconds = time.perf_counter() - start
        time.sleep(2)
        after = tree_rss(process.pid) if not killed else None
        done.set()
        sampler.join()
        mb = 2**20
        return {"idle_mb": round(idle / mb), "peak_mb": round(max(samples) / mb),
                "peak_above_idle_mb": round((max(samples) - idle) / mb),
                "after_mb": round(after / mb) if after is not None else None,
                "after_above_idle_mb": round((after - idle) / mb) if after is not None else None,
                "killed_above_mb": round(kill_above / mb) if killed else None,
                "statuses": {s: statuses.count(s) for s in sorted(set(statuses))}, "seconds": round(seconds, 1)}
    finally:
        process.kill()
        process.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pixels", type=int, default=50_000_000,
                        help="the server's --max-image-pixels, and the images' size")
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--decode-budget-mb", type=float, help="the server's (default: its own default)")
    parser.add_argument("--old-src", type=Path, help="also measure this source tree (PYTHONPATH) the same way")
    parser.add_argument("--kill-above-gb", type=float, default=12.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    png = sixteen_bit_png(args.pixels)
    side = math.isqrt(args.pixels)
    result = {"image": {"size": f"{side}x{side}", "mode": "I;16", "png_bytes": len(png)},
              "max_image_pixels": args.pixels, "concurrency": args.concurrency,
              "decode_budget_mb": args.decode_budget_mb or Limits().decode_budget_bytes / 2**20, "runs": {}}
    runs = [("this tree", None)] + ([("old code: " + str(args.old_src), args.old_src)] if args.old_src else [])
    for name, src in runs:
        result["runs"][name] = measure(src, png, args.pixels, args.concurrency, args.decode_budget_mb if src is None
                                       else None, args.kill_above_gb * 2**30)
        if src is not None:
            result["runs"][name]["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=src, capture_output=True,
                                                            text=True).stdout.strip()
        print(name, json.dumps(result["runs"][name]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(stamped(result), indent=1) + "\n")


if __name__ == "__main__":
    main()
