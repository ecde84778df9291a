"""Load on `groundtune serve`: N grounding requests at concurrency C, with batching and without.

    python bench/serve_load.py --out bench/results/serve_load.json           # tiny model, CPU: 2,000 at 64
    python bench/serve_load.py --model random:qwen2.5-vl-3b --device cuda --batch-size 64 --image-size 640x480
    python bench/serve_load.py --url http://127.0.0.1:8000 --requests 500    # a server already running

With --model (the default), the script starts the real server twice on 127.0.0.1 (uvicorn, a free
port): with --batch-size and with batching off (--batch-size 1), sends the same requests to each,
and reports requests/s, p50/p99 latency, errors and the mean batch (from /metrics), and the ratio.
Requests are /v1/ground with one phrase and one of 32 distinct synthetic scenes (PNG, base64).
Zero errors is required: any non-200 answer is counted and printed.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import time
from pathlib import Path

import httpx

from groundtune.data import synth
from groundtune.serve import launch


def scenes(n: int, width: int, height: int) -> list[dict]:
    bodies = []
    for i in range(n):
        image, record = synth.make_sample(seed=11, index=i, width=width, height=height, task="single")
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        bodies.append({"image": base64.b64encode(buffer.getvalue()).decode(), "phrase": record["phrase"]})
    return bodies


async def load(url: str, bodies: list[dict], requests: int, concurrency: int, api_key: str | None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    latencies, errors = [], {}
    queue = iter(range(requests))

    async def worker(client: httpx.AsyncClient) -> None:
        for i in queue:
            start = time.perf_counter()
            try:
                response = await client.post(url + "/v1/ground", json=bodies[i % len(bodies)], headers=headers)
                status = response.status_code
            except httpx.HTTPError as e:
                status = type(e).__name__
            latencies.append(time.perf_counter() - start)
            if status != 200:
                errors[str(status)] = errors.get(str(status), 0) + 1

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        seconds = time.perf_counter() - start
        metrics = (await client.get(url + "/metrics", headers=headers)).text
    count = _metric(metrics, "groundtune_batch_size_count")
    latencies.sort()
    return {"requests": requests, "concurrency": concurrency, "seconds": round(seconds, 2),
            "requests_per_s": round(requests / seconds, 2),
            "p50_ms": round(statistics.median(latencies) * 1000, 1),
            "p99_ms": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1000, 1),
            "errors": sum(errors.values()), "error_statuses": errors,
            "mean_batch": round(_metric(metrics, "groundtune_batch_size_sum") / count, 2) if count else None}


def _metric(text: str, name: str) -> float:
    return float(next((line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")), 0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server (else one is started with --model)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16, help="the server's batch (batching on)")
    parser.add_argument("--image-size", default="168x168", help="WxH of the synthetic scenes")
    parser.add_argument("--api-key")
    parser.add_argument("--out")
    args = parser.parse_args()
    width, height = map(int, args.image_size.split("x"))
    bodies = scenes(32, width, height)
    results = []
    runs = [("running server", None)] if args.url else [("batched", args.batch_size), ("one at a time", 1)]
    for name, batch_size in runs:
        process, url = (None, args.url) if args.url else launch(
            args.model, "--device", args.device, "--batch-size", str(batch_size),
            "--queue-size", str(max(256, args.concurrency * 2)), timeout_s=300)
        try:
            asyncio.run(load(url, bodies[:4], min(64, args.requests), args.concurrency, args.api_key))  # warm-up
            row = {"variant": name, "model": args.model, "device": args.device, "server_batch_size": batch_size,
                   "image_size": args.image_size,
                   **asyncio.run(load(url, bodies, args.requests, args.concurrency, args.api_key))}
        finally:
            if process is not None:
                process.terminate()
                process.wait(timeout=30)
        results.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"\n{'variant':16s}{'req/s':>8s}{'p50 ms':>9s}{'p99 ms':>9s}{'errors':>8s}{'batch':>7s}")
    for r in results:
        print(f"{r['variant']:16s}{r['requests_per_s']:8.2f}{r['p50_ms']:9.1f}{r['p99_ms']:9.1f}{r['errors']:8d}"
              f"{r['mean_batch'] or 0:7.2f}")
    if len(results) == 2:
        print(f"batching: {results[0]['requests_per_s'] / results[1]['requests_per_s']:.2f}x one at a time")


if __name__ == "__main__":
    main()
