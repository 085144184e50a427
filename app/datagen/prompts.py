"""Prompt records in, normalised conversations out: what the target is asked to answer.

A prompt record is an OpenAI `messages` record or a ShareGPT `conversations` record, one per
jsonl line, json array item or parquet row. Normalising keeps the system and user turns and turns
every assistant turn into a slot the target fills; a conversation that ends on a user turn gets
one more slot. Records that cannot be regenerated faithfully (no user turn, tool turns whose
results would not match new calls, non-text content) are reported as malformed, never guessed at.
An optional top-level `domain` string (code, prose, math, ...) labels the record; datagen writes it
into the shards, where the training loader reads it per sample.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.data.formats import SHAREGPT_SPEAKERS, MalformedRecord, record_domain
from app.errors import UserError

# Speakers whose turns are tool calls or results: a regenerated answer would not match them.
TOOL_ROLES = {speaker for speaker, role in SHAREGPT_SPEAKERS.items() if role == "tool"} | {
    "function_call",
    "ipython",
}
SHAREGPT_ROLES = {speaker: role for speaker, role in SHAREGPT_SPEAKERS.items() if speaker not in TOOL_ROLES}
OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass(frozen=True)
class Turn:
    """One prompt turn. Assistant turns are slots: their original text is never sent or kept."""

    role: str
    content: str = ""


@dataclass(frozen=True)
class PromptRecord:
    """A normalised prompt: `turns` ends with an assistant slot; `source` is file:line or file#row."""

    id: str
    source: str
    turns: tuple[Turn, ...]
    domain: str | None = None
    """The record's top-level `domain` (code, prose, math, ...): carried into the shards so that
    training data and acceptance can be broken down by it."""


@dataclass(frozen=True)
class Skipped:
    """A prompt record left out of the run, with where it was and why."""

    source: str
    reason: str


@dataclass
class PromptSet:
    """Every record read: the usable ones plus those skipped as malformed or as repeated ids."""

    records: list[PromptRecord] = field(default_factory=list)
    malformed: list[Skipped] = field(default_factory=list)
    duplicates: list[Skipped] = field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.records) + len(self.malformed) + len(self.duplicates)


def load_prompts(paths: list[str]) -> PromptSet:
    """Read and normalise every record of `paths` in order; the first record of an id wins."""
    if not paths:
        raise UserError("datagen.prompts: no prompt files given")
    prompts = PromptSet()
    first_source: dict[str, str] = {}
    for path in paths:
        for source, raw in _read_records(Path(path)):
            try:
                if isinstance(raw, MalformedRecord):
                    raise raw
                record = normalise_record(raw, source)
            except MalformedRecord as error:
                prompts.malformed.append(Skipped(source, str(error)))
                continue
            if record.id in first_source:
                reason = f"duplicate id {record.id!r} (first at {first_source[record.id]})"
                prompts.duplicates.append(Skipped(source, reason))
                continue
            first_source[record.id] = source
            prompts.records.append(record)
    return prompts


def normalise_record(raw: Any, source: str) -> PromptRecord:
    """One raw record -> a `PromptRecord`, or `MalformedRecord` naming what is wrong."""
    if not isinstance(raw, dict):
        raise MalformedRecord(f"expected a JSON object, got {type(raw).__name__}")
    if isinstance(raw.get("messages"), list):
        turns = [_openai_turn(message, index) for index, message in enumerate(raw["messages"])]
    elif isinstance(raw.get("conversations"), list):
        turns = [_sharegpt_turn(message, index) for index, message in enumerate(raw["conversations"])]
    else:
        raise MalformedRecord("expected a `messages` or `conversations` list")
    turns = _with_assistant_slots(turns)
    return PromptRecord(
        id=_record_id(raw, turns), source=source, turns=tuple(turns), domain=record_domain(raw) or None
    )


def prompt_hash(turns: list[Turn] | tuple[Turn, ...]) -> str:
    """Stable id of a prompt: its roles and non-assistant text (assistant slots carry no text)."""
    canonical = json.dumps([[turn.role, turn.content] for turn in turns], ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()[:24]


def _record_id(raw: dict[str, Any], turns: list[Turn]) -> str:
    given = raw.get("id")
    if given is None:
        return prompt_hash(turns)
    if isinstance(given, bool) or not isinstance(given, str | int) or str(given) == "":
        raise MalformedRecord(f"`id` must be a non-empty string or an integer, got {given!r}")
    return str(given)


def _openai_turn(message: Any, index: int) -> Turn:
    if not isinstance(message, dict):
        raise MalformedRecord(f"messages[{index}]: expected an object, got {type(message).__name__}")
    role = message.get("role")
    if role in TOOL_ROLES or message.get("tool_calls") or message.get("function_call"):
        raise MalformedRecord(
            f"messages[{index}]: tool turns are not regenerated (old tool results would not match new calls)"
        )
    if role not in OPENAI_ROLES:
        raise MalformedRecord(f"messages[{index}].role: expected one of {sorted(OPENAI_ROLES)}, got {role!r}")
    return _turn(OPENAI_ROLES[role], message.get("content"), f"messages[{index}].content")


def _sharegpt_turn(message: Any, index: int) -> Turn:
    if not isinstance(message, dict):
        raise MalformedRecord(f"conversations[{index}]: expected an object, got {type(message).__name__}")
    speaker = message.get("from")
    if speaker in TOOL_ROLES:
        raise MalformedRecord(
            f"conversations[{index}]: tool turns are not regenerated (old tool results would not match new calls)"
        )
    if speaker not in SHAREGPT_ROLES:
        raise MalformedRecord(
            f"conversations[{index}].from: expected one of {sorted(SHAREGPT_ROLES)}, got {speaker!r}"
        )
    return _turn(SHAREGPT_ROLES[speaker], message.get("value"), f"conversations[{index}].value")


def _turn(role: str, content: Any, where: str) -> Turn:
    if role == "assistant":
        return Turn("assistant")  # regenerated: whatever the record held is not used
    text = _text(content, where)
    if not text.strip():
        raise MalformedRecord(f"{where}: empty {role} turn")
    return Turn(role, text)


def _text(content: Any, where: str) -> str:
    """Plain text, or OpenAI content parts of type text joined by newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part_index, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise MalformedRecord(f"{where}[{part_index}]: only text content parts are supported")
            texts.append(part["text"])
        return "\n".join(texts)
    raise MalformedRecord(f"{where}: expected a string, got {type(content).__name__}")


def _with_assistant_slots(turns: list[Turn]) -> list[Turn]:
    """Check the turn order a chat model can answer and make sure it ends with an assistant slot."""
    if not any(turn.role == "user" for turn in turns):
        raise MalformedRecord("no user turn")
    seen_user = False
    for index, turn in enumerate(turns):
        if turn.role == "user":
            seen_user = True
        elif turn.role == "assistant":
            if not seen_user:
                raise MalformedRecord(f"turn {index}: assistant turn before any user turn")
            if turns[index - 1].role == "assistant":
                raise MalformedRecord(f"turns {index - 1} and {index}: two assistant turns in a row")
    if turns[-1].role != "assistant":
        turns = [*turns, Turn("assistant")]
    return turns


def _read_records(path: Path) -> Iterator[tuple[str, Any]]:
    """(source, raw record) for every record of a file; an unparsable line comes back as its error."""
    if not path.is_file():
        raise UserError(f"datagen.prompts: {path}: file not found")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        yield from _read_parquet(path)
    elif suffix == ".jsonl":
        yield from _read_jsonl(path)
    elif suffix == ".json":
        yield from _read_json(path)
    else:
        raise UserError(f"datagen.prompts: {path}: expected a .jsonl, .json or .parquet file")


def _read_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open("rb") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{number}", json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                yield f"{path}:{number}", MalformedRecord(f"not valid JSON ({error})")


def _read_json(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        data = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError):
        data = None
    if data is None or isinstance(data, dict):
        yield from _read_jsonl(path)  # many datasets ship JSON lines under a .json name
        return
    if not isinstance(data, list):
        raise UserError(f"datagen.prompts: {path}: expected a JSON array of records")
    for index, raw in enumerate(data):
        yield f"{path}#{index}", raw


def _read_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
        row = 0
        for batch in table.iter_batches(batch_size=1024):
            for raw in batch.to_pylist():
                yield f"{path}#{row}", raw
                row += 1
    except (pa.ArrowException, OSError) as error:
        raise UserError(f"datagen.prompts: {path}: not a readable parquet file ({error})") from None
