"""What the terminal shows: progress bars for every long loop, one look everywhere (rich), and
not the libraries' notes that are no business of the user's."""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Iterable, Iterator, TypeVar

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

T = TypeVar("T")


def progress_bar(transient: bool = False) -> Progress:
    """A rich Progress with count, elapsed and ETA columns; quiet when stderr is not a terminal
    (logs and CI stay readable)."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
        console=Console(stderr=True),
        disable=not sys.stderr.isatty(),
        transient=transient,
    )


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
    # peft reads transformers' `is_gradient_checkpointing`, which transformers 5 deprecates: a
    # FutureWarning on every command that loads a LoRA model, about code that is not the user's
    warnings.filterwarnings("ignore", message=r".*`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    # accelerate imports DeepSpeed (when installed) to unwrap a model before saving it; DeepSpeed
    # then announces on a CPU machine that it found no GPU. Its logger is made on that import with
    # a level of its own, so a filter (which it keeps) is what silences the one line.
    logging.getLogger("DeepSpeed").addFilter(_DropMessages("Setting accelerator to CPU"))
