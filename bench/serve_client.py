"""Can a load generator keep up? httpx against a server that answers at once (FastAPI on uvicorn,
the request's base64 image decoded and nothing else), at 16 and 128 requests in flight: one client
whose pool holds every connection (what bench/serve_load.py did until 2026-12-05) against a client
per connection (what it does now). Bodies: the bench's COCO-sized JPEGs, base64, as serve_load
sends them. The server runs on core 0, the client on core 1 where there are two.

    python bench/serve_client.py --out bench/results/serve_client.json   # ~1 min on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from provenance import stamped
from serve_load import connections, positive_ints
from sft_speed import make_refcoco_like

from groundtune.cli.flags import positive_int

APP = '''
import base64
from fastapi import FastAPI
from pydantic import BaseModel

app = FastAPI()


class Body(BaseModel):
    image: str
    phrase: str


@app.post("/v1/ground")
async def ground(body: Body):
    return {"bytes": len(base64.b64decode(body.image)), "phrase": body.phrase}
'''


async def load(url: str, bodies: list[dict], requests: int, concurrency: int, shared_pool: bool) -> dict:
    queue, latencies = iter(range(requests)), []

    async def worker(client: httpx.AsyncClient) -> None:
        for i in queue:
            start = time.perf_counter()
            (await client.post(url, json=bodies[i % len(bodies)])).raise_for_status()
            latencies.append(time.perf_counter() - start)

    async with contextlib.AsyncExitStack() as stack:
        clients = await connections(stack, concurrency, shared_pool)  # serve_load's own clients
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for client in clients))
        seconds = time.perf_counter() - start
    return {"client": "one pool" if shared_pool else "a client per connection", "concurrency": concurrency,
            "requests": requests, "requests_per_s": round(requests / seconds, 1),
            "mean_latency_ms": round(sum(latencies) / len(latencies) * 1000, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=positive_int, default=1000)
    parser.add_argument("--concurrency", type=positive_ints, default="16,128",
                        help="requests in flight, a comma-separated list: each is run")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.out and not Path(args.out).resolve().parent.is_dir():
        parser.error(f"--out {args.out}: its folder does not exist")
    two = len(os.sched_getaffinity(0)) >= 2
    with tempfile.TemporaryDirectory() as tmp:
        data = make_refcoco_like(Path(tmp) / "data", 32)  # (its train.jsonl)
        bodies = [{"image": base64.b64encode(p.read_bytes()).decode(), "phrase": "the man"}
                  for p in sorted((data.parent / "images").glob("*.jpg"))]
        (Path(tmp) / "instant.py").write_text(APP)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = subprocess.Popen([*(["taskset", "-c", "0"] if two else []), sys.executable, "-m", "uvicorn",
                                   "instant:app", "--port", str(port), "--log-level", "warning"], cwd=tmp)
        try:
            url = f"http://127.0.0.1:{port}/v1/ground"
            for _ in range(100):
                with contextlib.suppress(httpx.HTTPError):
                    httpx.get(f"http://127.0.0.1:{port}/docs")
                    break
                time.sleep(0.2)
            if two:
                os.sched_setaffinity(0, {1})
            rows = []
            for concurrency in args.concurrency:
                for shared_pool in (True, False):
                    rows.append(asyncio.run(load(url, bodies, args.requests, concurrency, shared_pool)))
                    print(json.dumps(rows[-1]), flush=True)
        finally:
            server.terminate()
            server.wait(timeout=30)
    if args.out:
        Path(args.out).write_text(json.dumps(stamped(rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
