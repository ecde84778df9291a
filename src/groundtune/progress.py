"""What the terminal shows: progress bars for every long loop, one look everywhere (rich), and
not the libraries' notes that are no business of the user's.

Where stderr is not a terminal (``groundtune train ... > log 2>&1``, nohup, CI) a bar would be
noise, so each long loop prints a plain line instead: where it is, its bar's summary (training's
loss and samples/s), the time so far and left. The first comes a few seconds in, then one every
GROUNDTUNE_PROGRESS_EVERY seconds (default 30; 0: none), and a last one when the loop ends, if it
ran long enough to print any. Under torchrun, rank 0's alone."""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from typing import Iterable, Iterator, TypeVar

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from groundtune.errors import UsageError

T = TypeVar("T")

EVERY_ENV = "GROUNDTUNE_PROGRESS_EVERY"
EVERY_S = 30.0  # between two plain lines: a log a person reads, not one line a step
FIRST_S = 5.0  # the first plain line, sooner: the run is alive, and how fast it goes


def progress_every() -> float:
    """Seconds between plain progress lines (GROUNDTUNE_PROGRESS_EVERY, else 30); 0: none."""
    raw = os.environ.get(EVERY_ENV, "").strip()
    if not raw:
        return EVERY_S
    try:
        every = float(raw)
    except ValueError:
        every = -1.0
    if not every >= 0:  # negative or NaN
        raise UsageError(f"{EVERY_ENV}={raw}: expected seconds between progress lines, a number >= 0 "
                         "(0: none)")
    return every


def progress_bar(transient: bool = False) -> Progress:
    """A rich Progress with count, elapsed and ETA columns when stderr is a terminal; else plain
    lines every GROUNDTUNE_PROGRESS_EVERY seconds (logs and CI stay readable)."""
    terminal = sys.stderr.isatty()
    every = progress_every()
    return _Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
        console=Console(stderr=True),
        disable=not terminal,
        transient=transient,
        every=every if not terminal and every > 0 and os.environ.get("RANK", "0") == "0" else None,
    )


class _Progress(Progress):
    """rich's Progress, and where its bars are off, a plain line per task every ``every`` seconds
    (None: none), printed when the task moves (a loop that stalls prints nothing new)."""

    def __init__(self, *columns, every: float | None = None, **kwargs):
        super().__init__(*columns, **kwargs)
        self.every, self.clock = every, time.monotonic
        self.plain: dict[TaskID, dict] = {}  # task -> when it started, from where, when it prints next

    def add_task(self, description: str, *args, **kwargs) -> TaskID:
        task = super().add_task(description, *args, **kwargs)
        now = self.clock()
        start = self._task(task).completed  # a resumed run's step
        self.plain[task] = {"t0": now, "from": start, "next": now + min(FIRST_S, self.every or 0), "lines": 0}
        return task

    def update(self, task_id: TaskID, **kwargs) -> None:
        before = self._task(task_id).completed
        super().update(task_id, **kwargs)
        if self._task(task_id).completed != before:  # a new summary alone waits for the step it belongs to
            self._plain_line(task_id)

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._plain_line(task_id)

    def stop(self) -> None:
        for task, state in self.plain.items():
            if state["lines"]:  # the loop's end, in a log that showed its progress
                self._plain_line(task, last=True)
        super().stop()

    def _task(self, task_id: TaskID):
        with self._lock:
            return self._tasks[task_id]

    def _plain_line(self, task_id: TaskID, last: bool = False) -> None:
        state, now = self.plain.get(task_id), self.clock()
        if self.every is None or state is None or not (last or now >= state["next"]):
            return
        state["next"], state["lines"] = now + self.every, state["lines"] + 1
        line = plain_line(self._task(task_id), now - state["t0"], state["from"], last)
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)


def plain_line(task, elapsed: float, start: float, last: bool = False) -> str:
    """``train 120/2000 (6%)  loss 0.4123 ... 41.2 samples/s  elapsed 4m10s, ETA 1h05m``: a rich
    task's progress as one line of a log; the ETA from the rate since ``start`` (where it began:
    a resumed run's step)."""
    done, total = task.completed, task.total
    where = f"{done:,.0f}/{total:,.0f} ({done / total:.0%})" if total else f"{done:,.0f}"
    info = str(task.fields.get("info") or "").strip()
    rate = (done - start) / elapsed if elapsed > 0 else 0.0
    if last:
        when = f"{'done' if total and done >= total else 'stopped'} after {_duration(elapsed)}"
    else:
        left = f", ETA {_duration((total - done) / rate)}" if total and rate > 0 else ""
        when = f"elapsed {_duration(elapsed)}{left}"
    return "  ".join(part for part in (f"{task.description} {where}", info, when) if part)


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"


def track(items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
    """Iterate with a progress bar."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with progress_bar() as bar:
        task = bar.add_task(description, total=total, info="")
        for item in items:
            yield item
            bar.advance(task)


class _DropMessages(logging.Filter):
    def __init__(self, *starts: str):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def quiet_libraries() -> None:
    """Keep the libraries' notes about themselves off the terminal, each named here with why it is
    none of the user's business. Called once by each process the command line starts."""
    # transformers draws a bar on every model load ("Loading weights"), huggingface_hub one per
    # file: the command line's own lines say what loads. HF_HUB_DISABLE_PROGRESS_BARS (cli) turns
    # them off for a library imported after it is set; each reads it once, on import, so one
    # already imported (a program that imported it before calling the command line) is told here.
    if "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].utils.disable_progress_bars()
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()
    # peft reads transformers' `is_gradient_checkpointing`, which transformers 5 deprecates: a
    # FutureWarning on every command that loads a LoRA model, about code that is not the user's
    warnings.filterwarnings("ignore", message=r".*`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    # accelerate imports DeepSpeed (when installed) to unwrap a model before saving it; DeepSpeed
    # then announces on a CPU machine that it found no GPU. Its logger is made on that import with
    # a level of its own, so a filter (which it keeps) is what silences the one line.
    logging.getLogger("DeepSpeed").addFilter(_DropMessages("Setting accelerator to CPU"))
