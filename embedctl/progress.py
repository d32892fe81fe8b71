"""What a person watching `embedctl index` sees: a rich progress bar on stderr while it runs.

It shows rows done (of the total when the corpus knows it), tokens/s, elapsed time and the ETA. It
is not the run's summary line, which the command prints after the bar has gone.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from pipelines.index import Progress as IndexProgress


@contextmanager
def index_progress(enabled: bool) -> Iterator[IndexProgress | None]:
    """Yields a progress callback for run_index that moves the bar; None when disabled."""
    if not enabled:
        yield None
        return
    columns = [TextColumn("embedding"), BarColumn(), MofNCompleteColumn(), TextColumn("rows"),
               TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("{task.fields[eta]}"),
               TimeRemainingColumn()]
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("index", total=None, rate="", eta="")

        def update(rows: int, tokens: int, total_rows: int | None) -> None:
            elapsed = bar.tasks[0].elapsed or 0.0
            rate = f"{tokens / elapsed:,.0f} tokens/s" if elapsed else ""
            # Without a total there is no ETA, and TimeRemainingColumn shows nothing: so no label either.
            bar.update(task, completed=rows, total=total_rows, rate=rate, eta="ETA" if total_rows else "")

        yield update
