"""What a person watching `embedctl index` or `embedctl score` sees: rich progress bars on stderr while it runs.

A bar shows items done (of the total when the input knows it), tokens/s (items/s where nothing is
embedded; tokens/s counted from the first embedded batch, so that the model's load, which the run's summary
also leaves out, does not drag it down), elapsed time and the ETA. A run opens one bar per phase (score:
ranking, then reranking). Bars are not the run's summary line, which the command prints after they have gone.
"""

from __future__ import annotations

import time
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
            token_rate = TokenRate()

            def update(done: int, tokens: int, total: int | None) -> None:
                nonlocal task
                if task is None:  # a phase's clock starts at its first report, and the phase before it has ended
                    for earlier in display.task_ids:
                        display.stop_task(earlier)
                    task = display.add_task(label, total=None, unit=unit, rate="", eta="")
                elapsed = next(t for t in display.tasks if t.id == task).elapsed or 0.0
                if tokens:
                    per_second = token_rate(tokens, time.monotonic())
                    rate = "" if per_second is None else f"{per_second:,.0f} tokens/s"
                else:
                    rate = f"{done / elapsed:,.0f} {unit}/s" if elapsed else ""
                # Without a total there is no ETA, and TimeRemainingColumn shows nothing: so no label either.
                display.update(task, completed=done, total=total, rate=rate, eta="ETA" if total else "")

            return update

        yield bar


class TokenRate:
    """Tokens per second since the first report that counted tokens: the time before it went to loading the model
    and to the first batch, whose start no report marks."""

    def __init__(self) -> None:
        self._first: tuple[float, int] | None = None  # (when, tokens) of the first report with tokens

    def __call__(self, tokens: int, now: float) -> float | None:
        """The rate at now, with tokens counted so far; None until a second report gives it a span."""
        if self._first is None:
            self._first = (now, tokens)
            return None
        since, counted = self._first
        return (tokens - counted) / (now - since) if now > since else None
