"""`dflash datagen` with `datagen.engine = "local"`: the run's own target answers, in this process.

For a target that fits one GPU (the quality benchmark's built-in SmolLM2), no inference server is
needed: prompts are rendered with the target's chat template, sorted by length, and answered by
`app.generate.decoder.BatchDecoder` in `local_rows` rows, each row taking the next prompt as its answer
ends (on CUDA its decode step runs as CUDA graphs, its kernels kept in the run's inductor directory,
`compile.inductor_dir`, so that a rerun loads them instead of compiling for most of a minute). The run
around the answers is the servers' engine's (`app.datagen.run.RegenerationRun`): the same columns,
resume state, settings check, rejects carried over, timed commits and accounting, so a killed run
resumes where it stopped, loses at most `flush_interval_s` of answers, and writes nothing twice. A
stop signal ends the run with the answers that ended committed; the prompts in flight are answered on
the next run.

Only the last turn of a record is answered here (`[system, user, assistant slot]`): a record with
earlier assistant slots needs each answer before the next prompt exists, so it fails with that reason.
Sampled answers (temperature > 0) take their seed from `datagen.seed` and the first pending record id:
reproducible for the same pending prompts, not across a resume (which starts from fewer).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rich.console import Console
from transformers import PreTrainedTokenizerBase

from app.config.schema import RunConfig
from app.datagen.prompts import PromptRecord, load_prompts
from app.datagen.run import DatagenReport, RegenerationRun, generation_settings, record_row, show_skipped
from app.datagen.store import ShardStore
from app.errors import UserError

if TYPE_CHECKING:  # torch: loaded only once the cheap checks have passed
    from app.generate.decoder import BatchDecoder


@dataclass
class _Prompt:
    record: PromptRecord
    ids: list[int]
    messages: list[dict[str, str | None]]


def run_local_datagen(config: RunConfig, console: Console | None = None) -> DatagenReport:
    """Regenerate `datagen.prompts` with `config.target` into `datagen.output_dir` (module docstring)."""
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
        run = RegenerationRun(datagen, prompts, store, console)
        run.report.model = _model_name(config)
        settings = generation_settings(datagen, run.report.model)
        store.check_settings(settings)
        from app.model.loading import load_tokenizer  # torch: only once the cheap checks have passed

        tokenizer = load_tokenizer(config)
        ready = _render(run, tokenizer, config)
        if not ready:
            run.log(f"nothing to generate ({run.report.resumed} already done)")
            return run.finish()
        from app.generate.build import local_decoder  # the target and torch: after the checks above

        decoder = local_decoder(config, tokenizer, [p.ids for p in ready], run.log)
        run.log(
            f"{len(ready)} records to generate ({run.report.resumed} already done) with "
            f"{run.report.model} in this process, {decoder.shape.rows} rows refilled as answers end"
        )
        with run.answering(settings, len(ready)):
            _answer(run, ready, decoder, tokenizer, config)
        console.print(decoder.stats.describe(), highlight=False)
        return run.finish()
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


def _render(run: RegenerationRun, tokenizer: PreTrainedTokenizerBase, config: RunConfig) -> list[_Prompt]:
    """Each pending record's prompt as token ids, shortest first (a prefill pads to its longest);
    records this engine cannot answer fail with the reason."""
    ready = []
    for record in run.pending:
        ids = render_prompt(record, tokenizer, config)
        if isinstance(ids, str):
            run.failed(record, ids)
            continue
        messages = [{"role": turn.role, "content": turn.content} for turn in record.turns[:-1]]
        ready.append(_Prompt(record, ids, [{**m, "reasoning_content": None} for m in messages]))
    return sorted(ready, key=lambda p: len(p.ids))


def _answer(
    run: RegenerationRun,
    ready: list[_Prompt],
    decoder: BatchDecoder,
    tokenizer: PreTrainedTokenizerBase,
    config: RunConfig,
) -> None:
    """Each answer as it ends, until all have or a stop (the rows in flight are answered next run)."""
    stop_ids = set(decoder.stop_ids.tolist())
    for index, answer in decoder.stream([p.ids for p in ready], seed=_seed(config, ready[0].record)):
        prompt = ready[index]
        ended = bool(answer) and answer[-1] in stop_ids
        text = tokenizer.decode(answer[:-1] if ended else answer, skip_special_tokens=True).strip()
        if not text:
            run.failed(prompt.record, "the target answered nothing")
        else:
            reply = {"role": "assistant", "content": text, "reasoning_content": None}
            row = record_row(
                prompt.record,
                [*prompt.messages, reply],
                [None] * (len(prompt.messages) + 1),
                ["stop" if ended else "length"],
                run.report.model or "",
                config.datagen,
            )
            run.answered(prompt.record, row, len(answer), int(not ended))
        if run.report.stopped_by is not None:
            return


def _seed(config: RunConfig, first: PromptRecord) -> int:
    digest = hashlib.sha256(f"{config.datagen.seed or 0}:{first.id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _model_name(config: RunConfig) -> str:
    target = config.target
    return target.path or (f"builtin:{target.builtin}" if target.builtin else "random-weight target")
