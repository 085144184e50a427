"""Conversation -> input_ids + loss_mask, rendered by the target's own chat template.

The drafter learns to predict what the target generates, so exactly the assistant's output is
supervised: its content, reasoning and tool calls plus the closing `<|im_end|>`; never the
`<|im_start|>assistant\\n` header nor system, user or tool turns.

Real Qwen3/Qwen3.5 templates have no `{% generation %}` markers, and they rewrite history (earlier
turns lose their `<think>` block), so rendering prefixes of a conversation does not reproduce the
full rendering. Instead the full conversation is rendered once, the assistant spans are found in
that text (`<|im_start|>assistant\\n` ... `<|im_end|>`), and the tokens whose first character lies
in a span are supervised (offsets from the fast tokenizer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from app.data.formats import Conversation, MalformedRecord
from app.errors import UserError

ASSISTANT_HEADER = "<|im_start|>assistant\n"
TURN_END = "<|im_end|>"

_PROBE = Conversation(
    messages=[{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}]
)


@dataclass
class TokenizedSample:
    """One tokenized conversation, truncated to `max_length`."""

    input_ids: list[int]
    loss_mask: list[bool]
    truncated: bool = False

    @property
    def supervised(self) -> int:
        return sum(self.loss_mask)


@dataclass
class ChatTokenizer:
    """The target tokenizer plus the data config that shapes tokenization."""

    tokenizer: PreTrainedTokenizerBase
    max_length: int
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        name = self.tokenizer.name_or_path or "the target tokenizer"
        if not self.tokenizer.is_fast:
            raise UserError(f"{name}: a fast tokenizer (tokenizer.json) is needed to locate assistant tokens")
        if not self.tokenizer.chat_template:
            raise UserError(f"{name}: the tokenizer has no chat template")
        try:
            probe = self.render(_PROBE)
        except MalformedRecord as error:
            raise UserError(
                f"{name}: the chat template fails on a plain user/assistant exchange: {error}"
            ) from None
        spans = assistant_spans(probe)
        if len(spans) != 1 or "pong" not in probe[slice(*spans[0])]:
            raise UserError(
                f"{name}: the chat template does not render ChatML turns "
                f"({ASSISTANT_HEADER.strip()} ... {TURN_END}); only Qwen-style ChatML templates are supported"
            )

    def render(self, conversation: Conversation) -> str:
        """The conversation as the target sees it; a template error is a malformed record."""
        try:
            return self.tokenizer.apply_chat_template(
                conversation.messages,
                tools=conversation.tools,
                tokenize=False,
                add_generation_prompt=False,
                **self.chat_template_kwargs,
            )
        except Exception as error:  # jinja raises TemplateError, TypeError, ... from user-written templates
            raise MalformedRecord(f"chat template rejected it: {error}") from None

    def tokenize(self, conversation: Conversation) -> TokenizedSample:
        """Tokenize one conversation; raises `MalformedRecord` when it cannot be supervised safely."""
        (result,) = self.tokenize_many([conversation])
        if isinstance(result, MalformedRecord):
            raise result
        return result

    def tokenize_many(self, conversations: list[Conversation]) -> list[TokenizedSample | MalformedRecord]:
        """Tokenize a batch (one call into the Rust tokenizer); failures come back in place, not raised."""
        results: list[TokenizedSample | MalformedRecord | None] = [None] * len(conversations)
        rendered: list[tuple[int, str, list[tuple[int, int]]]] = []
        for index, conversation in enumerate(conversations):
            try:
                text = self.render(conversation)
                spans = assistant_spans(text)
                _check_turn_count(spans, conversation)
            except MalformedRecord as error:
                results[index] = error
                continue
            rendered.append((index, text, spans))
        if rendered:
            encodings = self.tokenizer(
                [text for _, text, _ in rendered], add_special_tokens=False, return_offsets_mapping=True
            )
            for (index, _, spans), ids, offsets in zip(
                rendered, encodings["input_ids"], encodings["offset_mapping"], strict=True
            ):
                mask = supervised_tokens(offsets, spans)
                results[index] = TokenizedSample(
                    input_ids=ids[: self.max_length],
                    loss_mask=mask[: self.max_length],
                    truncated=len(ids) > self.max_length,
                )
        return results  # type: ignore[return-value]  # every slot is filled above


def assistant_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of the assistant outputs: after each header, through the closing `<|im_end|>`."""
    spans = []
    cursor = 0
    while (header := text.find(ASSISTANT_HEADER, cursor)) != -1:
        start = header + len(ASSISTANT_HEADER)
        end = text.find(TURN_END, start)
        end = len(text) if end == -1 else end + len(TURN_END)
        spans.append((start, end))
        cursor = end
    return spans


def supervised_tokens(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """True for each token whose first character lies inside one of the (sorted) spans."""
    mask = []
    span = 0
    for token_start, _ in offsets:
        while span < len(spans) and token_start >= spans[span][1]:
            span += 1
        mask.append(span < len(spans) and spans[span][0] <= token_start)
    return mask


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id that pads target batches and drafter rows (Qwen: `<|endoftext|>`); eos when none is set."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise UserError(f"{tokenizer.name_or_path}: the tokenizer has neither a pad nor an eos token")
    return int(pad)


def _check_turn_count(spans: list[tuple[int, int]], conversation: Conversation) -> None:
    """A header inside message text would supervise a user's words: refuse rather than guess."""
    expected = sum(message["role"] == "assistant" for message in conversation.messages)
    if len(spans) != expected:
        raise MalformedRecord(
            f"rendered text has {len(spans)} assistant headers for {expected} assistant turns "
            f"(chat markup inside message text?)"
        )
