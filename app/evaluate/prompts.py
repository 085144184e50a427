"""Eval prompts as token ids: what the target is asked to continue while tau is measured.

Two sources. A conversation file (`dflash eval --data FILE`): each record's turns before its
first assistant turn (system and user), rendered with the target's chat template and its
generation prompt, exactly as a serving engine would send them. Or a tokenized dataset (the run's
held-out records): each sample's tokens before its first supervised token, i.e. up to and
including the first assistant header.

Each prompt keeps its record's `domain`. When the records carry domains, `limit` counts per domain
(the first `limit` of each, in record order), so that every domain's tau rests on as many prompts;
without domains it counts in all.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from app.datagen.prompts import PromptRecord, load_prompts
from app.errors import UserError

if TYPE_CHECKING:
    from app.data.dataset import TokenizedDataset  # imports `datasets`: only the run's held-out data needs it

PROMPT_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass
class EvalPrompts:
    """Prompts as token ids and each one's domain ("" when its record has none)."""

    ids: list[list[int]]
    domains: list[str]


def prompts_from_file(
    path: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    limit: int,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> EvalPrompts:
    """The first `limit` usable records (per domain) of a conversation file, rendered up to their first reply."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--data: {path}: file not found")
    if path.suffix.lower() not in PROMPT_FILE_SUFFIXES:
        raise UserError(f"--data: {path}: expected a {', '.join(PROMPT_FILE_SUFFIXES)} file of conversations")
    loaded = load_prompts([str(path)])
    if not loaded.records:
        reason = (
            f" (first: {loaded.malformed[0].source}: {loaded.malformed[0].reason})"
            if loaded.malformed
            else ""
        )
        raise UserError(
            f"--data: {path}: no usable conversation among {loaded.total} records{reason}; expected OpenAI "
            "`messages` or ShareGPT `conversations` records with a user turn"
        )
    chosen = first_per_domain([record.domain or "" for record in loaded.records], limit)
    records = [loaded.records[index] for index in chosen]
    return EvalPrompts(
        [_render(record, tokenizer, chat_template_kwargs or {}) for record in records],
        [record.domain or "" for record in records],
    )


def prompts_from_dataset(dataset: TokenizedDataset, limit: int) -> EvalPrompts:
    """The first `limit` samples (per domain) as their tokens before their first supervised
    (assistant) token; samples with no prompt there are passed over."""
    domains = dataset.domains
    prompts = EvalPrompts([], [])
    usable = []
    for index, (input_ids, loss_mask) in enumerate(dataset.fetch(range(len(dataset)))):
        supervised = np.flatnonzero(loss_mask)
        if len(supervised) and supervised[0] > 0:
            usable.append((index, input_ids[: supervised[0]].astype(np.int64).tolist()))
    for position in first_per_domain([domains[index] for index, _ in usable], limit):
        index, ids = usable[position]
        prompts.ids.append(ids)
        prompts.domains.append(domains[index])
    if not prompts.ids:
        raise UserError("eval: none of the held-out samples has a prompt before its first assistant turn")
    return prompts


def first_per_domain(domains: list[str], limit: int) -> list[int]:
    """Indices of the first `limit` items of each domain, in order; of the first `limit` items when
    no item has a domain."""
    if not any(domains):
        return list(range(min(limit, len(domains))))
    taken: dict[str, int] = {}
    chosen = []
    for index, domain in enumerate(domains):
        if taken.get(domain, 0) < limit:
            taken[domain] = taken.get(domain, 0) + 1
            chosen.append(index)
    return chosen


def _render(
    record: PromptRecord, tokenizer: PreTrainedTokenizerBase, chat_template_kwargs: dict[str, Any]
) -> list[int]:
    first_reply = next(index for index, turn in enumerate(record.turns) if turn.role == "assistant")
    messages = [{"role": turn.role, "content": turn.content} for turn in record.turns[:first_reply]]
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **chat_template_kwargs
        )
    except Exception as error:  # jinja raises TemplateError, TypeError, ... from user-written templates
        raise UserError(f"--data: {record.source}: the chat template rejected it ({error})") from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]
