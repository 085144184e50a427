"""Eval prompts as token ids: what the target is asked to continue while tau is measured.

Two sources. A conversation file (`dflash eval --data FILE`): each record's turns before its
first assistant turn (system and user), rendered with the target's chat template and its
generation prompt, exactly as a serving engine would send them. Or a tokenized dataset (the run's
held-out records): each sample's tokens before its first supervised token, i.e. up to and
including the first assistant header.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from app.datagen.prompts import PromptRecord, load_prompts
from app.errors import UserError

if TYPE_CHECKING:
    from app.data.dataset import TokenizedDataset  # imports `datasets`: only the run's held-out data needs it

PROMPT_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


def prompts_from_file(
    path: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    limit: int,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[list[int]]:
    """The first `limit` usable records of a conversation file, rendered up to their first reply."""
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
    return [_render(record, tokenizer, chat_template_kwargs or {}) for record in loaded.records[:limit]]


def prompts_from_dataset(dataset: TokenizedDataset, limit: int) -> list[list[int]]:
    """The first `limit` samples' tokens before their first supervised (assistant) token."""
    prompts = []
    for input_ids, loss_mask in dataset.fetch(range(min(limit, len(dataset)))):
        supervised = np.flatnonzero(loss_mask)
        if len(supervised) and supervised[0] > 0:
            prompts.append(input_ids[: supervised[0]].astype(np.int64).tolist())
    if not prompts:
        raise UserError("eval: none of the held-out samples has a prompt before its first assistant turn")
    return prompts


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
