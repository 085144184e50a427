"""Conversation records (OpenAI `messages` or ShareGPT `conversations`) -> one normalised message list.

Every record becomes a `Conversation`: OpenAI-style messages (`role` in system/user/assistant/tool,
string `content`, optional `reasoning_content` and `tool_calls` on assistant turns) plus the optional
tool definitions, ready for the target's chat template. A record that cannot be trusted raises
`MalformedRecord` with a short reason; the loader counts it and moves on, it never stops a run.

Columnar sources (parquet, arrow) fill absent struct fields with None, so None always means "absent".
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from app.errors import UserError

RecordFormat = Literal["messages", "sharegpt"]
FORMAT_COLUMNS: dict[RecordFormat, str] = {"messages": "messages", "sharegpt": "conversations"}

ROLES = ("system", "user", "assistant", "tool")

# ShareGPT speaker names seen in the wild, mapped to OpenAI roles.
SHAREGPT_SPEAKERS = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "function_call": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "function_response": "tool",
}


class MalformedRecord(ValueError):
    """A record that cannot become a training conversation; the message is the reason."""


@dataclass
class Conversation:
    """A normalised conversation: what the chat template renders."""

    messages: list[dict[str, Any]]
    """OpenAI-style messages; ends with an assistant turn."""

    tools: list[dict[str, Any]] | None = None
    """Tool (function) definitions offered to the assistant, if the record has any."""


def detect_format(columns: Iterable[str], source: str) -> RecordFormat:
    """The record format of a file from its columns: `messages` (OpenAI) or `conversations` (ShareGPT)."""
    columns = set(columns)
    found = [fmt for fmt, column in FORMAT_COLUMNS.items() if column in columns]
    if len(found) != 1:
        what = "both" if found else "neither"
        raise UserError(
            f"{source}: cannot tell the record format: expected a `messages` (OpenAI) or `conversations` "
            f"(ShareGPT) column, found {what} among {sorted(columns)}; set data.format"
        )
    return found[0]


def require_format_column(columns: Iterable[str], fmt: RecordFormat, source: str) -> None:
    """With `data.format` set explicitly, the file must have that format's column."""
    column = FORMAT_COLUMNS[fmt]
    if column not in set(columns):
        raise UserError(
            f"{source}: data.format = {fmt!r} needs a `{column}` column, found {sorted(set(columns))}"
        )


def normalize_record(record: Mapping[str, Any], fmt: RecordFormat) -> Conversation:
    """Turn one raw record into a `Conversation`, or raise `MalformedRecord` saying why not."""
    if not isinstance(record, Mapping):
        raise MalformedRecord(f"record must be an object, got {type(record).__name__}")
    raw_messages = _sharegpt_messages(record) if fmt == "sharegpt" else record.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        column = FORMAT_COLUMNS[fmt]
        raise MalformedRecord(f"`{column}` must be a non-empty list, got {_describe_value(raw_messages)}")
    messages = [_message(message, index) for index, message in enumerate(raw_messages)]
    system = record.get("system") if fmt == "sharegpt" else None
    if isinstance(system, str) and system.strip() and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    # Trailing user/tool turns carry no loss and would only cost context tokens.
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()
    if not messages:
        raise MalformedRecord("no assistant turn")
    return Conversation(messages=messages, tools=_tools(record.get("tools")))


def record_domain(record: Any) -> str:
    """A record's optional top-level `domain` label (code, prose, math, ...); "" when it has none.

    Any other type is a `MalformedRecord`: a label that silently became "" would put the record in
    the wrong group when training data or acceptance is broken down by domain.
    """
    domain = record.get("domain") if isinstance(record, Mapping) else None
    if domain is None:
        return ""
    if not isinstance(domain, str):
        raise MalformedRecord(f"`domain` must be a string, got {type(domain).__name__} {domain!r}")
    return domain


def _sharegpt_messages(record: Mapping[str, Any]) -> Any:
    """ShareGPT turns as OpenAI-style dicts (validated later, like any messages record)."""
    turns = record.get("conversations")
    if not isinstance(turns, list):
        return turns
    messages: list[Any] = []
    for index, turn in enumerate(turns):
        if not isinstance(turn, Mapping):
            raise MalformedRecord(f"turn {index}: expected an object, got {type(turn).__name__}")
        speaker = turn.get("from")
        if speaker is None:
            raise MalformedRecord(f"turn {index}: missing `from`")
        role = SHAREGPT_SPEAKERS.get(speaker) if isinstance(speaker, str) else None
        if role is None:
            raise MalformedRecord(f"turn {index}: unknown speaker {speaker!r}")
        value = turn.get("value")
        if speaker == "function_call":
            messages.append({"role": "assistant", "content": "", "tool_calls": _sharegpt_call(value, index)})
        else:
            messages.append({"role": role, "content": value})
    return messages


def _sharegpt_call(value: Any, index: int) -> list[Any]:
    """A ShareGPT `function_call` turn holds the call(s) as JSON text."""
    try:
        calls = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError:
        raise MalformedRecord(f"turn {index}: function_call value is not valid JSON") from None
    return calls if isinstance(calls, list) else [calls]


def _message(message: Any, index: int) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise MalformedRecord(f"message {index}: expected an object, got {type(message).__name__}")
    role = message.get("role")
    if role is None:
        raise MalformedRecord(f"message {index}: missing role")
    if role not in ROLES:
        raise MalformedRecord(f"message {index}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
    content = _text(message.get("content"), index)
    if role == "assistant":
        return _assistant_message(message, content, index)
    if content is None:
        raise MalformedRecord(f"message {index}: {role} turn has no content")
    if role == "user" and not content.strip():
        raise MalformedRecord(f"message {index}: empty user turn")
    normalised: dict[str, Any] = {"role": role, "content": content}
    if role == "tool":
        for key in ("name", "tool_call_id"):
            if isinstance(message.get(key), str):
                normalised[key] = message[key]
    return normalised


def _assistant_message(message: Mapping[str, Any], content: str | None, index: int) -> dict[str, Any]:
    reasoning = message.get("reasoning_content")
    if reasoning is None:
        reasoning = message.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, str):
        raise MalformedRecord(
            f"message {index}: reasoning_content must be a string, got {type(reasoning).__name__}"
        )
    tool_calls = _tool_calls(message.get("tool_calls"), index)
    if not (content or reasoning or tool_calls):
        raise MalformedRecord(f"message {index}: empty assistant turn")
    normalised: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if reasoning:
        normalised["reasoning_content"] = reasoning
    if tool_calls:
        normalised["tool_calls"] = tool_calls
    return normalised


def _text(content: Any, index: int) -> str | None:
    """Message content as text: a string, or a list of OpenAI text parts joined."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if (
                not isinstance(part, Mapping)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise MalformedRecord(f"message {index}: content part {kind!r} is not supported (text only)")
            texts.append(part["text"])
        return "".join(texts)
    raise MalformedRecord(f"message {index}: content must be a string, got {type(content).__name__}")


def _tool_calls(calls: Any, index: int) -> list[dict[str, Any]]:
    """Tool calls in the OpenAI shape `{type: function, function: {name, arguments}}`.

    Arguments given as JSON text become a mapping: Qwen3 templates accept either, Qwen3.5/3.6
    templates iterate the arguments' items.
    """
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise MalformedRecord(f"message {index}: tool_calls must be a list, got {type(calls).__name__}")
    normalised = []
    for call in calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        function = function if isinstance(function, Mapping) else call
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str) or not name:
            raise MalformedRecord(f"message {index}: tool call without a function name")
        arguments = function.get("arguments")
        if arguments is None:
            arguments = {}
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except json.JSONDecodeError:
                parsed = None
            arguments = parsed if isinstance(parsed, dict) else arguments
        elif not isinstance(arguments, Mapping):
            raise MalformedRecord(
                f"message {index}: tool call arguments must be an object or JSON text, "
                f"got {type(arguments).__name__}"
            )
        entry: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
        if isinstance(call, Mapping) and isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        normalised.append(entry)
    return normalised


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    """Tool definitions: a list of objects, or the same list as JSON text."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            raise MalformedRecord("`tools` is not valid JSON") from None
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(tool, Mapping) for tool in tools):
        raise MalformedRecord(f"`tools` must be a list of objects, got {_describe_value(tools)}")
    return [dict(tool) for tool in tools]


def _describe_value(value: Any) -> str:
    if isinstance(value, list):
        return "an empty list" if not value else "a list"
    return "nothing" if value is None else type(value).__name__
