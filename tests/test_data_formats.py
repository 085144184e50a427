"""Record normalisation (OpenAI messages, ShareGPT) and loading of every file kind, with counts and cache."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import time
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.config.schema import DataConfig, RunConfig
from app.data.dataset import LOCK_FILE, load_tokenized, load_training_data, split_holdout
from app.data.formats import MalformedRecord, detect_format, normalize_record
from app.errors import UserError
from tests.helpers import unwritable_directory


def conversation(index: int, answer_words: int = 24) -> dict:
    """A valid two-turn record whose answer has about `answer_words` words."""
    answer = " ".join(["the module returns a new list of values"] * (answer_words // 8 + 1))
    return {
        "messages": [
            {"role": "user", "content": f"Question {index}: what does the function return?"},
            {"role": "assistant", "content": answer},
        ]
    }


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def data_config(tmp_path, **overrides) -> DataConfig:
    settings = {"cache_dir": str(tmp_path / "cache"), "max_length": 512, "token_budget": 1024, **overrides}
    return DataConfig(**settings)


def load(files, tmp_path, tokenizer, min_supervised=16, **overrides):
    return load_tokenized(
        files, data_config(tmp_path, **overrides), tokenizer, min_supervised_tokens=min_supervised
    )


# --- record normalisation ---------------------------------------------------------------------


def test_messages_record_is_normalised_for_the_template():
    record = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Look "}, {"type": "text", "text": "it up."}],
            },
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "Use the tool.",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "find", "arguments": '{"q": "x"}'}}
                ],
            },
            {"role": "tool", "content": "found", "tool_call_id": "c1"},
            {"role": "assistant", "content": "It is x."},
            {"role": "user", "content": "Thanks!"},  # trailing turns carry no loss: dropped
        ],
        "tools": json.dumps([{"type": "function", "function": {"name": "find"}}]),
    }
    result = normalize_record(record, "messages")
    assert result.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Look it up."},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Use the tool.",
            "tool_calls": [
                {"type": "function", "function": {"name": "find", "arguments": {"q": "x"}}, "id": "c1"}
            ],
        },
        {"role": "tool", "content": "found", "tool_call_id": "c1"},
        {"role": "assistant", "content": "It is x."},
    ]
    assert result.tools == [{"type": "function", "function": {"name": "find"}}]


def test_sharegpt_record_maps_speakers_and_system():
    record = {
        "system": "You are helpful.",
        "conversations": [
            {"from": "human", "value": "Weather?"},
            {"from": "function_call", "value": '{"name": "weather", "arguments": {"city": "Oslo"}}'},
            {"from": "observation", "value": "rain"},
            {"from": "gpt", "value": "It rains."},
        ],
    }
    result = normalize_record(record, "sharegpt")
    assert [m["role"] for m in result.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert result.messages[0]["content"] == "You are helpful."
    assert result.messages[2]["tool_calls"] == [
        {"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}
    ]
    assert result.messages[4] == {"role": "assistant", "content": "It rains."}


def test_none_fields_of_columnar_files_mean_absent():
    # parquet/arrow give every struct field to every message, None where the record had none
    record = {
        "messages": [
            {"role": "user", "content": "Hi", "reasoning_content": None, "tool_calls": None},
            {"role": "assistant", "content": "Hello", "reasoning_content": None, "tool_calls": None},
        ],
        "tools": None,
    }
    result = normalize_record(record, "messages")
    assert result.messages == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert result.tools is None


USER = {"role": "user", "content": "Hi"}
ASSISTANT = {"role": "assistant", "content": "Hello"}


@pytest.mark.parametrize(
    ("record", "fmt", "reason"),
    [
        ({"messages": "nope"}, "messages", "`messages` must be a non-empty list, got str"),
        ({"messages": []}, "messages", "`messages` must be a non-empty list, got an empty list"),
        ({"other": 1}, "messages", "`messages` must be a non-empty list, got nothing"),
        ({"messages": [{"content": "Hi"}, ASSISTANT]}, "messages", "message 0: missing role"),
        (
            {"messages": [{"role": "bot", "content": "Hi"}, ASSISTANT]},
            "messages",
            "message 0: unknown role 'bot'",
        ),
        (
            {"messages": [{"role": "user", "content": " \n"}, ASSISTANT]},
            "messages",
            "message 0: empty user turn",
        ),
        (
            {"messages": [{"role": "user", "content": 5}, ASSISTANT]},
            "messages",
            "content must be a string, got int",
        ),
        ({"messages": [{"role": "user"}, ASSISTANT]}, "messages", "message 0: user turn has no content"),
        (
            {"messages": [USER, {"role": "assistant", "content": ""}]},
            "messages",
            "message 1: empty assistant turn",
        ),
        ({"messages": [USER]}, "messages", "no assistant turn"),
        ({"messages": ["Hi", ASSISTANT]}, "messages", "message 0: expected an object, got str"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}, ASSISTANT]},
            "messages",
            "content part 'image_url' is not supported",
        ),
        (
            {"messages": [USER, {"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}]},
            "messages",
            "message 1: tool call without a function name",
        ),
        (
            {"conversations": [{"from": "alien", "value": "Hi"}]},
            "sharegpt",
            "turn 0: unknown speaker 'alien'",
        ),
        ({"conversations": [{"value": "Hi"}]}, "sharegpt", "turn 0: missing `from`"),
        (
            {"conversations": [{"from": "human", "value": None}, {"from": "gpt", "value": "x"}]},
            "sharegpt",
            "no content",
        ),
        ({"conversations": [{"from": "human", "value": "Hi"}]}, "sharegpt", "no assistant turn"),
        ([1, 2], "messages", "record must be an object"),
    ],
)
def test_malformed_records_say_why(record, fmt, reason):
    with pytest.raises(MalformedRecord, match=reason.replace("(", r"\(").replace("?", r"\?")):
        normalize_record(record, fmt)


def test_format_detection_from_columns():
    assert detect_format(["messages", "id"], "f.jsonl") == "messages"
    assert detect_format(["conversations"], "f.jsonl") == "sharegpt"
    with pytest.raises(UserError, match=r"f\.jsonl: cannot tell the record format.*neither"):
        detect_format(["prompt", "response"], "f.jsonl")
    with pytest.raises(UserError, match="both"):
        detect_format(["messages", "conversations"], "f.jsonl")


# --- loading files ----------------------------------------------------------------------------


def test_every_file_kind_loads_to_the_same_samples(tmp_path, tiny_tokenizer):
    records = [conversation(i) for i in range(6)]
    sharegpt = [
        {
            "conversations": [
                {"from": "human", "value": r["messages"][0]["content"]},
                {"from": "gpt", "value": r["messages"][1]["content"]},
            ]
        }
        for r in records
    ]
    table = pa.Table.from_pylist(records)
    (tmp_path / "shards").mkdir()
    pq.write_table(table.slice(0, 4), tmp_path / "shards" / "part-0.parquet")
    pq.write_table(table.slice(4), tmp_path / "shards" / "part-1.parquet")
    (tmp_path / "shards" / "rejects.jsonl").write_text("not training data\n")  # side file: ignored
    (tmp_path / "single.json").write_text(json.dumps(records))
    with (
        pa.OSFile(str(tmp_path / "single.arrow"), "wb") as sink,
        pa.ipc.new_stream(sink, table.schema) as writer,
    ):
        writer.write_table(table)
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"))
    sources = {
        "jsonl": write_jsonl(tmp_path / "single.jsonl", records),
        "sharegpt": write_jsonl(tmp_path / "sharegpt.jsonl", sharegpt),
        "json": str(tmp_path / "single.json"),
        "arrow": str(tmp_path / "single.arrow"),
        "parquet shards": str(tmp_path / "shards"),
        "save_to_disk": str(tmp_path / "saved"),
    }
    expected = None
    for kind, path in sources.items():
        loaded = load([path], tmp_path, tiny_tokenizer)
        ids = [list(ids) for ids, _ in loaded.fetch(range(len(loaded)))]
        assert loaded.summary.records == 6 and loaded.summary.kept == 6, kind
        expected = expected or ids
        assert ids == expected, kind


@pytest.mark.parametrize("reader", ["json reader", "line by line"])
def test_malformed_records_are_counted_with_file_line_and_reason(tmp_path, tiny_tokenizer, reader):
    """Named by the line an editor shows (blank lines counted), whether the json reader parsed the
    file or a line that is not JSON sent it to the line-by-line fallback."""
    path = tmp_path / "mixed.jsonl"
    lines = [
        json.dumps(conversation(0)),
        "",
        json.dumps({"messages": [{"role": "bot", "content": "Hi"}, ASSISTANT]}),
        "{this is not json" if reader == "line by line" else json.dumps(conversation(2)),
        "   ",
        json.dumps(conversation(1)),
        json.dumps({"messages": [{"role": "user", "content": "Hi"}]}),
    ]
    path.write_text("\n".join(lines) + "\n")
    summary = load([str(path)], tmp_path, tiny_tokenizer).summary
    broken = reader == "line by line"
    assert (summary.records, summary.malformed, summary.kept) == (5, 2 + broken, 3 - broken)
    assert summary.malformed_examples == [
        f"{path} line 3: message 0: unknown role 'bot' (expected one of system, user, assistant, tool)",
        *([f"{path} line 4: not valid JSON (Expecting property name enclosed in double quotes at column 2)"]
          if broken else []),
        f"{path} line 7: no assistant turn",
    ]  # fmt: skip


def test_a_blank_json_lines_file_holds_no_records(tmp_path, tiny_tokenizer):
    """Whitespace only: no records, as an empty file (not the datasets library's "corresponds to no data")."""
    (tmp_path / "blank.jsonl").write_text("  \n\n \t\n")
    with pytest.raises(UserError) as refused:
        load([str(tmp_path / "blank.jsonl")], tmp_path, tiny_tokenizer)
    assert str(refused.value) == (
        f"no trainable conversations in {tmp_path / 'blank.jsonl'}: 0 records read, 0 malformed, 0 with "
        "fewer than 16 supervised tokens"
    )


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("cut.json", '{"messages": [\n  {"role": "user", "content": "hi"},\n', r"Expecting value \(line 3, column 1\)"),
        # every line of the array is a record alone, but the document is not JSON
        ("array.json", f"[\n  {json.dumps(conversation(0))}\n  {json.dumps(conversation(1))}\n]\n",
         r"Expecting ',' delimiter \(line 3, column 3\)"),
    ],
)  # fmt: skip
def test_a_json_document_that_is_not_json_says_where(tmp_path, tiny_tokenizer, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(UserError, match=rf"^{re.escape(str(path))}: not valid JSON: {message}$"):
        load([str(path)], tmp_path, tiny_tokenizer)


def test_json_lines_with_a_bad_line_keep_the_rest_and_lines_of_no_records_are_refused(
    tmp_path, tiny_tokenizer
):
    lines = tmp_path / "lines.json"  # JSON lines in a .json file, the first one broken
    lines.write_text("{broken\n" + json.dumps(conversation(0)) + "\n")
    summary = load([str(lines)], tmp_path, tiny_tokenizer).summary
    assert (summary.records, summary.malformed, summary.kept) == (2, 1, 1)
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text("1\n2\n")
    with pytest.raises(UserError, match=r"numbers\.jsonl: no records: expected JSON objects, one per line"):
        load([str(numbers)], tmp_path, tiny_tokenizer)


def test_malformed_records_in_parquet_shards_name_their_shard(tmp_path, tiny_tokenizer):
    records = [conversation(i) for i in range(5)]
    records[3] = {"messages": [{"role": "user", "content": ""}, ASSISTANT]}
    table = pa.Table.from_pylist(records)
    (tmp_path / "shards").mkdir()
    pq.write_table(table.slice(0, 2), tmp_path / "shards" / "a.parquet")
    pq.write_table(table.slice(2), tmp_path / "shards" / "b.parquet")
    summary = load([str(tmp_path / "shards")], tmp_path, tiny_tokenizer).summary
    assert summary.malformed_examples == [
        f"{tmp_path / 'shards' / 'b.parquet'} record 1: message 0: empty user turn"
    ]


def test_too_short_conversations_are_dropped_and_counted(tmp_path, tiny_tokenizer):
    short = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes."}]}
    path = write_jsonl(tmp_path / "data.jsonl", [conversation(0), short, conversation(1), short])
    loaded = load([path], tmp_path, tiny_tokenizer, min_supervised=16)
    assert (loaded.summary.too_short, loaded.summary.kept) == (2, 2)
    assert loaded.summary.supervised_tokens == int(loaded.rows.with_format("numpy")[:]["supervised"].sum())
    assert all(mask.sum() >= 16 for _, mask in loaded.fetch(range(len(loaded))))


def cache_entries(cache: Path) -> list[Path]:
    """What a tokenized cache root holds besides its lock file (which names the last builder)."""
    return [path for path in cache.iterdir() if path.name != LOCK_FILE]


def test_nothing_left_after_filtering_is_a_user_error_with_counts(tmp_path, tiny_tokenizer):
    short = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes."}]}
    path = write_jsonl(tmp_path / "data.jsonl", [short, {"messages": [USER]}, short])
    with pytest.raises(UserError) as error:
        load([path], tmp_path, tiny_tokenizer, min_supervised=16)
    assert str(error.value) == (
        f"no trainable conversations in {path}: 3 records read, 1 malformed, 2 with fewer than 16 "
        f"supervised tokens; e.g. {path} line 2: no assistant turn"
    )
    assert cache_entries(tmp_path / "cache") == [], "a failed build leaves nothing behind"


def test_a_killed_tokenization_is_cleaned_up_by_the_next_one(tmp_path, tiny_tokenizer):
    """A SIGKILL during tokenization leaves the key's hidden staging directory; the next build of that
    key (which holds the cache directory's lock, so no live build owns it) removes it."""
    path = write_jsonl(tmp_path / "data.jsonl", [conversation(0), conversation(1)])
    final = Path(load([path], tmp_path, tiny_tokenizer).summary.cache_path)
    shutil.rmtree(final)
    killed = final.parent / f".{final.name}.k1ll3d00"
    (killed / "work").mkdir(parents=True)
    (killed / "work" / "source-0.arrow").write_bytes(b"half written")
    assert load([path], tmp_path, tiny_tokenizer).summary.kept == 2
    assert not killed.exists() and final.is_dir()


def test_empty_files_contribute_nothing(tmp_path, tiny_tokenizer):
    (tmp_path / "empty.jsonl").write_text("")
    path = write_jsonl(tmp_path / "data.jsonl", [conversation(0), conversation(1)])
    summary = load([str(tmp_path / "empty.jsonl"), path], tmp_path, tiny_tokenizer).summary
    assert (summary.records, summary.kept) == (2, 2)


def test_second_load_hits_the_cache_and_changes_miss(tmp_path, tiny_tokenizer):
    path = tmp_path / "data.jsonl"
    write_jsonl(path, [conversation(i) for i in range(8)])
    first = load([str(path)], tmp_path, tiny_tokenizer)
    started = time.perf_counter()
    second = load([str(path)], tmp_path, tiny_tokenizer)
    assert time.perf_counter() - started < 2.0
    assert not first.summary.cache_hit and second.summary.cache_hit
    assert "cache hit" in second.summary.describe()
    assert second.summary.cache_path == first.summary.cache_path
    assert [list(i) for i, _ in second.fetch(range(8))] == [list(i) for i, _ in first.fetch(range(8))]

    assert not load([str(path)], tmp_path, tiny_tokenizer, max_length=256).summary.cache_hit
    write_jsonl(path, [conversation(i) for i in range(9)])
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    changed = load([str(path)], tmp_path, tiny_tokenizer)
    assert not changed.summary.cache_hit and changed.summary.kept == 9


def test_long_conversations_are_truncated_to_max_length(tmp_path, tiny_tokenizer):
    path = write_jsonl(tmp_path / "data.jsonl", [conversation(0, answer_words=400), conversation(1)])
    loaded = load([path], tmp_path, tiny_tokenizer, max_length=64)
    assert loaded.summary.truncated == 1
    assert loaded.lengths.max() == 64


def test_multiprocess_tokenization_matches_single_process(tmp_path, tiny_tokenizer):
    path = write_jsonl(tmp_path / "data.jsonl", [conversation(i, answer_words=8 + i) for i in range(40)])
    single = load([path], tmp_path / "one", tiny_tokenizer)
    parallel = load([path], tmp_path / "two", tiny_tokenizer, num_proc=2)
    assert [list(i) for i, _ in parallel.fetch(range(40))] == [list(i) for i, _ in single.fetch(range(40))]


def test_bad_paths_and_formats_are_user_errors(tmp_path, tiny_tokenizer):
    with pytest.raises(UserError, match=r"data file not found: .*missing\.jsonl"):
        load([str(tmp_path / "missing.jsonl")], tmp_path, tiny_tokenizer)
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(UserError, match=r"notes\.txt: unsupported data file"):
        load([str(tmp_path / "notes.txt")], tmp_path, tiny_tokenizer)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"no \.parquet, \.arrow, \.jsonl or \.json files inside"):
        load([str(tmp_path / "empty")], tmp_path, tiny_tokenizer)
    path = write_jsonl(tmp_path / "data.jsonl", [conversation(0)])
    with pytest.raises(UserError, match=r"data\.format = 'sharegpt' needs a `conversations` column"):
        load([path], tmp_path, tiny_tokenizer, format="sharegpt")
    with pytest.raises(UserError, match=r"data\.train_files: no data files given"):
        load([], tmp_path, tiny_tokenizer)


def test_holdout_split_is_seeded_and_disjoint(tmp_path, tiny_tokenizer):
    path = write_jsonl(tmp_path / "data.jsonl", [conversation(i) for i in range(10)])
    loaded = load([path], tmp_path, tiny_tokenizer)
    train, held_out = split_holdout(loaded, 3, seed=1)
    again_train, _ = split_holdout(loaded, 3, seed=1)
    assert (len(train), len(held_out)) == (7, 3)
    assert list(train.lengths) == list(again_train.lengths)
    train_ids = {tuple(ids) for ids, _ in train.fetch(range(7))}
    held_ids = {tuple(ids) for ids, _ in held_out.fetch(range(3))}
    assert not train_ids & held_ids and len(train_ids | held_ids) == 10
    with pytest.raises(UserError, match=r"data\.eval_holdout = 10 leaves nothing to train on"):
        split_holdout(loaded, 10, seed=1)


def test_training_data_holds_out_eval_or_reads_eval_files(tmp_path, tiny_tokenizer):
    train_path = write_jsonl(tmp_path / "train.jsonl", [conversation(i) for i in range(12)])
    short = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes."}]}
    eval_path = write_jsonl(tmp_path / "eval.jsonl", [short, conversation(99)])
    config = RunConfig.model_validate(
        {
            "target": {"builtin": "tiny-lm"},
            "drafter": {"mask_token_id": 3, "block_size": 8},
            "data": {**data_config(tmp_path).model_dump(), "train_files": [train_path], "eval_holdout": 4},
            "train": {"anchors": 64},
        }
    )
    train, held_out = load_training_data(config, tiny_tokenizer)
    assert (len(train), len(held_out)) == (8, 4)
    assert train.summary.min_supervised_tokens == 16

    config.data.eval_files = [eval_path]
    train, evaluation = load_training_data(config, tiny_tokenizer)
    assert (len(train), len(evaluation)) == (12, 2)  # short eval answers still make eval prompts


@pytest.mark.parametrize(
    ("where", "suffix"),
    [("in a string", ".jsonl"), ("between fields", ".jsonl"), ("in a string", ".jsonl.gz")],
)
def test_bytes_that_are_not_utf8_are_refused_naming_the_line(tmp_path, tiny_tokenizer, where, suffix):
    """In a string the json reader takes the bad byte and tokenization crashes on it; between fields
    the line-by-line fallback read it as a replacement character, and the line counted as malformed."""
    lines = [json.dumps(conversation(index)).encode() for index in range(4)]
    at = lines[2].index(b"Question" if where == "in a string" else b'"messages"')
    lines[2] = lines[2][:at] + b"\xff" + lines[2][at:]
    data = b"".join(line + b"\n" for line in lines)
    path = tmp_path / f"bad{suffix}"
    path.write_bytes(gzip.compress(data) if suffix.endswith(".gz") else data)
    expected = rf"{re.escape(str(path))}: line 3 is not UTF-8: byte {at + 1} of the line is b'\\xff' \(invalid start byte\); save the file as UTF-8"  # fmt: skip
    with pytest.raises(UserError, match=rf"^{expected}$"):
        load([str(path)], tmp_path, tiny_tokenizer)
    assert cache_entries(tmp_path / "cache") == []  # nothing half-built is left behind


def test_an_unwritable_tokenized_cache_is_one_line_naming_the_setting(tmp_path, tiny_tokenizer) -> None:
    """A data.cache_dir the process cannot write (a read-only file system, no permission) was a
    64-line traceback from mkdir; it is one line naming the setting and the directory."""
    files = [write_jsonl(tmp_path / "a.jsonl", [conversation(i) for i in range(4)])]
    why = "Operation not permitted" if os.geteuid() == 0 else "Permission denied"  # root: chattr +i
    with unwritable_directory(tmp_path / "read-only") as read_only:
        for cache in (read_only / "tokenized", read_only):  # a cache to create there, or to write into
            with pytest.raises(UserError) as refused:
                load(files, tmp_path, tiny_tokenizer, cache_dir=str(cache))
            assert str(refused.value) == (
                f"data.cache_dir = {cache}: cannot create or write the tokenized cache {cache} ({why}); point "
                "data.cache_dir at a writable directory"
            )
