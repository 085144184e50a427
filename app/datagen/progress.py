"""Progress of a datagen run: a live rich bar on a terminal, a periodic plain line in logs."""

from __future__ import annotations

import contextlib
import time
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

LOG_EVERY_S = 30.0
"""Seconds between plain progress lines when the output is not a terminal (container logs)."""


class _RateColumn(ProgressColumn):
    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:.2f} rec/s" if speed else "- rec/s", style="progress.data.speed")


class DatagenProgress:
    """Counts records as they finish; `done` and `failed` are what the bar shows."""

    def __init__(self, console: Console, total: int) -> None:
        self.console = console
        self.total = total
        self.done = 0
        self.failed = 0
        self._started = time.monotonic()
        self._last_line = self._started
        self._bar: Progress | None = None
        if console.is_terminal:
            self._bar = Progress(
                TextColumn("datagen"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("[red]{task.fields[failed]} failed"),
                _RateColumn(),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=console,
            )
            self._task = self._bar.add_task("datagen", total=total, failed=0)

    def __enter__(self) -> DatagenProgress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._bar is not None:
            # a closed terminal (SIGHUP) fails the last redraw with EIO: the run must still commit and report
            with contextlib.suppress(OSError):
                self._bar.stop()

    def advance(self, failed: bool) -> None:
        if failed:
            self.failed += 1
        else:
            self.done += 1
        if self._bar is not None:
            self._bar.update(self._task, advance=1, failed=self.failed)
            return
        now = time.monotonic()
        if now - self._last_line >= LOG_EVERY_S:
            self._last_line = now
            self.console.print(self._line(now))

    def _line(self, now: float) -> str:
        finished = self.done + self.failed
        elapsed = now - self._started
        rate = finished / elapsed if elapsed > 0 else 0.0
        eta = f"{(self.total - finished) / rate:.0f} s" if rate > 0 else "unknown"
        return (
            f"datagen: {finished}/{self.total} ({self.done} done, {self.failed} failed), "
            f"{rate:.2f} records/s, ETA {eta}"
        )
