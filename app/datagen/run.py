"""One regeneration run over an output directory, whichever engine answers (docs/architecture.md,
Generation).

The run owns what both answerers (`app.datagen.runner`: servers over HTTP; `app.datagen.local`: the
target in this process) must do alike: the pending records (committed ids skipped), the rejects of
earlier runs carried until a record is retried or done, the settings check, the stop signals, the
shard buffer with its commits (a full shard, or whatever is buffered once `flush_interval_s` has
passed since the last commit, by a timer, so a hard kill loses at most that much of the answers),
and the report, completed once. Every record read ends up in exactly one of done, failed, skipped
or (after a stop) unfinished.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console

from app.config.schema import DatagenConfig
from app.datagen.progress import DatagenProgress
from app.datagen.prompts import PromptRecord, PromptSet, Skipped
from app.datagen.servers import Server
from app.datagen.store import ShardStore
from app.signals import stop_signals

SHOWN_SKIPS = 10
"""Malformed records listed one by one before the rest are only counted."""

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Signals that stop a run cleanly (commit, report, exit 128 + number): ^C, `kill`, a closed terminal."""


@dataclass
class DatagenReport:
    """What a run did: the accounting of every record read, throughput, and where things went."""

    input: int
    resumed: int
    malformed: int
    duplicate: int
    done: int = 0
    failed: int = 0
    unfinished: int = 0
    elapsed_s: float = 0.0
    completion_tokens: int = 0
    truncated: int = 0
    model: str | None = None
    stopped_by: str | None = None
    output_dir: Path = Path()
    rejects_path: Path | None = None
    rejected: int = 0
    shards: list[Path] = field(default_factory=list)
    servers: list[Server] = field(default_factory=list)

    @property
    def skipped(self) -> int:
        return self.resumed + self.malformed + self.duplicate

    @property
    def records_per_s(self) -> float:
        return self.done / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def exit_code(self) -> int:
        """128 + the signal after a stop signal, 1 after an outage or when no record has ever succeeded, else 0."""
        stopping = {sig.name: sig for sig in STOP_SIGNALS}
        if self.stopped_by in stopping:
            return 128 + stopping[self.stopped_by].value
        if self.stopped_by or (self.failed and not (self.done or self.resumed)):
            return 1
        return 0

    def accounting(self) -> str:
        """The line that proves no record was lost: done + failed + skipped (+ unfinished) == input."""
        terms = [f"done {self.done}", f"failed {self.failed}", f"skipped {self.skipped}"]
        if self.unfinished:
            terms.append(f"unfinished {self.unfinished}")
        total = self.done + self.failed + self.skipped + self.unfinished
        verdict = "==" if total == self.input else "!= (BUG: records unaccounted for)"
        return (
            f"{' + '.join(terms)} {verdict} input {self.input}  "
            f"(skipped: {self.resumed} already done, {self.malformed} malformed, {self.duplicate} duplicate ids)"
        )

    def summary(self) -> list[str]:
        lines = [
            f"datagen: {self.accounting()}",
            f"datagen: {self.done} records in {self.elapsed_s:.1f} s = {self.records_per_s:.2f} records/s, "
            f"{self.completion_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0:.1f} generated tokens/s"
            + (f"; {self.truncated} responses hit max_tokens" if self.truncated else ""),
            f"datagen: {len(self.shards)} new shard(s) in {self.output_dir}",
        ]
        for server in self.servers:
            lines.append(
                f"datagen: server {server.url}: {server.requests} requests, {server.failures} failed attempts, "
                f"peak {server.peak_in_flight} in flight"
            )
        if self.rejects_path is not None:
            lines.append(
                f"datagen: {self.failed} failed records listed in {self.rejects_path}; a rerun retries them"
            )
        if self.stopped_by:
            why = "a server outage" if self.stopped_by == "outage" else self.stopped_by
            lines.append(
                f"datagen: stopped by {why}: completed records are committed; "
                f"{self.unfinished + self.failed} records remain; rerun the same command to resume"
            )
        return lines


def generation_settings(datagen: DatagenConfig, model: str | None) -> dict[str, Any]:
    """What every record of an output directory must share; without the model while the servers have
    not named it (`datagen.model` unset)."""
    settings = {
        "temperature": datagen.temperature,
        "top_p": datagen.top_p,
        "max_tokens": datagen.max_tokens,
        "seed": datagen.seed,
        "reasoning": datagen.reasoning,
        "chat_template_kwargs": datagen.chat_template_kwargs,
    }
    if model is not None:
        settings["model"] = model
    return settings


def record_row(
    record: PromptRecord,
    messages: list[dict[str, str | None]],
    reasoning: list[str | None],
    finish_reasons: list[str],
    model: str,
    datagen: DatagenConfig,
) -> dict[str, Any]:
    """A regenerated record as a shard row (`app.datagen.store.SHARD_SCHEMA`): its messages with the
    answers, each message's separate reasoning, each answer's finish reason, and what made them."""
    return {
        "id": record.id,
        "messages": messages,
        "reasoning_content": reasoning,
        "finish_reasons": finish_reasons,
        "model": model,
        "temperature": datagen.temperature,
        "top_p": datagen.top_p,
        "max_tokens": datagen.max_tokens,
        "seed": datagen.seed,
        "source": record.source,
        "domain": record.domain,
    }


def show_skipped(console: Console, prompts: PromptSet) -> None:
    skipped: list[Skipped] = prompts.malformed + prompts.duplicates
    if not skipped:
        return
    console.print(
        f"datagen: skipping {len(prompts.malformed)} malformed records and {len(prompts.duplicates)} "
        "repeated ids:",
        highlight=False,
    )
    for skip in skipped[:SHOWN_SKIPS]:
        console.print(f"  {skip.source}: {skip.reason}", highlight=False, markup=False)
    if len(skipped) > SHOWN_SKIPS:
        console.print(f"  ... and {len(skipped) - SHOWN_SKIPS} more", highlight=False)


class RegenerationRun:
    """One execution over `store` (module docstring). An answerer calls `answering` around its work,
    `answered` or `failed` for each record, `stop` on its own stops (an outage), and returns
    `finish()`. `answered` and `failed` may come from another thread than the timer's: one lock."""

    def __init__(
        self, datagen: DatagenConfig, prompts: PromptSet, store: ShardStore, console: Console
    ) -> None:
        self.datagen, self.store, self.console = datagen, store, console
        self.pending = [record for record in prompts.records if record.id not in store.completed_ids]
        pending_ids = {record.id for record in self.pending}
        # earlier failures stay listed until this run retries them (or they were completed since)
        self.rejects = {key: entry for key, entry in store.previous_rejects.items() if key in pending_ids}
        self.report = DatagenReport(
            input=prompts.total,
            resumed=len(prompts.records) - len(self.pending),
            malformed=len(prompts.malformed),
            duplicate=len(prompts.duplicates),
            output_dir=store.output_dir,
        )
        self._buffer: list[dict[str, Any]] = []
        self._last_flush = time.monotonic()
        self._lock = threading.Lock()
        self._progress: DatagenProgress | None = None
        self._finished = False

    @contextlib.contextmanager
    def answering(
        self, settings: dict[str, Any], total: int, on_stop: Callable[[], None] = lambda: None
    ) -> Iterator[DatagenProgress]:
        """Record `settings` (refused if the directory's records were made with others), then inside:
        a stop signal sets `report.stopped_by` and calls `on_stop` (from the signal handler: it may
        only note or schedule the stop), the timer commits what waited `flush_interval_s`, a progress
        bar counts `total` records. On the way out (a second signal still caught) everything buffered
        is committed and the report completed."""
        self.store.record_settings(settings)
        started = time.monotonic()

        def stop_on(sig: signal.Signals) -> None:
            if self.stop(sig.name):
                on_stop()
                # after the stop is noted: on a closed terminal (SIGHUP) printing can fail
                with contextlib.suppress(OSError):
                    self.console.print(
                        f"datagen: {sig.name}: stopping, committing completed records", highlight=False
                    )

        with stop_signals(stop_on, STOP_SIGNALS, keep_ignored=True):
            try:
                with self._timed_flushes(), DatagenProgress(self.console, total=total) as progress:
                    self._progress = progress
                    yield progress
            finally:
                self._progress = None
                self.report.elapsed_s = time.monotonic() - started
                self.finish()

    def answered(self, record: PromptRecord, row: dict[str, Any], tokens: int, truncated: int) -> None:
        """`record` regenerated as `row` (`tokens` generated, `truncated` turns at max_tokens)."""
        with self._lock:
            self.report.done += 1
            self.report.completion_tokens += tokens
            self.report.truncated += truncated
            self.rejects.pop(record.id, None)
            self._buffer.append(row)
            self._advance(failed=False)

    def failed(self, record: PromptRecord, reason: str) -> None:
        """`record` could not be regenerated: listed in the rejects file for the next run to retry."""
        with self._lock:
            self.report.failed += 1
            self.rejects[record.id] = {
                "id": record.id,
                "source": record.source,
                "reason": reason,
                "model": self.report.model,
                "time": datetime.now(UTC).isoformat(timespec="seconds"),
            }
            self._advance(failed=True)

    def log(self, message: str) -> None:
        """A `datagen: message` line (above the progress bar while it runs), its text as it is: a
        server's error body is no rich markup (a chat template's `[/INST]` would stop the run)."""
        self.console.print(f"datagen: {message}", highlight=False, markup=False)

    def stop(self, reason: str) -> bool:
        """Note a stop (a signal's name, "outage"); whether it is the first."""
        first = self.report.stopped_by is None
        if first:
            self.report.stopped_by = reason
        return first

    def finish(self) -> DatagenReport:
        """Commit everything buffered and the rejects, and complete the report (once)."""
        with self._lock:
            if not self._finished:
                self._finished = True
                self._commit(force=True)
                report = self.report
                report.unfinished = len(self.pending) - report.done - report.failed
                report.rejects_path = self.store.rejects_path if self.rejects else None
                report.rejected = len(self.rejects)
        return self.report

    def _advance(self, failed: bool) -> None:
        if self._progress is not None:
            self._progress.advance(failed=failed)
        self._commit(force=False)

    def _commit(self, force: bool) -> None:
        """Full shards; with `force`, or once `flush_interval_s` has passed, also the partial one and
        the rejects. Under the lock."""
        size = self.datagen.shard_size
        due = force or time.monotonic() - self._last_flush >= self.datagen.flush_interval_s
        wrote = False
        while len(self._buffer) >= size or (self._buffer and due):
            rows, self._buffer = self._buffer[:size], self._buffer[size:]
            self.report.shards.append(self.store.write_shard(rows))
            wrote = True
        if wrote or due:
            self.store.write_rejects(self.rejects)
            self._last_flush = time.monotonic()

    @contextlib.contextmanager
    def _timed_flushes(self) -> Iterator[None]:
        """A timer thread that commits once `flush_interval_s` has passed since the last commit, also
        while no answer arrives (a long answer, a slow server)."""
        done = threading.Event()

        def commit_when_due() -> None:
            while not done.wait(
                max(self._last_flush + self.datagen.flush_interval_s - time.monotonic(), 0.01)
            ):
                with self._lock:
                    self._commit(force=False)

        timer = threading.Thread(target=commit_when_due, name="datagen-flush", daemon=True)
        timer.start()
        try:
            yield
        finally:
            done.set()
            timer.join()
