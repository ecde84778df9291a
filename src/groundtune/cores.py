"""The CPU cores this process may use, and torch's threads set to them.

torch sizes its thread pools by the machine's cores, not by this process's share of them (a
container's CPU quota: `docker run --cpus 2` on a 64-core host), so such a share runs dozens of
threads on two cores. And its OpenMP threads spin while they wait for one another: when anything
else wants the cores too, a thread that waits burns the time slice that the thread it waits for
needs. On a 2-core EPYC with a second training run beside it, the quickstart preset trained at
1.2-11.7 samples/s with torch's defaults against 13-34 with the waiting threads asleep; alone, at
50-59 against 44-47, the price of waking them (docs/training.md, "Training on a CPU").

The command line calls ``before_torch`` at the start of every command and ``use_cores`` before a
command that runs a model. No torch at import: ``groundtune plan`` and ``--help`` never load it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

# a container's CPU quota, as the container sees its own cgroup: cgroup v2, then v1
CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # "QUOTA PERIOD" or "max PERIOD"
CFS_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")  # -1: none
CFS_PERIOD = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def cores() -> int:
    """The cores this process may use: those it may run on (its CPU affinity, a taskset's or
    cpuset's share), fewer where a CPU quota allows less time than that (rounded up)."""
    try:
        n = len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # macOS, Windows: no affinity to ask
        n = os.cpu_count() or 1
    quota = cpu_quota()
    return max(1, min(n, math.ceil(quota))) if quota else n


def cpu_quota() -> float | None:
    """The cores' worth of time a CPU quota allows per period (2.0 for `--cpus 2`), None without one."""
    try:
        if CPU_MAX.exists():
            quota, period = CPU_MAX.read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        if CFS_QUOTA.exists():
            quota = int(CFS_QUOTA.read_text())
            return None if quota <= 0 else quota / int(CFS_PERIOD.read_text())
    except (OSError, ValueError):  # unreadable or not as documented: no quota known
        return None
    return None


def threads() -> int:
    """How many threads torch computes with: OMP_NUM_THREADS where the user set it (a whole
    number of at least 1), else ``cores()``."""
    try:
        wanted = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:  # unset, or not a number (OpenMP ignores that too)
        return cores()
    return wanted if wanted >= 1 else cores()


def before_torch() -> None:
    """What OpenMP reads once, when torch loads it, so it is set before anything imports torch
    (and passed on to every process a command starts): on a machine that is busy already (a load
    average above half the cores this process may use), threads that wait for work sleep rather
    than spin (OMP_WAIT_POLICY=PASSIVE); on a quiet one they spin, as OpenMP's default does: 15-20%
    faster alone (44-47 against 50-59 samples/s), 3-10x slower beside other work. A user's choice
    of how they wait (OMP_WAIT_POLICY, or GNU OpenMP's GOMP_SPINCOUNT) is kept. A spin of 1000 was
    tried between the two: as fast alone, half as fast as sleeping beside a second run."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    try:
        busy = os.getloadavg()[0] > cores() / 2
    except OSError:  # no load average to read (Windows): sleeping costs least when it is wrong
        busy = True
    if busy:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def use_cores() -> int:
    """torch's intra-op threads (OpenMP's and MKL's with them) and its inter-op threads set to
    ``threads()``; returns that number. DataLoader workers set their own to 1 (torch does), so
    they add no pool each."""
    import torch

    n = threads()
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:  # set once per process (an earlier command in this one): it stays
        pass
    return n
