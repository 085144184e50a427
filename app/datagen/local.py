"""`dflash datagen` with `datagen.engine = "local"`: the run's own target answers, in this process.

For a target that fits one GPU (the quality benchmark's built-in SmolLM2), no inference server is
needed: prompts are rendered with the target's chat template, sorted by length, and answered by
`app.generate.decoder.BatchDecoder` in `local_rows` rows, each row taking the next prompt as its answer
ends (on CUDA its decode step runs as CUDA graphs, its kernels kept in the run's inductor directory,
`compile.inductor_dir`, so that a rerun loads them instead of compiling for most of a minute). The
output directory is the same as the servers' engine writes, shard for shard: the same columns, resume
state, settings check, rejects and accounting (`app.datagen.store`, `app.datagen.runner.DatagenReport`),
so a killed run resumes where it stopped and nothing is written twice. A stop signal ends the run with
the answers that ended committed; the prompts in flight are answered on the next run.

Only the last turn of a record is answered here (`[system, user, assistant slot]`): a record with
earlier assistant slots needs each answer before the next prompt exists, so it fails with that reason.
Sampled answers (temperature > 0) take their seed from `datagen.seed` and the first pending record id:
reproducible for the same pending prompts, not across a resume (which starts from fewer).
"""

from __future__ import annotations

import hashlib
import signal
import time
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from transformers import PreTrainedTokenizerBase

from app.config.schema import RunConfig
from app.datagen.progress import DatagenProgress
from app.datagen.prompts import PromptRecord, load_prompts
from app.datagen.runner import STOP_SIGNALS, DatagenReport, reject_entry, show_skipped
from app.datagen.store import ShardStore
from app.errors import UserError


@dataclass
class _Prompt:
    record: PromptRecord
    ids: list[int]
    messages: list[dict[str, str | None]]


def run_local_datagen(config: RunConfig, console: Console | None = None) -> DatagenReport:
    """Regenerate `datagen.prompts` with `config.target` into `datagen.output_dir` (module docstring)."""
    from app.model.loading import load_tokenizer  # heavy imports: after the cheap checks below

    console = console or Console(stderr=True, soft_wrap=True)  # a log line is never cut at 80 columns
    datagen = config.datagen
    if datagen.top_p < 1:
        raise UserError("datagen.top_p: the local engine samples from the whole distribution; set it to 1")
    prompts = load_prompts(datagen.prompts)
    show_skipped(console, prompts)
    if not prompts.records:
        raise UserError(f"datagen.prompts: no usable prompt records in {', '.join(datagen.prompts)}")
    store = ShardStore(datagen.output_dir)
    store.open()
    try:
        settings = _settings(config)
        store.check_settings(settings)
        tokenizer = load_tokenizer(config)
        run = _LocalRun(
            config, store, console, prompts.total, len(prompts.malformed), len(prompts.duplicates)
        )
        pending = [record for record in prompts.records if record.id not in store.completed_ids]
        run.report.resumed = len(prompts.records) - len(pending)
        ready = run.render(pending, tokenizer)
        if not ready:
            console.print(
                f"datagen: nothing to generate ({run.report.resumed} already done)", highlight=False
            )
            run.flush(force=True)
            return run.report
        from app.generate.build import local_decoder  # the target and torch: after the checks above

        decoder = local_decoder(
            config,
            tokenizer,
            [p.ids for p in ready],
            lambda message: console.print(f"datagen: {message}", highlight=False),
        )
        store.record_settings(settings)
        run.generate(ready, decoder, tokenizer)
        console.print(decoder.stats.describe(), highlight=False)
        return run.report
    finally:
        store.close()


def render_prompt(
    record: PromptRecord, tokenizer: PreTrainedTokenizerBase, config: RunConfig
) -> list[int] | str:
    """The record's prompt as token ids in the target's chat template, or why this engine cannot
    answer it."""
    datagen = config.datagen
    if sum(turn.role == "assistant" for turn in record.turns) > 1:
        return "the local engine answers one assistant turn; this record has several"
    messages = [{"role": turn.role, "content": turn.content} for turn in record.turns[:-1]]
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **datagen.chat_template_kwargs
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) > datagen.local_max_prompt_tokens:
        return f"prompt of {len(ids)} tokens > datagen.local_max_prompt_tokens"
    return ids


class _LocalRun:
    """One execution: rendering, the batches, the shard buffer, the rejects and the report."""

    def __init__(
        self,
        config: RunConfig,
        store: ShardStore,
        console: Console,
        total: int,
        malformed: int,
        duplicate: int,
    ) -> None:
        self.config, self.datagen, self.store, self.console = config, config.datagen, store, console
        self.report = DatagenReport(
            input=total,
            resumed=0,
            malformed=malformed,
            duplicate=duplicate,
            output_dir=store.output_dir,
            model=_model_name(config),
        )
        self.rejects: dict[str, dict[str, Any]] = {}
        self.buffer: list[dict[str, Any]] = []

    def render(self, records: list[PromptRecord], tokenizer: PreTrainedTokenizerBase) -> list[_Prompt]:
        """Each record's prompt as token ids; records this engine cannot answer become failures."""
        ready = []
        for record in records:
            ids = render_prompt(record, tokenizer, self.config)
            if isinstance(ids, str):
                self._fail(record, ids)
                continue
            messages = [{"role": turn.role, "content": turn.content} for turn in record.turns[:-1]]
            ready.append(_Prompt(record, ids, [{**m, "reasoning_content": None} for m in messages]))
        return sorted(ready, key=lambda p: len(p.ids))  # a batch pads to its longest prompt

    def generate(self, ready: list[_Prompt], decoder: Any, tokenizer: PreTrainedTokenizerBase) -> None:
        rows = decoder.shape.rows
        stop_ids = set(decoder.stop_ids.tolist())
        self.console.print(
            f"datagen: {len(ready)} records to generate ({self.report.resumed} already done) with "
            f"{self.report.model} in this process, {rows} rows refilled as answers end",
            highlight=False,
        )
        previous = {
            sig: signal.signal(sig, self._stop)
            for sig in STOP_SIGNALS
            if signal.getsignal(sig) != signal.SIG_IGN
        }
        started = time.monotonic()
        try:
            with DatagenProgress(self.console, total=len(ready)) as progress:
                answers = decoder.stream([p.ids for p in ready], seed=self._seed(ready[0].record))
                for index, answer in answers:
                    self._commit(ready[index], answer, stop_ids, tokenizer)
                    progress.advance(failed=False)
                    self.flush(force=False)
                    if self.report.stopped_by is not None:
                        break
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.report.elapsed_s = time.monotonic() - started
            self.flush(force=True)
            self.report.unfinished = len(ready) - self.report.done
            self.report.rejects_path = self.store.rejects_path if self.rejects else None
            self.report.rejected = len(self.rejects)

    def _commit(self, prompt: _Prompt, answer: list[int], stop_ids: set[int], tokenizer: Any) -> None:
        ended = bool(answer) and answer[-1] in stop_ids
        text = tokenizer.decode(answer[:-1] if ended else answer, skip_special_tokens=True).strip()
        if not text:
            self._fail(prompt.record, "the target answered nothing")
            return
        self.buffer.append(
            {
                "id": prompt.record.id,
                "messages": [
                    *prompt.messages,
                    {"role": "assistant", "content": text, "reasoning_content": None},
                ],
                "reasoning_content": [None] * (len(prompt.messages) + 1),
                "finish_reasons": ["stop" if ended else "length"],
                "model": self.report.model,
                "temperature": self.datagen.temperature,
                "top_p": self.datagen.top_p,
                "max_tokens": self.datagen.max_tokens,
                "seed": self.datagen.seed,
                "source": prompt.record.source,
                "domain": prompt.record.domain,
            }
        )
        self.report.done += 1
        self.report.completion_tokens += len(answer)
        self.report.truncated += not ended

    def flush(self, force: bool) -> None:
        """Commit full shards; with `force` also the partial one, and the rejects."""
        size = self.datagen.shard_size
        while len(self.buffer) >= size or (self.buffer and force):
            rows, self.buffer = self.buffer[:size], self.buffer[size:]
            self.report.shards.append(self.store.write_shard(rows))
        if force:
            self.store.write_rejects(self.rejects)

    def _fail(self, record: PromptRecord, reason: str) -> None:
        self.report.failed += 1
        self.rejects[record.id] = reject_entry(record, reason, self.report.model)

    def _seed(self, first: PromptRecord) -> int:
        digest = hashlib.sha256(f"{self.datagen.seed or 0}:{first.id}".encode()).digest()
        return int.from_bytes(digest[:8], "big") >> 1

    def _stop(self, signum: int, frame: Any) -> None:
        if self.report.stopped_by is None:
            self.report.stopped_by = signal.Signals(signum).name
            self.console.print(
                "datagen: stopping: committing the answers that ended (the rows in flight are answered "
                "on the next run)",
                highlight=False,
            )


def _model_name(config: RunConfig) -> str:
    target = config.target
    return target.path or (f"builtin:{target.builtin}" if target.builtin else "random-weight target")


def _settings(config: RunConfig) -> dict[str, Any]:
    """What every record of the output directory must share (as the servers' engine records it)."""
    datagen = config.datagen
    return {
        "model": _model_name(config),
        "temperature": datagen.temperature,
        "top_p": datagen.top_p,
        "max_tokens": datagen.max_tokens,
        "seed": datagen.seed,
        "reasoning": datagen.reasoning,
        "chat_template_kwargs": datagen.chat_template_kwargs,
    }
