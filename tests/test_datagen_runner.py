"""`app.datagen.runner`, the servers' answerer, in-process against `ScriptedServer`: what each request
carries, each record's turns asked in order on the regenerated history, the rows and counts it hands
the run, a failed turn, an outage, a stop signal, and the client's timeout and connection bound."""

from __future__ import annotations

import hashlib
import io
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from app.datagen import run_datagen
from app.datagen.prompts import load_prompts
from app.datagen.servers import NoServerReachable
from app.errors import UserError
from tests.datagen_helpers import make_config, output_rows, quiet_console, rejects, user_prompts, write_jsonl
from tests.datagen_server import SCRIPTED_MODEL, ScriptedServer, echo

TWO_TURNS = {
    "id": "two",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "truncated please"},
        {"role": "assistant", "content": "old first"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "old second"},
    ],
}
ONE_TURN = {"id": "one", "messages": [{"role": "user", "content": "nofinish now"}]}


def seed_of(seed: int, record_id: str, turn: int) -> int:
    digest = hashlib.sha256(f"{seed}:{record_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "big") >> 1


def log_of(console: Console) -> str:
    return console.file.getvalue()  # type: ignore[attr-defined]


def terminal_console() -> Console:
    """A console that writes a terminal's escape sequences: a highlighted line would carry some."""
    return Console(file=io.StringIO(), force_terminal=True, width=300)


def plain_line(console: Console, start: str) -> str:
    """The one line that has `start`, from `start` on, after checking that no highlighting coloured it."""
    (line,) = [line[line.index(start) :] for line in log_of(console).splitlines() if start in line]
    assert "\x1b" not in line, line
    return line


def test_each_turn_is_asked_on_the_regenerated_history_with_the_run_s_settings(
    scripted: ScriptedServer, tmp_path: Path
) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", [TWO_TURNS, ONE_TURN])
    output = tmp_path / "out"
    settings = {
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 7,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    config = make_config(prompts, output, [scripted.url], concurrency=1, **settings)
    console = terminal_console()
    report = run_datagen(config, console)

    first_answer = echo(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "truncated please"}]
    )
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "truncated please"},
        {"role": "assistant", "content": first_answer},
        {"role": "user", "content": "hello"},
    ]
    asked = [(history[:2], "two", 2), (history, "two", 4), ([ONE_TURN["messages"][0]], "one", 1)]
    assert scripted.bodies == [
        {
            "model": SCRIPTED_MODEL,
            "messages": messages,
            "max_tokens": 8,
            "temperature": 0.5,
            "top_p": 0.9,
            "stream": False,
            "seed": seed_of(7, record_id, turn),
            "chat_template_kwargs": {"enable_thinking": False},
        }
        for messages, record_id, turn in asked
    ]
    rows = {row["id"]: row for row in output_rows(output)}
    assert rows["two"]["messages"] == [{**message, "reasoning_content": None} for message in history] + [
        {"role": "assistant", "content": echo(history), "reasoning_content": None}
    ]
    assert rows["two"]["reasoning_content"] == [None] * 5
    assert rows["two"]["finish_reasons"] == ["length", "stop"] and rows["one"]["finish_reasons"] == [
        "unknown"
    ]
    assert (rows["two"]["model"], rows["two"]["seed"], rows["two"]["temperature"]) == (SCRIPTED_MODEL, 7, 0.5)
    assert (report.done, report.failed, report.completion_tokens, report.truncated) == (2, 0, 9, 1)
    assert report.model == SCRIPTED_MODEL and report.exit_code == 0
    assert [(s.url, s.requests, s.peak_in_flight) for s in report.servers] == [(scripted.url, 3, 1)]
    # the progress bar counts the run's records: its last frame has them all
    frames = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", log_of(console))
    assert re.search(r"datagen ━+ 2/2 0 failed", frames), frames
    assert plain_line(console, "datagen: 2 records") == (
        f"datagen: 2 records to generate (0 already done) with {SCRIPTED_MODEL!r} on 1 server(s), 1 in flight each"
    )


def test_a_request_without_a_seed_or_template_arguments_carries_neither(
    scripted: ScriptedServer, tmp_path: Path
) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", [ONE_TURN])
    run_datagen(make_config(prompts, tmp_path / "out", [scripted.url]), quiet_console())
    (sent,) = scripted.bodies
    assert set(sent) == {"model", "messages", "max_tokens", "temperature", "top_p", "stream"}


def test_a_rerun_of_a_finished_output_asks_nothing_but_still_checks_the_settings(
    scripted: ScriptedServer, tmp_path: Path
) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", user_prompts(3))
    output = tmp_path / "out"
    run_datagen(make_config(prompts, output, [scripted.url]), quiet_console())
    asked = len(scripted.bodies)
    console = terminal_console()
    again = run_datagen(make_config(prompts, output, [scripted.url]), console)
    assert (again.done, again.resumed, again.exit_code) == (0, 3, 0)
    assert plain_line(console, "datagen: all") == "datagen: all 3 records are already done"
    with pytest.raises(UserError, match=r"other settings \(temperature 0.0 -> 0.5\)"):
        run_datagen(make_config(prompts, output, [scripted.url], temperature=0.5), quiet_console())
    assert len(scripted.bodies) == asked == 3


def test_a_failed_turn_fails_its_record_with_the_turn_s_index(
    scripted: ScriptedServer, tmp_path: Path
) -> None:
    later_turn_fails = {
        "id": "later",
        "messages": [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "x"},
            {"role": "user", "content": "bad400 now"},
        ],
    }
    garbage = {"id": "garbage", "messages": [{"role": "user", "content": "nochoices"}]}
    prompts = write_jsonl(tmp_path / "p.jsonl", [later_turn_fails, garbage, ONE_TURN])
    output = tmp_path / "out"
    report = run_datagen(make_config(prompts, output, [scripted.url], concurrency=1), quiet_console())
    assert (report.done, report.failed, report.unfinished, report.exit_code) == (1, 2, 0, 0)
    reasons = {entry["id"]: entry["reason"] for entry in rejects(output)}
    assert reasons == {
        "later": f'turn 3: {scripted.url}: HTTP 400: {{"detail": "prompt is too long"}}',
        "garbage": "turn 1: response has no `choices` (keys: ['id', 'object'])",
    }
    assert [row["id"] for row in output_rows(output)] == ["one"]


def test_an_outage_fails_the_records_it_met_stops_once_and_leaves_the_rest_pending(tmp_path: Path) -> None:
    """The first record's server hangs up (out of the rotation, no probe within the run); the other
    worker's record in flight is answered 0.5 s later, after the 0.1 s outage stopped the run: that
    worker takes no record after it."""
    server = ScriptedServer(delay_s=0.5).start()
    records = [{"id": "h", "messages": [{"role": "user", "content": "hangup"}]}, *user_prompts(3)]
    prompts = write_jsonl(tmp_path / "p.jsonl", records)
    console = quiet_console()
    config = make_config(
        prompts, tmp_path / "out", [server.url], concurrency=2, probe_interval_s=30.0, outage_timeout_s=0.1
    )
    try:
        report = run_datagen(config, console)
    finally:
        server.stop()
    assert (report.done, report.failed, report.unfinished) == (1, 1, 2)
    assert report.stopped_by == "outage" and report.exit_code == 1
    (stopping,) = [line for line in log_of(console).splitlines() if "stopping" in line]
    assert stopping.startswith(f"datagen: stopping: no server reachable for 0 s: last error {server.url}: ")
    (entry,) = rejects(tmp_path / "out")
    assert entry["id"] == "h" and entry["reason"] == stopping.removeprefix("datagen: stopping: ")


def test_a_stop_signal_abandons_the_records_in_flight(tmp_path: Path) -> None:
    """SIGTERM while both workers wait for their 1 s answers: the run ends at once, nothing answered,
    every record still pending for the next run."""
    server = ScriptedServer(delay_s=1.0).start()
    prompts = write_jsonl(tmp_path / "p.jsonl", user_prompts(4))
    config = make_config(prompts, tmp_path / "out", [server.url], concurrency=2)
    finished = threading.Event()

    def stop_once_both_are_asked() -> None:
        """Only while the run answers (its handler installed): a SIGTERM after a run that failed
        early would end the test process itself."""
        while len(server.requests) < 2:
            if finished.wait(0.01):
                return
        os.kill(os.getpid(), signal.SIGTERM)

    stopper = threading.Thread(target=stop_once_both_are_asked)
    started = time.monotonic()
    stopper.start()
    try:
        report = run_datagen(config, quiet_console())
    finally:
        finished.set()
        stopper.join()
        server.stop()
    assert time.monotonic() - started < 0.95
    assert (report.done, report.failed, report.unfinished) == (0, 0, 4)
    assert report.stopped_by == "SIGTERM" and report.exit_code == 128 + signal.SIGTERM
    assert len(server.requests) == 2


def test_a_request_longer_than_request_timeout_s_fails_its_record(tmp_path: Path) -> None:
    server = ScriptedServer(delay_s=1.0).start()
    prompts = write_jsonl(tmp_path / "p.jsonl", user_prompts(1))
    config = make_config(prompts, tmp_path / "out", [server.url], max_retries=0, request_timeout_s=0.2)
    started = time.monotonic()
    try:
        report = run_datagen(config, quiet_console())
    finally:
        server.stop()
    assert time.monotonic() - started < 0.9 and report.failed == 1
    (entry,) = rejects(tmp_path / "out")
    assert entry["reason"] == f"turn 1: {server.url}: timed out (ReadTimeout) (gave up after 1 attempts)"


def test_every_server_gets_concurrency_requests_at_once(tmp_path: Path) -> None:
    servers = [ScriptedServer(delay_s=0.2).start() for _ in range(2)]
    prompts = write_jsonl(tmp_path / "p.jsonl", user_prompts(12))
    config = make_config(prompts, tmp_path / "out", [s.url for s in servers], concurrency=3)
    try:
        report = run_datagen(config, quiet_console())
    finally:
        for server in servers:
            server.stop()
    assert report.done == 12 and [s.peak_active for s in servers] == [3, 3]
    assert sorted(row["id"] for row in output_rows(tmp_path / "out")) == sorted(
        record.id for record in load_prompts([str(prompts)]).records
    )


def test_more_than_a_hundred_slots_are_all_used(tmp_path: Path) -> None:
    """Two servers of 60 slots each: the client's connection bound follows the slots (an HTTP client's
    default bound, 100 connections, would hold the requests in flight below 120)."""
    servers = [ScriptedServer(delay_s=1.0).start() for _ in range(2)]
    prompts = write_jsonl(tmp_path / "p.jsonl", user_prompts(120))
    config = make_config(prompts, tmp_path / "out", [s.url for s in servers], concurrency=60)
    try:
        report = run_datagen(config, quiet_console())
    finally:
        for server in servers:
            server.stop()
    assert report.done == 120 and [s.peak_active for s in servers] == [60, 60]


def test_prompt_files_with_no_usable_record_are_all_named(tmp_path: Path) -> None:
    first = write_jsonl(tmp_path / "a.jsonl", [{"text": "no messages"}])
    second = write_jsonl(tmp_path / "b.jsonl", ["{oops"])
    config = make_config(first, tmp_path / "out", ["http://127.0.0.1:9"])
    config.prompts.append(str(second))
    with pytest.raises(UserError) as refused:
        run_datagen(config, quiet_console())
    assert str(refused.value) == (
        f"datagen.prompts: no usable prompt records in {first}, {second} (2 malformed, 0 duplicate ids)"
    )
    assert not (tmp_path / "out").exists()


def test_the_configured_model_is_asked_for_and_one_no_server_serves_is_refused(
    scripted: ScriptedServer, tmp_path: Path
) -> None:
    scripted.models = [{"id": "first"}, {"id": "second"}]
    prompts = write_jsonl(tmp_path / "p.jsonl", [ONE_TURN])
    report = run_datagen(
        make_config(prompts, tmp_path / "out", [scripted.url], model="second"), quiet_console()
    )
    assert report.model == "second" and [body["model"] for body in scripted.bodies] == ["second"]
    assert [row["model"] for row in output_rows(tmp_path / "out")] == ["second"]
    with pytest.raises(NoServerReachable, match="'third' is not served by every server"):
        run_datagen(make_config(prompts, tmp_path / "other", [scripted.url], model="third"), quiet_console())
