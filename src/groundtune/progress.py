"""Progress bars for every long loop, one look everywhere (rich)."""

from __future__ import annotations

import sys
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
