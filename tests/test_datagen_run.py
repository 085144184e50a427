"""`app.datagen.run`, the regeneration run both engines share, in this process with a scripted server:
its event lines, the accounting of its report, and its commits."""

from __future__ import annotations

import io
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from app.config.schema import DatagenConfig
from app.datagen import run_datagen
from app.datagen.prompts import PromptRecord, PromptSet, Skipped, Turn, load_prompts
from app.datagen.run import (
    SHOWN_SKIPS,
    DatagenReport,
    RegenerationRun,
    generation_settings,
    record_row,
    show_skipped,
)
from app.datagen.servers import Server
from app.datagen.store import ShardStore
from tests.datagen_helpers import make_config, output_rows, rejects, user_prompts, wait_for, write_jsonl
from tests.datagen_server import ScriptedServer


def test_a_server_error_in_markup_syntax_is_logged_as_it_is(scripted: ScriptedServer, tmp_path: Path) -> None:
    """A server's error body is text, not rich markup: a chat template's `[/INST]` in it once stopped the
    run with rich's MarkupError when the server left the rotation, and `[bold]` vanished from the line."""
    records = [*user_prompts(1), {"messages": [{"role": "user", "content": "templated500 please"}]}]
    prompts = write_jsonl(tmp_path / "p.jsonl", records)
    log = io.StringIO()
    report = run_datagen(
        make_config(prompts, tmp_path / "out", [scripted.url], max_retries=2), Console(file=log, width=400)
    )
    assert (report.done, report.failed) == (1, 1)
    body = "<s>[INST] templated500 [/INST] failed: [bold]out of memory[/bold]"
    left = f"datagen: server {scripted.url} leaves the rotation: {scripted.url}: HTTP 500: {body}"
    assert left in log.getvalue().splitlines()
    assert body in rejects(tmp_path / "out")[0]["reason"]


def report(**fields: Any) -> DatagenReport:
    return DatagenReport(**{"input": 10, "resumed": 2, "malformed": 1, "duplicate": 1, **fields})


def test_the_accounting_line_proves_every_record_is_somewhere() -> None:
    assert report(done=5, failed=1).accounting() == (
        "done 5 + failed 1 + skipped 4 == input 10  (skipped: 2 already done, 1 malformed, 1 duplicate ids)"
    )
    assert (
        report(done=3, failed=1, unfinished=2)
        .accounting()
        .startswith("done 3 + failed 1 + skipped 4 + unfinished 2 == input 10  ")
    )
    assert (
        report(done=3)
        .accounting()
        .startswith("done 3 + failed 0 + skipped 4 != (BUG: records unaccounted for) ")
    )


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"done": 6}, 0),
        ({"done": 0, "failed": 6, "resumed": 0}, 1),  # nothing ever succeeded
        ({"done": 0, "failed": 4}, 0),  # earlier runs' records did
        ({"done": 1, "failed": 5, "resumed": 0}, 0),
        ({"done": 6, "stopped_by": "outage"}, 1),
        ({"done": 6, "stopped_by": "SIGINT"}, 130),
        ({"done": 6, "stopped_by": "SIGTERM"}, 143),
        ({"done": 6, "stopped_by": "SIGHUP"}, 129),
    ],
)
def test_exit_codes(fields: dict[str, Any], code: int) -> None:
    assert report(**fields).exit_code == code


def test_the_summary_of_a_finished_run() -> None:
    server = Server("http://s:1")
    server.requests, server.failures, server.peak_in_flight = 7, 2, 3
    done = report(
        done=6, elapsed_s=4.0, completion_tokens=30, truncated=2, output_dir=Path("/o"),
        shards=[Path("/o/part-000000.parquet")], servers=[server],
    )  # fmt: skip
    assert done.records_per_s == 1.5 and done.skipped == 4
    assert done.summary() == [
        "datagen: done 6 + failed 0 + skipped 4 == input 10  (skipped: 2 already done, 1 malformed, 1 duplicate ids)",
        "datagen: 6 records in 4.0 s = 1.50 records/s, 7.5 generated tokens/s; 2 responses hit max_tokens",
        "datagen: 1 new shard(s) in /o",
        "datagen: server http://s:1: 7 requests, 2 failed attempts, peak 3 in flight",
    ]


def test_the_summary_of_a_stopped_run_with_failures() -> None:
    stopped = report(
        done=2, failed=1, unfinished=3, elapsed_s=0.0, rejects_path=Path("/o/.datagen/rejects.jsonl"),
        stopped_by="outage",
    )  # fmt: skip
    assert stopped.records_per_s == 0.0
    assert stopped.summary()[1:] == [
        "datagen: 2 records in 0.0 s = 0.00 records/s, 0.0 generated tokens/s",
        "datagen: 0 new shard(s) in .",
        "datagen: 1 failed records listed in /o/.datagen/rejects.jsonl; a rerun retries them",
        "datagen: stopped by a server outage: completed records are committed; 4 records remain; "
        "rerun the same command to resume",
    ]
    assert report(stopped_by="SIGTERM").summary()[-1].startswith("datagen: stopped by SIGTERM: ")
    quick = report(done=1, elapsed_s=0.5, completion_tokens=3).summary()[1]
    assert quick == "datagen: 1 records in 0.5 s = 2.00 records/s, 6.0 generated tokens/s"


def test_generation_settings_and_record_rows() -> None:
    datagen = DatagenConfig(
        prompts=["p.jsonl"], output_dir="o", servers=["http://s:1"], temperature=0.5, top_p=0.9,
        max_tokens=7, seed=3, reasoning="drop", chat_template_kwargs={"enable_thinking": False},
    )  # fmt: skip
    unnamed = {
        "temperature": 0.5, "top_p": 0.9, "max_tokens": 7, "seed": 3, "reasoning": "drop",
        "chat_template_kwargs": {"enable_thinking": False},
    }  # fmt: skip
    assert generation_settings(datagen, None) == unnamed
    assert generation_settings(datagen, "m") == {**unnamed, "model": "m"}
    record = PromptRecord("r", "p.jsonl:3", (Turn("user", "q"), Turn("assistant")), "math")
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": None},
    ]
    assert record_row(record, messages, [None, "why"], ["stop"], "m", datagen) == {
        "id": "r", "messages": messages, "reasoning_content": [None, "why"], "finish_reasons": ["stop"],
        "model": "m", "temperature": 0.5, "top_p": 0.9, "max_tokens": 7, "seed": 3, "source": "p.jsonl:3",
        "domain": "math",
    }  # fmt: skip


def test_skipped_records_are_shown_up_to_a_limit_as_text() -> None:
    console = Console(file=io.StringIO(), width=400, force_terminal=True, color_system="standard")
    show_skipped(console, PromptSet())
    assert console.file.getvalue() == ""
    malformed = [Skipped(f"p.jsonl:{i}", f"bad [/x] {i}") for i in range(SHOWN_SKIPS + 1)]
    show_skipped(
        console, PromptSet(malformed=malformed, duplicates=[Skipped("q.jsonl:1", "duplicate id 'a'")])
    )
    lines = console.file.getvalue().splitlines()
    assert lines[0] == f"datagen: skipping {SHOWN_SKIPS + 1} malformed records and 1 repeated ids:"
    assert lines[1:-1] == [f"  p.jsonl:{i}: bad [/x] {i}" for i in range(SHOWN_SKIPS)]
    assert lines[-1] == "  ... and 2 more"
    exactly = Console(file=io.StringIO(), width=400)
    show_skipped(exactly, PromptSet(malformed=malformed[:SHOWN_SKIPS]))
    assert len(exactly.file.getvalue().splitlines()) == 1 + SHOWN_SKIPS  # no "... and 0 more"


def regeneration(tmp_path: Path, count: int, **fields: Any) -> tuple[RegenerationRun, ShardStore, Console]:
    """A RegenerationRun over `count` prompts p0.. into tmp_path/out (an opened store: close it)."""
    records = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(count)]
    prompts = load_prompts([str(write_jsonl(tmp_path / "p.jsonl", records))])
    datagen = make_config(tmp_path / "p.jsonl", tmp_path / "out", ["http://s:1"], **fields)
    store = ShardStore(datagen.output_dir)
    store.open()
    console = Console(file=io.StringIO(), width=400)
    run = RegenerationRun(datagen, prompts, store, console)
    run.report.model = "m"
    return run, store, console


def answer(run: RegenerationRun, index: int, tokens: int = 3, truncated: int = 0) -> None:
    record = next(r for r in run.pending if r.id == f"p{index}")
    run.answered(record, {**ROW, "id": record.id}, tokens, truncated)


ROW = {
    "messages": [{"role": "user", "content": "q", "reasoning_content": None}],
    "reasoning_content": [None],
    "finish_reasons": ["stop"],
    "model": "m",
    "source": "p.jsonl:1",
}


def test_answers_are_committed_in_full_shards_and_the_rest_at_the_end(tmp_path: Path) -> None:
    run, store, console = regeneration(tmp_path, 5, shard_size=2)
    try:
        with run.answering({"model": "m"}, total=5) as progress:
            for index in range(3):
                answer(run, index, tokens=4, truncated=index % 2)
            assert [p.name for p in run.report.shards] == ["part-000000.parquet"]
            assert progress.done == 3
            run.failed(run.pending[3], "HTTP 500")
            assert (progress.done, progress.failed) == (3, 1)
        report = run.finish()
        (tmp_path / "out" / ".datagen" / "rejects.jsonl").rename(tmp_path / "rejects.jsonl")
        assert run.finish() is report  # completed once: nothing is committed again
        assert not (tmp_path / "out" / ".datagen" / "rejects.jsonl").exists()
        (tmp_path / "rejects.jsonl").rename(tmp_path / "out" / ".datagen" / "rejects.jsonl")
    finally:
        store.close()
    assert [p.name for p in report.shards] == ["part-000000.parquet", "part-000001.parquet"]
    assert [row["id"] for row in output_rows(tmp_path / "out")] == ["p0", "p1", "p2"]
    assert (report.done, report.failed, report.unfinished, report.completion_tokens, report.truncated) == (
        3, 1, 1, 12, 1,
    )  # fmt: skip
    assert report.rejects_path == tmp_path / "out" / ".datagen" / "rejects.jsonl" and report.rejected == 1
    (entry,) = rejects(tmp_path / "out")
    assert {key: entry[key] for key in ("id", "source", "reason", "model")} == {
        "id": "p3", "source": f"{tmp_path / 'p.jsonl'}:4", "reason": "HTTP 500", "model": "m",
    }  # fmt: skip
    assert entry["time"].endswith("+00:00") and len(entry["time"]) == 25
    assert json.loads((tmp_path / "out" / ".datagen" / "manifest.json").read_text()) == {"model": "m"}
    assert report.elapsed_s > 0 and console.file.getvalue() == ""


def test_a_rerun_owes_the_rest_and_carries_only_the_rejects_still_pending(tmp_path: Path) -> None:
    run, store, _ = regeneration(tmp_path, 4)
    with run.answering({}, total=4):
        answer(run, 0)
        run.failed(run.pending[1], "first failure")
        run.failed(run.pending[2], "second failure")
    first = run.finish()
    store.close()
    assert (first.done, first.failed, first.unfinished, first.rejected) == (1, 2, 1, 2)  # each failure counts
    # p2 was answered since by hand: its reject is no longer carried
    rows = output_rows(tmp_path / "out")
    store.open()
    store.write_shard([{**rows[0], "id": "p2"}])
    store.close()
    rerun, store, _ = regeneration(tmp_path, 4)
    try:
        assert [r.id for r in rerun.pending] == ["p1", "p3"]
        assert list(rerun.rejects) == ["p1"]
        assert (rerun.report.input, rerun.report.resumed) == (4, 2)
        assert (rerun.report.malformed, rerun.report.duplicate) == (0, 0)
        assert rerun.report.output_dir == tmp_path / "out"
        with rerun.answering({}, total=2):
            answer(rerun, 1)  # a retried failure that succeeds leaves the rejects
        report = rerun.finish()
    finally:
        store.close()
    assert (report.rejects_path, report.rejected, report.unfinished) == (None, 0, 1)
    assert rejects(tmp_path / "out") == []


def test_a_partial_shard_waits_for_flush_interval_s_then_the_timer_commits_it(tmp_path: Path) -> None:
    run, store, _ = regeneration(tmp_path, 3, shard_size=100, flush_interval_s=1.0)
    try:
        with run.answering({}, total=3):
            answer(run, 0)
            run.failed(run.pending[1], "r")
            assert not list((tmp_path / "out").glob("part-*")) and rejects(tmp_path / "out") == []
            # the timer writes the shard, then the rejects: wait for both
            wait_for(
                lambda: len(output_rows(tmp_path / "out")) == 1 and rejects(tmp_path / "out") != [],
                5.0,
                "the timed commit",
            )
            assert [r["id"] for r in rejects(tmp_path / "out")] == ["p1"]
            answer(run, 2)
            assert len(output_rows(tmp_path / "out")) == 1  # the interval restarted at the commit
    finally:
        run.finish()
        store.close()
    assert len(output_rows(tmp_path / "out")) == 2


def test_a_stop_signal_is_noted_once_and_handed_to_the_answerer(tmp_path: Path) -> None:
    run, store, console = regeneration(tmp_path, 2)
    stops: list[str] = []
    try:
        with run.answering({}, total=2, on_stop=lambda: stops.append(run.report.stopped_by or "")):
            os.kill(os.getpid(), signal.SIGTERM)
            wait_for(lambda: stops, 5.0, "the handler")
            os.kill(os.getpid(), signal.SIGINT)  # a second signal is still caught, not acted on
            time.sleep(0.05)
    finally:
        store.close()
    assert stops == ["SIGTERM"] and run.report.stopped_by == "SIGTERM"
    assert console.file.getvalue() == "datagen: SIGTERM: stopping, committing completed records\n"
    assert run.stop("outage") is False and run.report.stopped_by == "SIGTERM"
    assert run.report.exit_code == 143 and run.report.unfinished == 2


def test_a_full_shard_commits_the_rejects_with_it(tmp_path: Path) -> None:
    run, store, _ = regeneration(tmp_path, 3, shard_size=2)
    try:
        with run.answering({}, total=3):
            run.failed(run.pending[0], "r")
            answer(run, 1)
            assert rejects(tmp_path / "out") == []  # not due yet: nothing committed
            answer(run, 2)
            assert [r["id"] for r in rejects(tmp_path / "out")] == ["p0"]  # with the shard
    finally:
        run.finish()
        store.close()


def test_the_malformed_and_repeated_records_are_counted(tmp_path: Path) -> None:
    lines = [{"id": "a", "messages": [{"role": "user", "content": "q"}]}] * 2 + [{"text": "x"}]
    prompts = load_prompts([str(write_jsonl(tmp_path / "p.jsonl", lines))])
    store = ShardStore(tmp_path / "out")
    store.open()
    try:
        run = RegenerationRun(
            make_config(tmp_path / "p.jsonl", tmp_path / "out", ["http://s:1"]), prompts, store, Console()
        )
        assert (run.report.input, run.report.malformed, run.report.duplicate) == (3, 1, 1)
    finally:
        store.close()


def test_an_event_line_on_a_colour_terminal_is_its_text_unhighlighted(tmp_path: Path) -> None:
    """rich would colour the numbers, URLs and brackets of a line on a terminal: a server's error body
    is shown as it came, with no styles."""
    run, store, _ = regeneration(tmp_path, 1)
    store.close()
    terminal = io.StringIO()
    run.console = Console(file=terminal, width=400, force_terminal=True, color_system="truecolor")
    run.log("server http://127.0.0.1:8000 failed: HTTP 500 [/INST] {'retry': 2}")
    assert (
        terminal.getvalue() == "datagen: server http://127.0.0.1:8000 failed: HTTP 500 [/INST] {'retry': 2}\n"
    )
