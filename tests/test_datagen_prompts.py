"""Prompt records in, normalised conversations out (`app.datagen.prompts`): both record formats, the
assistant slots, ids, every reason a record is malformed, and the files records come from."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.data.formats import MalformedRecord
from app.datagen.prompts import (
    PromptRecord,
    PromptSet,
    Skipped,
    Turn,
    load_prompts,
    normalise_record,
    prompt_hash,
)
from app.errors import UserError

USER = {"role": "user", "content": "hello"}


def malformed(raw: Any) -> str:
    with pytest.raises(MalformedRecord) as refused:
        normalise_record(raw, "f:1")
    return str(refused.value)


def test_an_openai_record_keeps_system_and_user_turns_and_slots_every_answer() -> None:
    raw = {
        "id": "r1",
        "domain": "code",
        "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": "one"},
            {"role": "assistant", "content": "old answer"},
            {"role": "user", "content": [{"type": "text", "text": "two"}, {"type": "text", "text": "lines"}]},
        ],
    }
    assert normalise_record(raw, "f:1") == PromptRecord(
        id="r1",
        source="f:1",
        turns=(
            Turn("system", "be brief"),
            Turn("user", "one"),
            Turn("assistant", ""),
            Turn("user", "two\nlines"),
            Turn("assistant", ""),
        ),
        domain="code",
    )


def test_a_sharegpt_record_maps_its_speakers() -> None:
    raw = {
        "conversations": [
            {"from": "system", "value": "sys"},
            {"from": "human", "value": "q"},
            {"from": "gpt", "value": "a"},
        ],
        "id": 7,
        "domain": "",
    }
    record = normalise_record(raw, "f#0")
    assert record.turns == (Turn("system", "sys"), Turn("user", "q"), Turn("assistant"))
    assert (record.id, record.domain) == ("7", None)


def test_a_record_without_an_id_is_named_by_its_prompt() -> None:
    record = normalise_record({"messages": [USER]}, "f:1")
    assert record.id == prompt_hash([Turn("user", "hello"), Turn("assistant")])
    assert (
        record.id == normalise_record({"messages": [USER, {"role": "assistant", "content": "x"}]}, "f:2").id
    )
    assert record.id != normalise_record({"messages": [{"role": "user", "content": "hellö"}]}, "f:3").id
    assert (
        record.id != normalise_record({"messages": [{"role": "system", "content": "hello"}, USER]}, "f:4").id
    )


def test_prompt_hash_is_the_sha256_of_roles_and_text() -> None:
    """Written out: a changed canonical form would rename every record a rerun resumes from."""
    turns = [Turn("user", "hellö"), Turn("assistant")]
    canonical = '[["user", "hellö"], ["assistant", ""]]'
    assert (
        prompt_hash(turns) == prompt_hash(tuple(turns)) == hashlib.sha256(canonical.encode()).hexdigest()[:24]
    )


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ([USER], "expected a JSON object, got list"),
        ({"messages": "hi"}, "expected a `messages` or `conversations` list"),
        ({"conversations": {"from": "human"}}, "expected a `messages` or `conversations` list"),
        ({"messages": ["hi"]}, "messages[0]: expected an object, got str"),
        (
            {"messages": [USER, {"role": "tool", "content": "42"}]},
            "messages[1]: tool turns are not regenerated",
        ),
        (
            {"messages": [USER, {"role": "ipython", "content": "42"}]},
            "messages[1]: tool turns are not regenerated",
        ),
        (
            {"messages": [USER, {"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]}]},
            "messages[1]: tool turns are not regenerated (old tool results would not match new calls)",
        ),
        (
            {"messages": [USER, {"role": "assistant", "function_call": {"name": "f"}}]},
            "messages[1]: tool turns are not regenerated",
        ),
        (
            {"messages": [{"role": "robot", "content": "x"}]},
            "messages[0].role: expected one of ['assistant', 'developer', 'system', 'user'], got 'robot'",
        ),
        ({"messages": [{"role": "user", "content": " \n"}]}, "messages[0].content: empty user turn"),
        ({"messages": [{"role": "system", "content": ""}, USER]}, "messages[0].content: empty system turn"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content: expected a string, got int"),
        ({"messages": [{"role": "user"}]}, "messages[0].content: expected a string, got NoneType"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
            "messages[0].content[0]: only text content parts are supported",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, "b"]}]},
            "messages[0].content[1]: only text content parts are supported",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
            "messages[0].content[0]: only text content parts are supported",
        ),
        ({"conversations": [5]}, "conversations[0]: expected an object, got int"),
        (
            {"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "{}"}]},
            "conversations[1]: tool turns are not regenerated (old tool results would not match new calls)",
        ),
        (
            {"conversations": [{"from": "observation", "value": "q"}]},
            "conversations[0]: tool turns are not regenerated",
        ),
        (
            {"conversations": [{"from": "alien", "value": "q"}]},
            "conversations[0].from: expected one of ['assistant', 'bard', 'bing', 'chatgpt', 'gpt', 'human', "
            "'model', 'system', 'user'], got 'alien'",
        ),
        ({"conversations": [{"from": "human", "value": None}]}, "conversations[0].value: expected a string"),
        ({"messages": [{"role": "system", "content": "s"}]}, "no user turn"),
        ({"messages": []}, "no user turn"),
        (
            {"messages": [{"role": "assistant", "content": "a"}, USER]},
            "turn 0: assistant turn before any user turn",
        ),
        (
            {"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}, USER]},
            "turn 1: assistant turn before any user turn",
        ),
        (
            {
                "messages": [
                    USER,
                    {"role": "assistant", "content": "a"},
                    {"role": "assistant", "content": "b"},
                ]
            },
            "turns 1 and 2: two assistant turns in a row",
        ),
        ({"messages": [USER], "id": ""}, "`id` must be a non-empty string or an integer, got ''"),
        ({"messages": [USER], "id": True}, "`id` must be a non-empty string or an integer, got True"),
        ({"messages": [USER], "id": 1.5}, "`id` must be a non-empty string or an integer, got 1.5"),
        ({"messages": [USER], "domain": 3}, "`domain` must be a string, got int 3"),
    ],
)
def test_malformed_records_are_named(raw: Any, reason: str) -> None:
    assert malformed(raw).startswith(reason)


def test_an_assistant_turn_after_a_system_one_after_a_user_one_is_fine() -> None:
    raw = {"messages": [USER, {"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]}
    assert normalise_record(raw, "f:1").turns == (
        Turn("user", "hello"),
        Turn("system", "s"),
        Turn("assistant"),
    )


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_files_in_order_with_malformed_lines_and_repeated_ids_set_aside(tmp_path: Path) -> None:
    first = write_jsonl(
        tmp_path / "a.jsonl",
        [
            json.dumps({"id": "x", "messages": [USER]}),
            "",
            "{broken",
            json.dumps({"id": "x", "messages": [{"role": "user", "content": "again"}]}),
            json.dumps({"messages": [{"role": "robot", "content": "r"}]}),
        ],
    )
    (tmp_path / "b.jsonl").write_bytes(
        b'{"id": "y", "messages": [{"role": "user", "content": "b"}]}\n\xff\xfe\n'
    )
    prompts = load_prompts([str(first), str(tmp_path / "b.jsonl")])
    assert [(r.id, r.source) for r in prompts.records] == [
        ("x", f"{first}:1"),
        ("y", f"{tmp_path / 'b.jsonl'}:1"),
    ]
    assert prompts.duplicates == [Skipped(f"{first}:4", f"duplicate id 'x' (first at {first}:1)")]
    assert [skip.source for skip in prompts.malformed] == [
        f"{first}:3",
        f"{first}:5",
        f"{tmp_path / 'b.jsonl'}:2",
    ]
    assert prompts.malformed[0].reason.startswith("not valid JSON (")
    assert prompts.malformed[2].reason.startswith("not valid JSON (")
    assert prompts.total == 6


def test_a_json_array_a_json_lines_file_named_json_and_parquet(tmp_path: Path) -> None:
    array = tmp_path / "array.JSON"
    array.write_text(json.dumps([{"id": "a", "messages": [USER]}, "bad"]))
    lines = write_jsonl(tmp_path / "lines.json", [json.dumps({"id": "b", "messages": [USER]})] * 2)
    one_object = tmp_path / "one.json"
    one_object.write_text(json.dumps({"id": "c", "messages": [USER]}))
    table = tmp_path / "rows.Parquet"
    pq.write_table(pa.Table.from_pylist([{"id": f"p{i}", "messages": [USER]} for i in range(1030)]), table)
    prompts = load_prompts([str(array), str(lines), str(one_object), str(table)])
    assert [r.source for r in prompts.records][:4] == [
        f"{array}#0",
        f"{lines}:1",
        f"{one_object}:1",
        f"{table}#0",
    ]
    assert prompts.records[-1].source == f"{table}#1029" and len(prompts.records) == 1033
    assert prompts.malformed == [Skipped(f"{array}#1", "expected a JSON object, got str")]
    assert prompts.duplicates == [Skipped(f"{lines}:2", f"duplicate id 'b' (first at {lines}:1)")]
    assert load_prompts([str(array)]).total == 2 and PromptSet().total == 0


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("p.txt", "x", "datagen.prompts: {path}: expected a .jsonl, .json or .parquet file"),
        ("p.json", "42", "datagen.prompts: {path}: expected a JSON array of records"),
        ("p.parquet", "not parquet", "datagen.prompts: {path}: not a readable parquet file ("),
        ("missing.jsonl", None, "datagen.prompts: {path}: file not found"),
    ],
)
def test_unreadable_prompt_files_are_named(
    tmp_path: Path, name: str, content: str | None, message: str
) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(UserError, match="^" + re.escape(message.format(path=path))):
        load_prompts([str(path)])


def test_a_directory_is_not_a_prompt_file(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").mkdir()
    with pytest.raises(UserError, match="file not found"):
        load_prompts([str(tmp_path / "d.jsonl")])


def test_no_prompt_files_is_refused() -> None:
    with pytest.raises(UserError, match=r"^datagen\.prompts: no prompt files given$"):
        load_prompts([])
