"""What a person watching `embedctl index` or `embedctl score` sees: rich progress bars on stderr while it runs.

A bar shows items done (of the total when the input knows it), tokens/s (items/s where nothing is
embedded), elapsed time and the ETA. A run opens one bar per phase (score: ranking, then
reranking). Bars are not the run's summary line, which the command prints after they have gone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

from pipelines.progress import Progress as PipelineProgress

# (label, unit) -> the callback that moves a new bar, e.g. bars("embedding", "rows").
Bars = Callable[[str, str], PipelineProgress]


@contextmanager
def progress_bars(enabled: bool) -> Iterator[Bars | None]:
    """Yields a maker of bars, each with its own pipelines.progress callback; None when disabled."""
    if not enabled:
        yield None
        return
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[unit]}"),
               TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("{task.fields[eta]}"),
               TimeRemainingColumn()]
    with Progress(*columns, console=Console(stderr=True), transient=True) as display:

        def bar(label: str, unit: str) -> PipelineProgress:
            task: TaskID | None = None

            def update(done: int, tokens: int, total: int | None) -> None:
                nonlocal task
                if task is None:  # a phase's clock starts at its first report, and the phase before it has ended
                    for earlier in display.task_ids:
                        display.stop_task(earlier)
                    task = display.add_task(label, total=None, unit=unit, rate="", eta="")
                elapsed = next(t for t in display.tasks if t.id == task).elapsed or 0.0
                rate = "" if not elapsed else (f"{tokens / elapsed:,.0f} tokens/s" if tokens
                                               else f"{done / elapsed:,.0f} {unit}/s")
                # Without a total there is no ETA, and TimeRemainingColumn shows nothing: so no label either.
                display.update(task, completed=done, total=total, rate=rate, eta="ETA" if total else "")

            return update

        yield bar
