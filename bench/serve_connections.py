"""Connections that never send a whole request, against `groundtune serve`: /health, the log, memory.

    python bench/serve_connections.py --out bench/results/serve_connections.json     # 20,000, tiny, CPU
    python bench/serve_connections.py --old-src /tmp/old-gt/src --out ...            # and older code, the same way
    python bench/serve_connections.py --connections 40 --hold-s 2 --settle-s 1 --out /tmp/c.json   # smoke form

Starts the real server (``serve.launch``: the tiny model on the CPU, 127.0.0.1, its log to a
file), reads its resident memory idle, then opens CONNECTIONS connections from HOLDERS processes
of its own (one process may hold fewer descriptors than that: each raises its own soft
RLIMIT_NOFILE to what its share needs, up to the hard limit; each connects from an address of
its own, 127.0.0.2, .3, ..., so that the ports of one address are not used up): half idle (they
send nothing), half trickling (a request line and then one header byte every --trickle-s
seconds, never ending the headers). The holders keep what the server leaves open for --hold-s
seconds after the last one opened, then close them all (with a reset: no TIME_WAIT left to hold
the ports) and the server is given --settle-s seconds. The holders run at --holders-nice 10:
here they share the server's cores, and at an equal share four of them starved it of the CPU an
attacker's own machine would spend (its /health then waited for the CPU, not for the flood).

Two attacks, each against a fresh server: ``once`` (every connection opened once; one the server
closes stays closed) and ``reopening`` (one the server closes is opened again at once, until the
hold ends: the server is under the flood the whole time). Throughout, GET /health is asked every
--probe-s seconds on a new connection (its latency; a failure or one over 10 s counted); the
server's RSS (its own process: the one that holds the connections) is sampled; the log's growth
is its file's size. Reported per run: /health's latency (p50, max, failures), the holders' counts
(opened, failed to connect, closed by the server with and without an answer, still open at the
end), RSS idle / peak / after (and after minus idle), the log's bytes, and the server's own
/metrics counts of the connections it shed (``groundtune_connections_shed_total``). Targets
(issue 48): /health within 2 s throughout, the log under 1 MB, RSS after within 50 MB of idle.

``--old-src DIR`` runs the ``once`` attack against another source tree too (PYTHONPATH=DIR, e.g.
a clone at an older commit: ``git clone -q . /tmp/old-gt && git -C /tmp/old-gt checkout COMMIT``,
then ``--old-src /tmp/old-gt/src``): the before figures, with the clone's commit.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing
import os
import random
import re
import resource
import socket
import statistics
import struct
import subprocess
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path

import httpx
from provenance import stamped

from serving import launch

TRICKLE = b"GET /health HTTP/1.1\r\nHost: bench\r\nX-Trickle: "  # then one "a" at a time, never a blank line


def raise_open_files(wanted: int) -> int:
    """This process's soft RLIMIT_NOFILE raised to ``wanted`` (at most the hard limit); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        soft = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return soft


class Holder:
    """One holder process's connections (asyncio, plain non-blocking sockets)."""

    def __init__(self, n: int, port: int, source: str, trickle_s: float, reopen: bool):
        self.n, self.port, self.source, self.trickle_s, self.reopen = n, port, source, trickle_s, reopen
        self.counts: collections.Counter = collections.Counter()
        self.open: dict[socket.socket, str] = {}
        self.stopping = False
        self.tasks: set[asyncio.Task] = set()  # trickles and reopenings, cancelled at the end
        self.connecting = asyncio.Semaphore(256)  # connects in flight: the kernel's accept queue is finite

    async def connect(self, kind: str) -> None:
        loop = asyncio.get_running_loop()
        async with self.connecting:
            sock = socket.socket()
            sock.setblocking(False)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset
            try:
                sock.bind((self.source, 0))
                await asyncio.wait_for(loop.sock_connect(sock, ("127.0.0.1", self.port)), 10)
            except (OSError, asyncio.TimeoutError) as e:
                sock.close()
                self.counts[f"connect_failed_{type(e).__name__}"] += 1
                return
        self.counts["opened"] += 1
        self.open[sock] = kind
        loop.add_reader(sock.fileno(), self.readable, sock)
        if kind == "trickle":
            self.spawn(self.trickle(sock))

    def readable(self, sock: socket.socket) -> None:
        try:
            said = sock.recv(4096)
        except OSError:
            said = b""
        match = re.match(rb"HTTP/1\.1 (\d+)", said)
        self.closed(sock, f"answered_{match.group(1).decode()}" if match else "closed_without_answer")

    def closed(self, sock: socket.socket, how: str) -> None:
        kind = self.open.pop(sock, None)
        if kind is None:
            return
        asyncio.get_running_loop().remove_reader(sock.fileno())
        sock.close()
        self.counts[f"{kind}_{how}"] += 1
        if self.reopen and not self.stopping:
            self.counts["reopened"] += 1
            self.spawn(self.connect(kind))

    def spawn(self, coroutine) -> None:
        task = asyncio.ensure_future(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def trickle(self, sock: socket.socket) -> None:
        sent = 0
        await asyncio.sleep(random.uniform(0, self.trickle_s))
        while sock in self.open and not self.stopping:
            try:
                sock.send(TRICKLE[sent:sent + 1] or b"a")
            except OSError:
                self.closed(sock, "closed_without_answer")
                return
            sent += 1
            await asyncio.sleep(self.trickle_s)

    async def run(self, hold_s: float, opened, release) -> dict:
        await asyncio.gather(*(self.connect("idle" if i % 2 == 0 else "trickle") for i in range(self.n)))
        opened.set()
        while not release.is_set():  # until every holder has opened its share, and then the hold
            await asyncio.sleep(0.05)
        await asyncio.sleep(hold_s)
        self.stopping = True
        self.counts["open_at_end"] = len(self.open)
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for sock in list(self.open):
            asyncio.get_running_loop().remove_reader(sock.fileno())
            sock.close()
        return dict(self.counts)


def _hold(n: int, port: int, source: str, trickle_s: float, reopen: bool, hold_s: float, nice: int, opened,
          release, results) -> None:
    os.nice(nice)
    raise_open_files(n + 64)
    results.put(asyncio.run(Holder(n, port, source, trickle_s, reopen).run(hold_s, opened, release)))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


class Watch:
    """/health every ``probe_s`` on a new connection, and the server's RSS, on a thread of its own."""

    def __init__(self, url: str, pid: int, probe_s: float):
        self.url, self.pid, self.probe_s = url, pid, probe_s
        self.latencies: list[float] = []
        self.slow: list[tuple[float, float]] = []  # (seconds since the watch began, latency) of those over 0.5 s
        self.began = time.perf_counter()
        self.failures: collections.Counter = collections.Counter()
        self.rss: list[float] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.watch)

    def watch(self) -> None:
        while not self.done.is_set():
            start = time.perf_counter()
            try:
                answer = httpx.get(self.url + "/health", timeout=10)
                if answer.status_code == 200:
                    self.latencies.append(time.perf_counter() - start)
                    if self.latencies[-1] > 0.5:
                        self.slow.append((round(start - self.began, 2), round(self.latencies[-1], 3)))
                else:
                    self.failures[f"status_{answer.status_code}"] += 1
            except httpx.HTTPError as e:
                self.failures[type(e).__name__] += 1
            self.rss.append(rss_mb(self.pid))
            self.done.wait(max(0.0, self.probe_s - (time.perf_counter() - start)))

    def summary(self) -> dict:
        ms = sorted(x * 1000 for x in self.latencies)
        return {"probes": len(ms) + sum(self.failures.values()), "failures": dict(self.failures),
                "p50_ms": round(statistics.median(ms), 1) if ms else None,
                "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 1) if ms else None,
                "max_ms": round(ms[-1], 1) if ms else None, "over_1_s": sum(x > 1000 for x in ms),
                "over_2_s": sum(x > 2000 for x in ms), "slowest": sorted(self.slow, key=lambda x: -x[1])[:8]}


def shed(url: str) -> dict:
    """The server's counts of connections it closed before a request (absent from older code)."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError as e:
        return {"error": type(e).__name__}
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^groundtune_connections_shed_total\{reason="(\w+)"\} (\S+)$', text, re.M)}


def attack(url: str, pid: int, args, reopen: bool) -> dict:
    """One attack on a running server; its figures (the module's docstring)."""
    port = int(url.rsplit(":", 1)[1])
    context = multiprocessing.get_context("fork")
    release, results = context.Event(), context.Queue()
    shares = [args.connections // args.holders + (i < args.connections % args.holders) for i in range(args.holders)]
    opened = [context.Event() for _ in shares]
    holders = [context.Process(target=_hold, args=(n, port, f"127.0.0.{2 + i}", args.trickle_s, reopen, args.hold_s,
                                                   args.holders_nice, opened[i], release, results))
               for i, n in enumerate(shares)]
    start = time.perf_counter()
    for holder in holders:  # forked before the watching thread starts: a fork copies no running thread
        holder.start()
    watch = Watch(url, pid, args.probe_s)
    watch.thread.start()
    for event in opened:
        if not event.wait(600):
            raise RuntimeError("a holder did not open its connections within 10 minutes")
    opening_s = time.perf_counter() - start
    release.set()
    counts = collections.Counter()
    for _ in holders:
        counts.update(results.get(timeout=args.hold_s + 600))
    for holder in holders:
        holder.join()
    during = watch.summary()
    peak = max(watch.rss)
    watch.done.set()
    watch.thread.join()
    return {"opening_s": round(opening_s, 1), "holders": dict(sorted(counts.items())), "health_during": during,
            "peak_rss_mb": round(peak, 1)}


def measure(src: Path | None, args, reopen: bool) -> dict:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(src) + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        process, url = launch(args.model, "--device", "cpu", *args.server_flags.split(), timeout_s=300, env=env,
                              stdout=log, stderr=subprocess.STDOUT)
        try:
            httpx.get(url + "/health", timeout=30)
            time.sleep(2)
            idle = min(rss_mb(process.pid) for _ in range(5) if not time.sleep(0.2))
            log_before = os.path.getsize(log.name)
            result = attack(url, process.pid, args, reopen)
            time.sleep(args.settle_s)
            after = Watch(url, process.pid, args.probe_s)
            after.thread.start()
            time.sleep(min(3.0, args.settle_s + 1))
            after.done.set()
            after.thread.join()
            rss_after = min(rss_mb(process.pid) for _ in range(5) if not time.sleep(0.2))
            result.update({"health_after": after.summary(), "idle_rss_mb": round(idle, 1),
                           "after_rss_mb": round(rss_after, 1), "after_above_idle_mb": round(rss_after - idle, 1),
                           "peak_above_idle_mb": round(result["peak_rss_mb"] - idle, 1),
                           "log_bytes": os.path.getsize(log.name) - log_before, "shed": shed(url),
                           "server_alive": process.poll() is None})
            log.seek(log_before)
            result["log_head"] = log.read(2000)  # what the log said first, cut short
        finally:
            process.kill()
            process.wait(timeout=30)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", type=int, default=20_000)
    parser.add_argument("--holders", type=int, default=4, help="processes holding the connections")
    parser.add_argument("--hold-s", type=float, default=30.0, help="held this long after the last one opened")
    parser.add_argument("--trickle-s", type=float, default=5.0, help="a trickling connection's seconds a byte")
    parser.add_argument("--holders-nice", type=int, default=10,
                        help="the holders' niceness: the server, as on a machine of its own, is not starved by "
                             "the attacker's processes on the same cores")
    parser.add_argument("--probe-s", type=float, default=0.25, help="GET /health every this many seconds")
    parser.add_argument("--settle-s", type=float, default=5.0, help="after the holders close, before 'after'")
    parser.add_argument("--attacks", default="once,reopening")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--server-flags", default="", help="more flags for the server, as one string")
    parser.add_argument("--old-src", type=Path, help="also attack (once) this source tree (PYTHONPATH)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    raise_open_files(256)
    result = {"connections": args.connections, "holders": args.holders, "holders_nice": args.holders_nice,
              "hold_s": args.hold_s,
              "trickle_s": args.trickle_s, "server_flags": args.server_flags,
              "open_files_limit": dict(zip(("soft", "hard"), resource.getrlimit(resource.RLIMIT_NOFILE))),
              "server_versions": {p: metadata.version(p) for p in ("uvicorn", "h11", "fastapi", "starlette")},
              "targets": {"health_max_ms": 2000, "log_bytes": 2**20, "after_above_idle_mb": 50}, "runs": {}}
    runs = [(name, None, name == "reopening") for name in args.attacks.split(",") if name]
    runs += [("old code: once", args.old_src, False)] if args.old_src else []
    for name, src, reopen in runs:
        load = os.getloadavg()[0]  # the machine may be shared: what else ran is part of the figure
        result["runs"][name] = measure(src, args, reopen)
        result["runs"][name]["load_average_1min"] = [round(load, 2), round(os.getloadavg()[0], 2)]
        if src is not None:
            result["runs"][name]["src"] = str(src)
            result["runs"][name]["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=src, capture_output=True,
                                                            text=True).stdout.strip() or None
        print(name, json.dumps({k: v for k, v in result["runs"][name].items() if k != "log_head"}), flush=True)
        if args.out:
            args.out.write_text(json.dumps(stamped(result), indent=1) + "\n")


if __name__ == "__main__":
    main()
