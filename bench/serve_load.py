"""Load on `groundtune serve`: N grounding requests at concurrency C, with batching and without.

    python bench/serve_load.py --out bench/results/serve_load.json           # tiny model, CPU: 2,000 at 64
    python bench/serve_load.py --model random:qwen2.5-vl-3b --device cuda --data DIR/train.jsonl \
        --requests 1024 --concurrency 128 --batch-size 64 --max-new-tokens 32 --eval-too \
        --unbatched-requests 32                                              # the 3B on a GPU, beside eval
    python bench/serve_load.py --url http://127.0.0.1:8000 --requests 500    # a server already running

With --model (the default), the script starts the real server twice on 127.0.0.1 (uvicorn, a free
port): with --batch-size and with batching off (--batch-size 1), sends the same requests to each,
and reports requests/s, p50/p99 latency, errors and the mean batch (from /metrics), and the ratio.
Requests are /v1/ground with one phrase each: one of 32 distinct synthetic scenes (PNG, base64),
or with --data the records of a JSONL file, their image files sent as they are on disk.
--eval-too also times `groundtune eval`'s own code (``evaluate.evaluate``) on the same images and
phrases at the same batch size, in a process of its own before the servers start: the ratio the
server is measured by. Both are timed warm: eval after a whole pass, each server after four
batches' worth of requests (a CUDA-graph capture of a new batch shape costs ~1 s on the 3B, paid
once by a running server). Random weights seldom stop, so on a random architecture every answer runs
to --max-new-tokens in both. Zero errors is required: any non-200 answer is counted and printed.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from provenance import stamped

from groundtune.cli.flags import positive_int
from groundtune.data import synth
from groundtune.data.records import image_path, read_samples
from serving import launch


def from_records(data: Path, n: int) -> list[dict]:
    """The first n records of a JSONL file as request bodies: the image file's own bytes (base64)."""
    return [{"image": base64.b64encode(image_path(r, data).read_bytes()).decode(), "phrase": r["phrase"]}
            for r in read_samples(data)[:n]]


def time_eval(model: str, device: str, data: Path, n: int, batch_size: int, max_new_tokens: int | None) -> dict:
    """`groundtune eval`'s code on the first n records, in a process of its own (the GPU is the
    server's afterwards): loaded as the server loads it, one whole pass to warm up (every batch
    shape captured), then a second, timed."""
    code = f"""
import json, time
from pathlib import Path
from groundtune import evaluate, infer
from groundtune.data.records import read_samples
data = Path({str(data)!r})
records = read_samples(data)[:{n}]
gm = infer.load({model!r}, device={device!r})
kw = dict(batch_size={batch_size}, progress=False, **({{}} if {max_new_tokens!r} is None else {{"max_new_tokens": {max_new_tokens!r}}}))
evaluate.evaluate(gm, records, data, **kw)
start = time.perf_counter()
evaluate.evaluate(gm, records, data, **kw)
seconds = time.perf_counter() - start
print(json.dumps({{"samples": len(records), "seconds": round(seconds, 2), "samples_per_s": round(len(records) / seconds, 2)}}))
"""
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"the eval run failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def positive_ints(text: str) -> list[int]:
    """An argparse type: positive integers, comma-separated."""
    return [positive_int(part) for part in text.split(",")]


positive_ints.__name__ = "comma-separated positive integers"


async def connections(stack: contextlib.AsyncExitStack, concurrency: int, shared_pool: bool = False) -> list:
    """An httpx client for each of ``concurrency`` requests in flight, closed with ``stack``. One
    client's pool of C connections does O(C) bookkeeping per request (httpcore's request
    assignment): at 128 in flight against a server that answers at once, one pool sent 151
    requests/s, a client per connection 1,119 (bench/serve_client.py), and the 3B server measured
    ~40/s through one pool. ``shared_pool``: that one client, C times (how this bench loaded the
    server until 2026-12-05; serve_client.py measures it)."""
    if shared_pool:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        return [await stack.enter_async_context(httpx.AsyncClient(timeout=300, limits=limits))] * concurrency
    return [await stack.enter_async_context(httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=1)))
            for _ in range(concurrency)]


async def load(url: str, bodies: list[dict], requests: int, concurrency: int, api_key: str | None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    latencies, errors = [], {}
    queue = iter(range(requests))

    async def worker(client: httpx.AsyncClient) -> None:  # one connection of its own
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

    async with contextlib.AsyncExitStack() as stack:
        clients = await connections(stack, concurrency)  # made before the clock starts
        before = _metrics((await clients[0].get(url + "/metrics", headers=headers)).text)
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for client in clients))
        seconds = time.perf_counter() - start
        after = _metrics((await clients[0].get(url + "/metrics", headers=headers)).text)
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}

    def mean(name: str, scale: float = 1.0, labels: str = "") -> float | None:  # over this load alone
        count = delta.get(f"groundtune_{name}_count{labels}", 0)
        return round(delta[f"groundtune_{name}_sum{labels}"] / count * scale, 2) if count else None

    latencies.sort()
    return {"requests": requests, "concurrency": concurrency, "seconds": round(seconds, 2),
            "requests_per_s": round(requests / seconds, 2),
            "p50_ms": round(statistics.median(latencies) * 1000, 1),
            "p99_ms": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1000, 1),
            "errors": sum(errors.values()), "error_statuses": errors,
            "mean_batch": mean("batch_size"),
            # where a request's time went on the server (from its own metrics)
            "model_busy": round(delta.get("groundtune_batch_seconds_sum", 0) / seconds, 3),
            "mean_batch_ms": mean("batch_seconds", 1000), "mean_encode_ms": mean("encode_seconds", 1000),
            "mean_queue_ms": mean("queue_seconds", 1000),
            # the server's own time on a request (the rest of the client's latency: HTTP and the client)
            "mean_server_ms": mean("request_seconds", 1000, '{endpoint="/v1/ground"}'),
            "mean_latency_ms": round(statistics.mean(latencies) * 1000, 1)}


def _metrics(text: str) -> dict[str, float]:
    """The server's /metrics: the samples by name (a labelled one by its name and labels, as written)."""
    return {line.rsplit(" ", 1)[0]: float(line.split()[-1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server (else one is started with --model)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--unbatched-requests", type=int, help="requests for the one-at-a-time run (default: --requests)")
    parser.add_argument("--concurrency", type=positive_ints, default="64",
                        help="requests in flight; a comma-separated list loads the batched server at each "
                             "(the one-at-a-time server at the first)")
    parser.add_argument("--batch-size", type=int, default=16, help="the server's batch (batching on)")
    parser.add_argument("--max-new-tokens", type=int, help="the server's (and --eval-too's) answer length limit")
    parser.add_argument("--image-size", default="168x168", help="WxH of the synthetic scenes")
    parser.add_argument("--data", type=Path, help="send these records' images and phrases (JSONL) instead of scenes")
    parser.add_argument("--eval-too", action="store_true", help="also time groundtune eval on the same requests")
    parser.add_argument("--api-key")
    parser.add_argument("--out")
    args = parser.parse_args()
    concurrencies = args.concurrency
    results = []

    def save(row: dict) -> None:
        results.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(stamped(results), indent=1) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        data = args.data
        if data is None:  # the scenes as files too, for --eval-too
            width, height = map(int, args.image_size.split("x"))
            data = synth.make_synthetic_set(Path(tmp), 32, seed=11, width=width, height=height, task="single",
                                            workers=1)
        bodies = from_records(data, min(args.requests, 512))
        if args.eval_too:
            save({"variant": "groundtune eval", "model": args.model, "device": args.device, "batch_size": args.batch_size,
                  **time_eval(args.model, args.device, data, len(bodies), args.batch_size, args.max_new_tokens)})
        runs = [("running server", None)] if args.url else [("batched", args.batch_size), ("one at a time", 1)]
        for name, batch_size in runs:
            requests = args.unbatched_requests if batch_size == 1 and args.unbatched_requests else args.requests
            flags = ["--device", args.device, "--batch-size", str(batch_size),
                     "--queue-size", str(max(256, max(concurrencies) * 2))]
            flags += ["--max-new-tokens", str(args.max_new_tokens)] if args.max_new_tokens else []
            process, url = (None, args.url) if args.url else launch(args.model, *flags, timeout_s=600)
            try:
                # warm-up: enough batches of the real mix for the server to capture its batch shapes
                # (a first capture costs ~1 s on the 3B: in the timed load it would count against it)
                asyncio.run(load(url, bodies, min(requests, 4 * batch_size), concurrencies[0], args.api_key))
                for concurrency in concurrencies if batch_size != 1 else concurrencies[:1]:
                    save({"variant": name, "model": args.model, "device": args.device, "batch_size": batch_size,
                          **asyncio.run(load(url, bodies, requests, concurrency, args.api_key))})
            finally:
                if process is not None:
                    process.terminate()
                    process.wait(timeout=30)
    print(f"\n{'variant':16s}{'in flight':>10s}{'req/s':>8s}{'p50 ms':>9s}{'p99 ms':>9s}{'errors':>8s}{'batch':>7s}"
          f"{'busy':>6s}{'encode ms':>10s}{'queue ms':>9s}{'batch ms':>9s}{'server ms':>10s}")
    for r in results:
        if r["variant"] == "groundtune eval":
            print(f"{r['variant']:16s}{'':10s}{r['samples_per_s']:8.2f}   (samples/s, batch {r['batch_size']})")
            continue
        print(f"{r['variant']:16s}{r['concurrency']:10d}{r['requests_per_s']:8.2f}{r['p50_ms']:9.1f}{r['p99_ms']:9.1f}"
              f"{r['errors']:8d}{r['mean_batch'] or 0:7.2f}{r['model_busy']:6.2f}{r['mean_encode_ms'] or 0:10.1f}"
              f"{r['mean_queue_ms'] or 0:9.1f}{r['mean_batch_ms'] or 0:9.1f}{r.get('mean_server_ms') or 0:10.1f}")
    batched = [r for r in results if r["variant"] == "batched"]
    alone = next((r for r in results if r["variant"] == "one at a time"), None)
    evaluated = next((r for r in results if r["variant"] == "groundtune eval"), None)
    for r in batched:
        if alone:
            print(f"batching, {r['concurrency']} in flight: {r['requests_per_s'] / alone['requests_per_s']:.2f}x "
                  "one at a time")
        if evaluated:
            print(f"served, {r['concurrency']} in flight: {r['requests_per_s'] / evaluated['samples_per_s']:.0%} "
                  "of groundtune eval's throughput at the same batch size")


if __name__ == "__main__":
    main()
