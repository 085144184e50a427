"""A chat-completion response body -> the assistant turn it holds, or a reason it is unusable.

Servers differ in where thinking goes: SGLang and vLLM with a reasoning parser return it in
`reasoning_content` (newer vLLM: `reasoning`); without one it stays in the text as
`<think>...</think>`, and templates that open the block in the prompt leave only `</think>` in
the reply. All three come out as (reasoning, content); `datagen.reasoning` decides where it goes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


class GarbageResponse(ValueError):
    """A 200 response that holds no usable assistant turn; the message says what was wrong."""


@dataclass(frozen=True)
class Completion:
    """The assistant turn of one response."""

    content: str
    reasoning: str | None
    finish_reason: str | None
    completion_tokens: int


def parse_completion(payload: Any) -> Completion:
    """Validate a decoded /v1/chat/completions body and pull out the first choice's turn."""
    if not isinstance(payload, dict):
        raise GarbageResponse(f"response is a JSON {type(payload).__name__}, not an object")
    choices = payload.get("choices")
    if not isinstance(choices, list) or not choices:
        raise GarbageResponse(f"response has no `choices` (keys: {sorted(payload)[:8]})")
    choice = choices[0]
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict):
        raise GarbageResponse("response choices[0] has no `message` object")
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise GarbageResponse(f"response message content is a {type(content).__name__}, not text")
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, str):
        raise GarbageResponse(f"response reasoning is a {type(reasoning).__name__}, not text")
    finish_reason = choice.get("finish_reason")
    if reasoning:
        content = content or ""
    else:
        reasoning, content = split_think(content or "")
    if not content.strip() and not (reasoning or "").strip():
        raise GarbageResponse(f"empty response (finish_reason={finish_reason!r})")
    usage = payload.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return Completion(
        content=content,
        reasoning=reasoning or None,
        finish_reason=finish_reason if isinstance(finish_reason, str) else None,
        completion_tokens=tokens if isinstance(tokens, int) else 0,
    )


def split_think(text: str) -> tuple[str | None, str]:
    """(reasoning, answer) of text that may hold a `<think>` block; (None, text) when it holds none.

    An unclosed `<think>` (generation cut at max_tokens) is all reasoning; a lone `</think>` closes a
    block the chat template opened in the prompt.
    """
    stripped = text.lstrip()
    if stripped.startswith(THINK_OPEN):
        inner = stripped[len(THINK_OPEN) :]
        reasoning, closed, answer = inner.partition(THINK_CLOSE)
        return reasoning.strip(), (answer.lstrip() if closed else "")
    if THINK_CLOSE in text and THINK_OPEN not in text:
        reasoning, _, answer = text.partition(THINK_CLOSE)
        return reasoning.strip(), answer.lstrip()
    return None, text


def place_reasoning(completion: Completion, policy: str) -> tuple[dict[str, str | None], str | None]:
    """(assistant message, reasoning for the separate column) under `datagen.reasoning` = policy."""
    if policy == "drop" and not completion.content.strip():
        raise GarbageResponse(
            f"response holds only reasoning, which datagen.reasoning = drop discards "
            f"(finish_reason={completion.finish_reason!r})"
        )
    kept = completion.reasoning if policy == "keep" else None
    separate = completion.reasoning if policy == "separate" else None
    return {"role": "assistant", "content": completion.content, "reasoning_content": kept}, separate
