"""`ShardStore`, the output directory of a datagen run, on its own: the lock, the resume state read
back from committed shards and rejects, the settings manifest, and the files it commits."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.datagen.store import SHARD_SCHEMA, OutputDirBusy, ShardStore
from app.errors import UserError

SETTINGS = {"model": "m", "temperature": 0.7, "top_p": 1.0, "seed": None}


def row(record_id: str, answer: str = "an answer") -> dict[str, Any]:
    return {
        "id": record_id,
        "messages": [
            {"role": "user", "content": "a question", "reasoning_content": None},
            {"role": "assistant", "content": answer, "reasoning_content": None},
        ],
        "reasoning_content": [None, None],
        "finish_reasons": ["stop"],
        "model": "m",
        "temperature": 0.7,
        "top_p": 1.0,
        "max_tokens": 8,
        "seed": None,
        "source": "p.jsonl",
        "domain": "prose",
    }


def opened(output: Path) -> ShardStore:
    store = ShardStore(output)
    store.open()
    return store


def test_a_fresh_directory_is_created_with_its_state_folder_and_holds_nothing(tmp_path: Path) -> None:
    output = tmp_path / "a" / "b" / "out"
    store = opened(output)
    try:
        assert (output / ".datagen").is_dir() and (output / ".datagen" / "lock").is_file()
        assert store.completed_ids == set() and store.previous_rejects == {}
        assert store.rejects_path == output / ".datagen" / "rejects.jsonl"
        assert store.manifest_path == output / ".datagen" / "manifest.json"
        assert store.write_shard([row("r0")]) == output / "part-000000.parquet"
    finally:
        store.close()


def test_a_store_not_yet_opened_holds_nothing_and_closes_harmlessly(tmp_path: Path) -> None:
    store = ShardStore(tmp_path / "out")
    assert (store.completed_ids, store.previous_rejects) == (set(), {})
    store.close()
    assert not (tmp_path / "out").exists()


def test_an_existing_state_folder_is_reused(tmp_path: Path) -> None:
    state = tmp_path / "out" / ".datagen"
    state.mkdir(parents=True)
    (state / "rejects.jsonl").write_text(json.dumps({"id": "a", "reason": "kept"}) + "\n")
    store = opened(tmp_path / "out")
    store.close()
    assert store.previous_rejects == {"a": {"id": "a", "reason": "kept"}}


def test_an_output_dir_that_cannot_be_created_names_the_setting(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(UserError, match=r"^datagen\.output_dir: cannot create .*file/out/\.datagen \("):
        ShardStore(tmp_path / "file" / "out").open()


def test_a_second_store_is_refused_and_the_refused_one_closes_cleanly(tmp_path: Path) -> None:
    holder = opened(tmp_path / "out")
    refused = ShardStore(tmp_path / "out")
    with pytest.raises(
        OutputDirBusy,
        match=rf"^datagen\.output_dir: {re.escape(str(tmp_path / 'out'))} is being written by another "
        rf"dflash datagen run \(pid {os.getpid()} on .+\)$",
    ):
        started = time.monotonic()
        try:
            refused.open()
        finally:
            assert time.monotonic() - started < 0.5  # refused at once: a run never waits for another
    refused.close()  # nothing held, nothing to release
    holder.close()
    holder.close()  # a second close is harmless
    again = opened(tmp_path / "out")  # the lock is free once its holder closed
    again.close()


def test_shards_are_committed_in_order_and_read_back_as_the_resume_state(tmp_path: Path) -> None:
    output = tmp_path / "out"
    store = opened(output)
    first = store.write_shard([row("a"), row("b", "ünïcode answer")])
    second = store.write_shard([row("c")])
    third = store.write_shard([row("e")])
    assert store.completed_ids == {"a", "b", "c", "e"}
    store.close()
    names = [first.name, second.name, third.name]
    assert names == ["part-000000.parquet", "part-000001.parquet", "part-000002.parquet"]
    assert sorted(path.name for path in output.iterdir()) == [".datagen", *names]
    table = pq.read_table(first)
    assert table.schema.equals(SHARD_SCHEMA)
    assert table.to_pylist() == [row("a"), row("b", "ünïcode answer")]
    assert pq.ParquetFile(first).metadata.row_group(0).column(0).compression == "ZSTD"

    resumed = opened(output)
    try:
        assert resumed.completed_ids == {"a", "b", "c", "e"}
        assert resumed.write_shard([row("d")]).name == "part-000003.parquet"
    finally:
        resumed.close()


def test_the_next_shard_follows_the_highest_index_not_the_count(tmp_path: Path) -> None:
    output = tmp_path / "out"
    output.mkdir()
    for index, record_id in [(7, "x"), (3, "y")]:
        pq.write_table(
            pa.Table.from_pylist([row(record_id)], schema=SHARD_SCHEMA), output / f"part-{index:06d}.parquet"
        )
    store = opened(output)
    try:
        assert store.completed_ids == {"x", "y"}
        assert store.write_shard([row("z")]).name == "part-000008.parquet"
    finally:
        store.close()


def test_temp_files_of_a_killed_run_are_removed_and_nothing_else(tmp_path: Path) -> None:
    output = tmp_path / "out"
    (output / ".datagen").mkdir(parents=True)
    leftovers = [output / ".part-000000.parquet.tmp", output / ".datagen" / ".rejects.jsonl.abc.tmp"]
    kept = [output / "notes.txt", output / "visible.tmp", output / ".datagen" / "other.tmp"]
    for path in leftovers + kept:
        path.write_text("x")
    opened(output).close()
    assert [path.exists() for path in leftovers] == [False, False]
    assert all(path.exists() for path in kept)


def test_a_shard_that_is_not_parquet_is_named_with_what_to_do(tmp_path: Path) -> None:
    output = tmp_path / "out"
    output.mkdir()
    (output / "part-000000.parquet").write_text("not parquet")
    with pytest.raises(
        UserError, match=r"part-000000\.parquet: unreadable shard \(.*\); it was not written by"
    ):
        opened(output)


def test_a_shard_without_ids_is_refused(tmp_path: Path) -> None:
    output = tmp_path / "out"
    output.mkdir()
    pq.write_table(pa.table({"other": ["a"]}), output / "part-000000.parquet")
    with pytest.raises(UserError, match=r"part-000000\.parquet: unreadable shard"):
        opened(output)


def test_a_shard_with_a_foreign_name_is_refused(tmp_path: Path) -> None:
    output = tmp_path / "out"
    output.mkdir()
    pq.write_table(pa.Table.from_pylist([row("a")], schema=SHARD_SCHEMA), output / "part-final.parquet")
    with pytest.raises(
        UserError,
        match=r"part-final\.parquet: unexpected shard name \(expected part-NNNNNN\.parquet\); move it away$",
    ):
        opened(output)


def test_rejects_are_rewritten_exactly_and_read_back_by_id(tmp_path: Path) -> None:
    output = tmp_path / "out"
    store = opened(output)
    entries = {
        "a": {"id": "a", "reason": "garbage ünïcode"},
        "b": {"id": "b", "reason": "timeout"},
    }
    store.write_rejects(entries)
    assert store.rejects_path.read_text(encoding="utf-8") == (
        '{"id": "a", "reason": "garbage ünïcode"}\n{"id": "b", "reason": "timeout"}\n'
    )
    store.write_rejects({"b": entries["b"]})
    assert store.rejects_path.read_text() == '{"id": "b", "reason": "timeout"}\n'
    store.close()
    assert opened(output).previous_rejects == {"b": entries["b"]}


def test_no_rejects_removes_the_file_and_is_fine_without_one(tmp_path: Path) -> None:
    store = opened(tmp_path / "out")
    try:
        store.write_rejects({})  # no file yet
        store.write_rejects({"a": {"id": "a", "reason": "r"}})
        store.write_rejects({})
        assert not store.rejects_path.exists()
    finally:
        store.close()


def test_bad_lines_of_the_rejects_file_are_skipped_not_fatal(tmp_path: Path) -> None:
    state = tmp_path / "out" / ".datagen"
    state.mkdir(parents=True)
    lines = [
        "{not json",
        json.dumps({"id": "a", "reason": "first"}),
        json.dumps(["id", "list"]),
        json.dumps({"id": 5, "reason": "a number id"}),
        json.dumps({"reason": "no id"}),
        json.dumps({"id": "b", "reason": "second"}),
    ]
    (state / "rejects.jsonl").write_text("\n".join(lines) + "\n")
    store = opened(tmp_path / "out")
    store.close()
    assert store.previous_rejects == {
        "a": {"id": "a", "reason": "first"},
        "b": {"id": "b", "reason": "second"},
    }


def test_the_manifest_is_written_sorted_and_indented(tmp_path: Path) -> None:
    store = opened(tmp_path / "out")
    try:
        store.record_settings({"temperature": 0.7, "model": "m"})
        assert store.manifest_path.read_text() == '{\n  "model": "m",\n  "temperature": 0.7\n}'
    finally:
        store.close()


def test_settings_are_checked_only_once_records_are_committed(tmp_path: Path) -> None:
    store = opened(tmp_path / "out")
    try:
        store.record_settings(SETTINGS)
        store.check_settings({**SETTINGS, "temperature": 0.1})  # nothing committed: any settings go
        store.record_settings({**SETTINGS, "temperature": 0.1})
        store.write_shard([row("a")])
        store.check_settings({**SETTINGS, "temperature": 0.1})  # the same settings pass
    finally:
        store.close()


def test_committed_records_without_a_manifest_accept_any_settings(tmp_path: Path) -> None:
    store = opened(tmp_path / "out")
    try:
        store.write_shard([row("a")])
        store.check_settings(SETTINGS)
        assert not store.manifest_path.exists()  # checking writes nothing
    finally:
        store.close()


def test_changed_settings_are_refused_with_every_change_named(tmp_path: Path) -> None:
    store = opened(tmp_path / "out")
    try:
        store.record_settings(SETTINGS)
        store.write_shard([row("a")])
        before = store.manifest_path.read_bytes()
        expected = (
            f"datagen.output_dir: {tmp_path / 'out'} holds records made with other settings "
            "(temperature 0.7 -> 0.1, seed None -> 3, top_k None -> 5); use a new datagen.output_dir "
            "to generate with the new settings, or restore the old ones"
        )
        with pytest.raises(UserError) as refused:
            store.record_settings({**SETTINGS, "temperature": 0.1, "seed": 3, "top_k": 5})
        assert str(refused.value) == expected
        assert store.manifest_path.read_bytes() == before
    finally:
        store.close()


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("{not json", r"unreadable manifest \(Expecting"),
        ("[1, 2]", r"unreadable manifest \(not a JSON object\)$"),
    ],
)
def test_an_unreadable_manifest_is_named(tmp_path: Path, text: str, why: str) -> None:
    store = opened(tmp_path / "out")
    try:
        store.write_shard([row("a")])
        store.manifest_path.write_text(text)
        with pytest.raises(UserError, match=rf"^{re.escape(str(store.manifest_path))}: {why}"):
            store.check_settings(SETTINGS)
    finally:
        store.close()


def test_a_committed_shard_is_synced_under_its_final_name_only(tmp_path: Path) -> None:
    output = tmp_path / "out"
    store = opened(output)
    try:
        path = store.write_shard([row("a")])
        assert not list(output.glob(".*.tmp"))
        assert os.access(path, os.R_OK) and pq.read_table(path).num_rows == 1
    finally:
        store.close()
