"""`dflash datagen`: regenerate every prompt's assistant turns with the target, resumably.

The algorithm:
    1. read and normalise the prompts (malformed records and repeated ids are skipped with reasons);
    2. open the output directory: committed shards say which ids are done, those are skipped; refuse
       generation settings other than those its records were made with (even when all are done);
    3. probe the servers and settle the model id; refuse it too if the records were made with another;
    4. workers (concurrency x servers) take pending records in order; each regenerates its assistant
       turns one after another, every turn conditioned on the turns regenerated before it;
    5. completed records are committed in shards of `shard_size` (or after `flush_interval_s`);
       failures go to the rejects file and are retried by the next run;
    6. on SIGINT/SIGTERM/SIGHUP or a server outage: stop sending, commit what is complete, report.
Every record read ends up in exactly one of done, failed, skipped or (after a stop) unfinished.
"""

from __future__ import annotations

import asyncio
import hashlib
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from app.config.schema import DatagenConfig
from app.datagen.progress import DatagenProgress
from app.datagen.prompts import PromptRecord, PromptSet, Skipped, load_prompts
from app.datagen.responses import GarbageResponse, parse_completion, place_reasoning
from app.datagen.servers import AllServersDown, RequestFailed, Server, ServerPool
from app.datagen.store import ShardStore
from app.errors import UserError

SHOWN_SKIPS = 10
"""Malformed records listed one by one before the rest are only counted."""

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Signals that stop a run cleanly (commit, report, exit 128 + number): ^C, `kill`, a closed terminal."""


class _RecordFailed(Exception):
    """One record could not be regenerated; the message names the turn and the reason."""


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


def run_datagen(config: DatagenConfig, console: Console | None = None) -> DatagenReport:
    """Regenerate `config.prompts` into `config.output_dir`; see the module docstring."""
    console = console or Console(stderr=True, soft_wrap=True)  # a log line is never cut at 80 columns
    prompts = load_prompts(config.prompts)
    show_skipped(console, prompts)
    if not prompts.records:
        raise UserError(
            f"datagen.prompts: no usable prompt records in {', '.join(config.prompts)} "
            f"({len(prompts.malformed)} malformed, {len(prompts.duplicates)} duplicate ids)"
        )
    store = ShardStore(config.output_dir)
    store.open()
    try:
        return asyncio.run(_Run(config, prompts, store, console).execute())
    finally:
        store.close()


def reject_entry(record: PromptRecord, reason: str, model: str | None) -> dict[str, Any]:
    """A failed record's line in the rejects file: where it came from, why, with what model, when."""
    return {
        "id": record.id,
        "source": record.source,
        "reason": reason,
        "model": model,
        "time": datetime.now(UTC).isoformat(timespec="seconds"),
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


class _Run:
    """One execution: the pending records, the workers, the shard buffer and the rejects."""

    def __init__(
        self, config: DatagenConfig, prompts: PromptSet, store: ShardStore, console: Console
    ) -> None:
        self.config = config
        self.store = store
        self.console = console
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
        self.buffer: list[dict[str, Any]] = []
        self.last_flush = time.monotonic()
        self.model = ""
        self.pool: ServerPool | None = None
        self.workers: list[asyncio.Task[None]] = []

    async def execute(self) -> DatagenReport:
        report = self.report
        # before the shortcut below: a rerun with other settings must not pass as "already done"
        self.store.check_settings(self._settings(self.config.model))
        if not self.pending:
            self.console.print(f"datagen: all {report.resumed} records are already done", highlight=False)
            self.store.write_rejects(self.rejects)
            return report
        timeout = httpx.Timeout(
            self.config.request_timeout_s, connect=min(10.0, self.config.request_timeout_s)
        )
        slots = self.config.concurrency * len(self.config.servers)
        limits = httpx.Limits(
            max_connections=slots + len(self.config.servers), max_keepalive_connections=slots
        )
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
            self.pool = ServerPool(
                self.config.servers,
                http,
                concurrency=self.config.concurrency,
                max_retries=self.config.max_retries,
                retry_backoff_s=self.config.retry_backoff_s,
                probe_interval_s=self.config.probe_interval_s,
                outage_timeout_s=self.config.outage_timeout_s,
                log=lambda message: self.console.print(f"datagen: {message}", highlight=False),
            )
            self.model = await self.pool.start(self.config.model)
            report.model = self.model
            self.store.record_settings(self._settings(self.model))
            self.console.print(
                f"datagen: {len(self.pending)} records to generate ({report.resumed} already done) with "
                f"{self.model!r} on {len(self.config.servers)} server(s), {self.config.concurrency} in flight each",
                highlight=False,
            )
            loop = asyncio.get_running_loop()
            handled = self._install_signal_handlers(loop)
            try:
                await self._generate(slots)
            finally:
                await self.pool.close()
                report.servers = self.pool.servers
                self._flush(force=True)
                # only now: a second signal before the final commit would otherwise kill the run
                for sig in handled:
                    loop.remove_signal_handler(sig)
        report.unfinished = len(self.pending) - report.done - report.failed
        report.rejects_path = self.store.rejects_path if self.rejects else None
        report.rejected = len(self.rejects)
        return report

    async def _generate(self, slots: int) -> None:
        started = time.monotonic()
        records = iter(self.pending)
        with DatagenProgress(self.console, total=len(self.pending)) as progress:
            self.workers = [asyncio.create_task(self._worker(records, progress)) for _ in range(slots)]
            outcomes = await asyncio.gather(*self.workers, return_exceptions=True)
        self.report.elapsed_s = time.monotonic() - started
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
                raise outcome  # a bug, not a record failure: completed records are still flushed

    def _install_signal_handlers(self, loop: asyncio.AbstractEventLoop) -> list[signal.Signals]:
        handled = []
        for sig in STOP_SIGNALS:
            if signal.getsignal(sig) == signal.SIG_IGN:
                continue  # ignored by whoever started us (nohup): it must not stop the run either
            try:
                loop.add_signal_handler(sig, self._stop, sig.name)
            except (NotImplementedError, RuntimeError, ValueError):
                continue  # not the main thread: the caller handles signals
            handled.append(sig)
        return handled

    def _stop(self, reason: str) -> None:
        """Stop sending: in-flight records are abandoned (they stay pending), completed ones are kept."""
        first = self.report.stopped_by is None
        if first:
            self.report.stopped_by = reason
        for worker in self.workers:
            worker.cancel()
        if first:  # after the cancel: on a closed terminal (SIGHUP) printing can fail
            self.console.print(f"datagen: {reason}: stopping, committing completed records", highlight=False)

    async def _worker(self, records: Iterator[PromptRecord], progress: DatagenProgress) -> None:
        for record in records:
            if self.report.stopped_by is not None:
                return
            try:
                row, tokens, truncated = await self._regenerate(record)
            except AllServersDown as error:
                self._fail(record, str(error))
                progress.advance(failed=True)
                if self.report.stopped_by is None:
                    self.report.stopped_by = "outage"
                    progress.log(f"stopping: {error}")
                return
            except _RecordFailed as error:
                self._fail(record, str(error))
                progress.advance(failed=True)
                self._flush(force=False)
                continue
            self.report.done += 1
            self.report.completion_tokens += tokens
            self.report.truncated += truncated
            self.rejects.pop(record.id, None)
            self.buffer.append(row)
            progress.advance(failed=False)
            self._flush(force=False)

    async def _regenerate(self, record: PromptRecord) -> tuple[dict[str, Any], int, int]:
        """The record with every assistant turn regenerated in order; (row, tokens, truncated turns)."""
        assert self.pool is not None
        history: list[dict[str, str]] = []
        messages: list[dict[str, str | None]] = []
        separate: list[str | None] = []
        finish_reasons: list[str] = []
        tokens = truncated = 0
        for index, turn in enumerate(record.turns):
            if turn.role != "assistant":
                history.append({"role": turn.role, "content": turn.content})
                messages.append({"role": turn.role, "content": turn.content, "reasoning_content": None})
                separate.append(None)
                continue
            try:
                payload = await self.pool.chat(self._request(history, record.id, index))
                completion = parse_completion(payload)
                message, reasoning = place_reasoning(completion, self.config.reasoning)
            except AllServersDown:
                raise
            except (RequestFailed, GarbageResponse) as error:
                raise _RecordFailed(f"turn {index}: {error}") from None
            # later turns see the answer as a chat template renders past turns: without the thinking
            history.append({"role": "assistant", "content": completion.content})
            messages.append(message)
            separate.append(reasoning)
            finish_reasons.append(completion.finish_reason or "unknown")
            tokens += completion.completion_tokens
            truncated += completion.finish_reason == "length"
        row = {
            "id": record.id,
            "messages": messages,
            "reasoning_content": separate,
            "finish_reasons": finish_reasons,
            "model": self.model,
            "temperature": self.config.temperature,
            "top_p": self.config.top_p,
            "max_tokens": self.config.max_tokens,
            "seed": self.config.seed,
            "source": record.source,
            "domain": record.domain,
        }
        return row, tokens, truncated

    def _request(self, history: list[dict[str, str]], record_id: str, turn_index: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": history,
            "max_tokens": self.config.max_tokens,
            "temperature": self.config.temperature,
            "top_p": self.config.top_p,
            "stream": False,
        }
        if self.config.seed is not None:
            digest = hashlib.sha256(f"{self.config.seed}:{record_id}:{turn_index}".encode()).digest()
            body["seed"] = int.from_bytes(digest[:4], "big") >> 1  # a non-negative int32
        if self.config.chat_template_kwargs:
            body["chat_template_kwargs"] = self.config.chat_template_kwargs
        return body

    def _fail(self, record: PromptRecord, reason: str) -> None:
        self.report.failed += 1
        self.rejects[record.id] = reject_entry(record, reason, self.model)

    def _flush(self, force: bool) -> None:
        """Commit full shards; with `force` or after flush_interval_s, also the partial one and the rejects."""
        size = self.config.shard_size
        due = force or time.monotonic() - self.last_flush >= self.config.flush_interval_s
        wrote = False
        while len(self.buffer) >= size or (self.buffer and due):
            rows, self.buffer = self.buffer[:size], self.buffer[size:]
            self.report.shards.append(self.store.write_shard(rows))
            wrote = True
        if wrote or due:
            self.store.write_rejects(self.rejects)
            self.last_flush = time.monotonic()

    def _settings(self, model: str | None) -> dict[str, Any]:
        """What every record of the output directory must share; without the model while the servers
        have not named it (datagen.model unset)."""
        settings = {
            "temperature": self.config.temperature,
            "top_p": self.config.top_p,
            "max_tokens": self.config.max_tokens,
            "seed": self.config.seed,
            "reasoning": self.config.reasoning,
            "chat_template_kwargs": self.config.chat_template_kwargs,
        }
        if model is not None:
            settings["model"] = model
        return settings
