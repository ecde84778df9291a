"""What a training loop reports and listens to: metrics.jsonl + TensorBoard, GPU memory,
temperature and clocks (read only), a STOP file and SIGINT/SIGTERM, and the thermal pause."""

from __future__ import annotations

import json
import math
import signal
import time
from pathlib import Path

import torch

from groundtune.data.records import atomic_write

STOP_FILE = "STOP"


class MetricsLog:
    """One JSON object per line in RUN/metrics.jsonl, mirrored to TensorBoard event files in RUN/tb.
    A resumed run (``resume_step``: its checkpoint's step) drops what was logged after that step,
    which it replays, so each step is in the log once however often the run was resumed."""

    def __init__(self, run: Path, resume_step: int | None = None):
        self.path = run / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            kept = [line for line in self.path.read_text(encoding="utf-8").splitlines(keepends=True)
                    if _logged_step(line) <= resume_step]
            with atomic_write(self.path) as f:
                f.writelines(kept)
        self.file = open(self.path, "a", encoding="utf-8")
        try:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard drops the events past the checkpoint too
            self.tb = SummaryWriter(str(run / "tb"), purge_step=None if resume_step is None else resume_step + 1)
        except ImportError:  # tensorboard is a dependency, but a broken install must not stop training
            self.tb = None

    def log(self, step: int, values: dict) -> None:
        # strict JSON (what other readers than Python's take): a NaN or infinite value is written as
        # null and its name listed under "nonfinite"; TensorBoard gets the value itself
        nonfinite = [k for k, v in values.items() if isinstance(v, float) and not math.isfinite(v)]
        record = {"step": step, "time": round(time.time(), 3),
                  **{k: None if k in nonfinite else v for k, v in values.items()},
                  **({"nonfinite": nonfinite} if nonfinite else {})}
        self.file.write(json.dumps(record, allow_nan=False) + "\n")
        self.file.flush()
        if self.tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tb.add_scalar(key, value, step)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def _logged_step(line: str) -> float:
    """The step of a metrics.jsonl line; a line cut off by a kill is past any checkpoint."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


def gpu_stats(device: torch.device) -> dict:
    """Allocated/peak memory, and temperature/clocks through NVML when present. Reads only."""
    if device.type != "cuda":
        return {}
    gib = 1024**3
    stats = {
        "gpu_mem_alloc_gib": round(torch.cuda.memory_allocated(device) / gib, 3),
        "gpu_mem_peak_gib": round(torch.cuda.max_memory_allocated(device) / gib, 3),
    }
    temp = gpu_temperature(device)
    if temp is not None:
        stats["gpu_temp_c"] = temp
    try:
        stats["gpu_clock_mhz"] = torch.cuda.clock_rate(device)
    except Exception:  # NVML missing or not permitted: the numbers are optional
        pass
    return stats


def gpu_temperature(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    try:
        return int(torch.cuda.temperature(device))
    except Exception:  # NVML missing or not permitted
        return None


def thermal_pause(device: torch.device, pause_c: int, resume_c: int, log=print, poll_s: float = 10.0,
                  read_temperature=gpu_temperature) -> float:
    """Wait while the GPU is at or above ``pause_c`` until it cools to ``resume_c``. Never touches
    fans, clocks or power limits; returns the seconds waited. ``read_temperature(device)`` gives
    °C or None (NVML by default)."""
    if not pause_c:
        return 0.0
    temp = read_temperature(device)
    if temp is None or temp < pause_c:
        return 0.0
    start = time.time()
    log(f"GPU at {temp} °C >= {pause_c} °C: pausing until it is at or below {resume_c} °C")
    while temp is not None and temp > resume_c:
        time.sleep(poll_s)
        temp = read_temperature(device)
    return time.time() - start


class StopRequest:
    """True once RUN/STOP exists or SIGINT/SIGTERM arrived; the loop then saves and exits cleanly.
    A second Ctrl-C falls through to Python's default and interrupts at once."""

    def __init__(self, run: Path):
        self.stop_file = run / STOP_FILE
        self.signalled: str | None = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: rely on the STOP file alone
                pass
        return self

    def _handle(self, signum, frame):
        self.signalled = signal.Signals(signum).name
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @property
    def reason(self) -> str | None:
        if self.signalled:
            return self.signalled
        if self.stop_file.exists():
            return f"{self.stop_file} exists"
        return None
