"""`dflash datagen` through servers: regenerate every prompt's assistant turns with the target, resumably.

The algorithm (steps 2, 5 and 6 are the run's, `app.datagen.run.RegenerationRun`, shared with the
local engine):
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
from collections.abc import Iterator
from typing import Any

import httpx
from rich.console import Console

from app.config.schema import DatagenConfig
from app.datagen.prompts import PromptRecord, load_prompts
from app.datagen.responses import GarbageResponse, parse_completion, place_reasoning
from app.datagen.run import DatagenReport, RegenerationRun, generation_settings, record_row, show_skipped
from app.datagen.servers import AllServersDown, RequestFailed, ServerPool
from app.datagen.store import ShardStore
from app.errors import UserError


class _RecordFailed(Exception):
    """One record could not be regenerated; the message names the turn and the reason."""


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
        return asyncio.run(_Servers(config, RegenerationRun(config, prompts, store, console)).execute())
    finally:
        store.close()


class _Servers:
    """The servers' answerer of one run: the pool, the workers, each record's turns in order."""

    def __init__(self, config: DatagenConfig, run: RegenerationRun) -> None:
        self.config = config
        self.run = run
        self.console = run.console
        self.model = ""
        self.pool: ServerPool | None = None
        self.workers: list[asyncio.Task[None]] = []

    async def execute(self) -> DatagenReport:
        run = self.run
        # before the shortcut below: a rerun with other settings must not pass as "already done"
        run.store.check_settings(generation_settings(self.config, self.config.model))
        if not run.pending:
            self.console.print(f"datagen: all {run.report.resumed} records are already done", highlight=False)
            return run.finish()
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
                log=run.log,
            )
            self.model = run.report.model = await self.pool.start(self.config.model)
            self.console.print(
                f"datagen: {len(run.pending)} records to generate ({run.report.resumed} already done) with "
                f"{self.model!r} on {len(self.config.servers)} server(s), {self.config.concurrency} in flight each",
                highlight=False,
            )
            loop = asyncio.get_running_loop()
            settings = generation_settings(self.config, self.model)
            try:
                # the stop comes in a signal handler: the workers are cancelled from the loop
                with run.answering(
                    settings, len(run.pending), lambda: loop.call_soon_threadsafe(self._cancel)
                ):
                    await self._generate(slots)
            finally:
                await self.pool.close()
                run.report.servers = self.pool.servers
        return run.finish()

    async def _generate(self, slots: int) -> None:
        records = iter(self.run.pending)
        self.workers = [asyncio.create_task(self._worker(records)) for _ in range(slots)]
        outcomes = await asyncio.gather(*self.workers, return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
                raise outcome  # a bug, not a record failure: completed records are still committed

    def _cancel(self) -> None:
        """Stop sending: in-flight records are abandoned (they stay pending), completed ones are kept."""
        for worker in self.workers:
            worker.cancel()

    async def _worker(self, records: Iterator[PromptRecord]) -> None:
        for record in records:
            if self.run.report.stopped_by is not None:
                return
            try:
                row, tokens, truncated = await self._regenerate(record)
            except AllServersDown as error:
                self.run.failed(record, str(error))
                if self.run.stop("outage"):
                    self.run.log(f"stopping: {error}")
                return
            except _RecordFailed as error:
                self.run.failed(record, str(error))
                continue
            self.run.answered(record, row, tokens, truncated)

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
        row = record_row(record, messages, separate, finish_reasons, self.model, self.config)
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
