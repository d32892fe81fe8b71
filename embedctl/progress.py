"""What a person watching `embedctl index` sees: a rich progress bar on stderr while it runs."""

from __future__ import annotations

from contextlib import contextmanager
from collections.abc import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from pipelines.index import IndexReport


@contextmanager
def index_progress(enabled: bool) -> Iterator:
    """Yields a callback for run_index that moves the bar; a no-op callback when disabled."""
    if not enabled:
        yield None
        return
    columns = [TextColumn("embedding"), BarColumn(), MofNCompleteColumn(), TextColumn("rows"),
               TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("index", total=None, rate="")

        def update(report: IndexReport, total_rows: int | None) -> None:
            elapsed = bar.tasks[0].elapsed or 0.0
            rate = f"{report.tokens / elapsed:,.0f} tokens/s" if elapsed else ""
            bar.update(task, completed=report.rows_written + report.skipped,
                       total=total_rows, rate=rate)

        yield update
