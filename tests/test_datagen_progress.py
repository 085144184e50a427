"""A datagen run's progress (`app.datagen.progress`): the live bar on a terminal, the plain line every
LOG_EVERY_S seconds in a log, its rate and ETA, and a bar whose terminal went away."""

from __future__ import annotations

import errno
import io
import re
from types import SimpleNamespace

import pytest
from rich.console import Console
from rich.progress import Progress

from app.datagen import progress as progress_module
from app.datagen.progress import LOG_EVERY_S, DatagenProgress, _RateColumn


class Clock:
    """`time.monotonic` for the module under test: it moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(progress_module, "time", SimpleNamespace(monotonic=clock))
    return clock


def log_console() -> Console:
    return Console(file=io.StringIO(), width=200)


def terminal_console(file: io.StringIO | None = None) -> Console:
    return Console(file=file or io.StringIO(), width=120, force_terminal=True, color_system="standard")


def test_a_log_gets_a_line_every_log_every_s_with_rate_and_eta(clock: Clock) -> None:
    console = log_console()
    with DatagenProgress(console, total=10) as progress:
        clock.now += LOG_EVERY_S - 0.5
        progress.advance(failed=False)
        assert console.file.getvalue() == ""  # not yet LOG_EVERY_S since the start
        clock.now += 0.5
        progress.advance(failed=True)
        clock.now += 1.0
        progress.advance(failed=False)  # 1 s after the last line
        clock.now += LOG_EVERY_S + 9.0
        progress.advance(failed=False)
    assert (progress.done, progress.failed, progress.total) == (3, 1, 10)
    assert console.file.getvalue().splitlines() == [
        "datagen: 2/10 (1 done, 1 failed), 0.07 records/s, ETA 120 s",
        "datagen: 4/10 (3 done, 1 failed), 0.06 records/s, ETA 105 s",
    ]


def test_no_rate_yet_is_an_unknown_eta(clock: Clock) -> None:
    progress = DatagenProgress(log_console(), total=5)
    assert progress._line(clock.now) == "datagen: 0/5 (0 done, 0 failed), 0.00 records/s, ETA unknown"
    clock.now += 40.0
    assert progress._line(clock.now) == "datagen: 0/5 (0 done, 0 failed), 0.00 records/s, ETA unknown"
    progress.done = 2
    assert progress._line(clock.now - 40.0) == "datagen: 2/5 (2 done, 0 failed), 0.00 records/s, ETA unknown"
    assert progress._line(clock.now - 80.0) == "datagen: 2/5 (2 done, 0 failed), 0.00 records/s, ETA unknown"
    assert progress._line(clock.now) == "datagen: 2/5 (2 done, 0 failed), 0.05 records/s, ETA 60 s"
    assert progress._line(clock.now - 39.5) == "datagen: 2/5 (2 done, 0 failed), 4.00 records/s, ETA 1 s"


def test_a_terminal_gets_the_bar_and_no_log_lines(clock: Clock) -> None:
    console = terminal_console()
    with DatagenProgress(console, total=4) as progress:
        progress.advance(failed=False)
        progress.advance(failed=True)
        clock.now += 2 * LOG_EVERY_S
        progress.advance(failed=False)
        assert progress._bar is not None
        task = progress._bar.tasks[0]
        assert (task.completed, task.total, task.fields) == (3, 4, {"failed": 1})
    assert (progress.done, progress.failed) == (2, 1)
    shown = console.file.getvalue()
    assert "records/s" not in shown  # no log line on a terminal
    last = shown.rsplit("\r", 1)[-1]
    for part in ("datagen", "3/4", "1 failed", "rec/s", "ETA"):
        assert part in last, (part, last)
    assert "\x1b[31m1 failed" in last  # the failures in red


def bar_line(progress: DatagenProgress) -> str:
    """The bar as a terminal shows it now, without its colours (a bar without colour is blank)."""
    assert progress._bar is not None
    out = terminal_console()
    out.print(progress._bar.get_renderable())
    return re.sub(r"\x1b\[[0-9;]*m", "", out.file.getvalue()).rstrip("\n")


def test_the_bar_shows_counts_failures_rate_elapsed_and_eta(clock: Clock) -> None:
    progress = DatagenProgress(terminal_console(), total=4)
    assert bar_line(progress) == "datagen " + "━" * 40 + " 0/4 0 failed - rec/s 0:00:00 ETA -:--:--"
    progress.advance(failed=True)
    progress.advance(failed=False)
    progress.advance(failed=True)
    assert (progress.done, progress.failed) == (1, 2)
    line = bar_line(progress)
    assert re.fullmatch(r"datagen ━{30}╺━{9} 3/4 2 failed [0-9.]+ rec/s 0:00:0\d ETA \d:\d\d:\d\d", line), (
        line
    )


def test_a_log_gets_no_bar(clock: Clock) -> None:
    console = log_console()
    with DatagenProgress(console, total=4) as progress:
        progress.advance(failed=False)
    assert progress._bar is None and console.file.getvalue() == ""


class ClosedTerminal(io.StringIO):
    """A terminal that closed: every write fails with EIO, as a hung-up tty does."""

    def __init__(self) -> None:
        super().__init__()
        self.closed_now = False

    def write(self, text: str) -> int:
        if self.closed_now:
            raise OSError(errno.EIO, "Input/output error")
        return super().write(text)


def test_a_terminal_that_went_away_does_not_fail_the_end_of_the_run(clock: Clock) -> None:
    terminal = ClosedTerminal()
    progress = DatagenProgress(terminal_console(terminal), total=2)
    with progress:
        progress.advance(failed=False)
        terminal.closed_now = True
    assert progress.done == 1


def test_the_rate_column_prefers_the_finished_speed() -> None:
    bar = Progress(console=log_console())
    bar.add_task("datagen", total=10)
    task = bar.tasks[0]
    column = _RateColumn()
    unknown = column.render(task)
    assert (unknown.plain, str(unknown.style)) == ("- rec/s", "progress.data.speed")
    task.finished_speed = 2.5
    known = column.render(task)
    assert (known.plain, str(known.style)) == ("2.50 rec/s", "progress.data.speed")
    for moment, completed in [(0.0, 0), (2.0, 4)]:
        task._progress.append(SimpleNamespace(timestamp=moment, completed=completed))
    task.start_time = 0.0
    assert column.render(task).plain == "2.50 rec/s"  # the finished speed over the running one
    task.finished_speed = None
    assert column.render(task).plain == f"{task.speed:.2f} rec/s"
