"""`dflash datagen` against a real OpenAI-compatible server (`transformers serve` of a tiny Qwen3).

The real server is started once per session. Failure modes a healthy real server never shows
(garbage bodies, 500s, exact concurrency counts, a server that appears late) use `ScriptedServer`,
a small real HTTP server on loopback.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from app.datagen import run_datagen
from app.datagen.prompts import load_prompts, prompt_hash
from app.datagen.responses import split_think
from app.datagen.servers import NoServerReachable
from app.errors import UserError
from tests.datagen_helpers import (
    DFLASH,
    FAST,
    REPO,
    kill_after_a_timed_shard,
    make_config,
    output_rows,
    quiet_console,
    rejects,
    start_cli,
    user_prompts,
    wait_for,
    write_jsonl,
    write_run_config,
)
from tests.datagen_server import ScriptedServer, TransformersServe, free_port

# --- against the real server ------------------------------------------------------------------


def test_regenerates_prompts_with_the_real_server(serve: TransformersServe, tmp_path: Path) -> None:
    import datasets

    openai = [
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is a dict?"},
            ]
        },
        {"id": 42, "messages": [{"role": "user", "content": [{"type": "text", "text": "Explain sockets."}]}]},
        {
            "messages": [
                {"role": "user", "content": "Name a module."},
                {"role": "assistant", "content": "old answer"},
            ]
        },
    ]
    sharegpt = [
        {
            "conversations": [
                {"from": "human", "value": "What is a tarfile?"},
                {"from": "gpt", "value": "old"},
            ]
        },
        {
            "conversations": [
                {"from": "system", "value": "Be kind."},
                {"from": "human", "value": "Define uuid."},
            ]
        },
    ]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", openai)
    datasets.Dataset.from_list(sharegpt).to_parquet(str(tmp_path / "more.parquet"))
    output = tmp_path / "out"
    config = make_config(prompts, output, [serve.url], concurrency=3, shard_size=2, temperature=0.0)
    config.prompts.append(str(tmp_path / "more.parquet"))

    report = run_datagen(config, quiet_console())

    assert (report.done, report.failed, report.skipped, report.input) == (5, 0, 0, 5)
    assert "done 5 + failed 0 + skipped 0 == input 5" in report.accounting()
    assert report.exit_code == 0 and report.records_per_s > 0
    assert report.servers[0].peak_in_flight == 3  # several requests in flight at once
    # the training loader's view: a directory load sees the shards only, `messages` in OpenAI form
    loaded = datasets.load_dataset(str(output), split="train")
    assert len(loaded) == 5 and len(report.shards) == 3
    rows = {row["id"]: row for row in loaded}
    assert "42" in rows
    model = serve.model_id()
    for row in rows.values():
        roles = [message["role"] for message in row["messages"]]
        assert roles[-1] == "assistant" and roles.count("assistant") == 1
        assert row["messages"][-1]["content"].strip() and "old" not in row["messages"][-1]["content"]
        assert (row["model"], row["temperature"], row["top_p"], row["max_tokens"]) == (model, 0.0, 1.0, 8)
        assert row["finish_reasons"] == ["length"]
    # the stored answer is exactly what the target says to the prompt
    first = next(row for row in rows.values() if row["messages"][0]["content"] == "Be brief.")
    asked = [{"role": m["role"], "content": m["content"]} for m in first["messages"][:-1]]
    assert first["messages"][-1]["content"] == serve.chat(asked, max_tokens=8)
    assert first["id"] == prompt_hash(load_prompts([str(prompts)]).records[0].turns)


def test_multi_turn_turns_are_conditioned_on_regenerated_history(
    serve: TransformersServe, tmp_path: Path
) -> None:
    u1, u2 = "Tell me about heapq.", "And what about bisect?"
    record = {
        "messages": [
            {"role": "user", "content": u1},
            {"role": "assistant", "content": "The ORIGINAL first answer."},
            {"role": "user", "content": u2},
            {"role": "assistant", "content": "The ORIGINAL second answer."},
        ]
    }
    output = tmp_path / "out"
    report = run_datagen(
        make_config(write_jsonl(tmp_path / "p.jsonl", [record]), output, [serve.url]), quiet_console()
    )
    assert report.done == 1

    messages = output_rows(output)[0]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    a1, a2 = messages[1]["content"], messages[3]["content"]
    assert a1 == serve.chat([{"role": "user", "content": u1}], max_tokens=8)
    regenerated_history = [{"role": "user", "content": u1}, {"role": "assistant", "content": a1}]
    assert a2 == serve.chat([*regenerated_history, {"role": "user", "content": u2}], max_tokens=8)
    original_history = [
        {"role": "user", "content": u1},
        {"role": "assistant", "content": "The ORIGINAL first answer."},
    ]
    assert a2 != serve.chat([*original_history, {"role": "user", "content": u2}], max_tokens=8)


def test_a_killed_run_kept_what_waited_flush_interval_s_and_its_rerun_owes_exactly_the_rest(
    serve: TransformersServe, tmp_path: Path
) -> None:
    """SIGKILL mid-run with shards of 1,000 records: what was answered before the last timed commit
    (`flush_interval_s`, 0.3 s) is on disk; a record that failed in an earlier run and is not yet
    answered is still listed as a reject; the rerun answers exactly the records missing, and the
    committed shards stay as they were."""
    prompts = write_jsonl(tmp_path / "p.jsonl", user_prompts(120))
    records = load_prompts([str(prompts)]).records
    output = tmp_path / "out"
    earlier = {"id": records[-1].id, "source": "earlier", "reason": "HTTP 500", "model": None, "time": "x"}
    (output / ".datagen").mkdir(parents=True)
    write_jsonl(output / ".datagen" / "rejects.jsonl", [earlier])
    config = write_run_config(
        tmp_path / "run.toml",
        {
            "prompts": [str(prompts)],
            "output_dir": str(output),
            "servers": [serve.url],
            "max_tokens": 8,
            "concurrency": 2,
            "shard_size": 1000,
            "flush_interval_s": 0.3,
            **FAST,
        },
    )
    kept = kill_after_a_timed_shard(config, output, 120)
    kept_ids = [row["id"] for row in output_rows(output)]
    assert len(kept_ids) == len(set(kept_ids)) >= 1 and records[-1].id not in kept_ids
    assert [entry["id"] for entry in rejects(output)] == [records[-1].id]  # carried while still owed

    second = subprocess.run([str(DFLASH), "datagen", str(config)], cwd=REPO, capture_output=True, text=True)
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"done {120 - len(kept_ids)} + failed 0 + skipped {len(kept_ids)} == input 120" in second.stdout
    ids = [row["id"] for row in output_rows(output)]
    assert len(ids) == 120 and set(ids) == {record.id for record in records}  # nothing lost, nothing twice
    assert all((output / name).read_bytes() == data for name, data in kept.items())
    assert rejects(output) == []  # the earlier failure is answered now


@pytest.mark.slow  # restarts the real server
def test_server_killed_mid_run_is_recorded_and_resumed(serve: TransformersServe, tmp_path: Path) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", user_prompts(12))
    output = tmp_path / "out"
    config = write_run_config(
        tmp_path / "run.toml",
        {"prompts": [str(prompts)], "output_dir": str(output), "servers": [serve.url], "max_tokens": 8,
         "concurrency": 2, "shard_size": 2, "max_retries": 2, **FAST},
    )  # fmt: skip
    first = start_cli(config)
    try:
        wait_for(lambda: len(list(output.glob("part-*.parquet"))) >= 1, 120, "a committed shard")
        serve.kill()
        stdout, _ = first.communicate(timeout=60)
    finally:
        serve.kill()
        serve.start()
    assert first.returncode == 1, stdout
    assert "leaves the rotation" in stdout and "stopped by a server outage" in stdout
    failures = rejects(output)
    assert failures and all("no server reachable" in failure["reason"] for failure in failures)
    done_before = len(output_rows(output))
    assert f"done {done_before} + failed {len(failures)}" in stdout

    second = subprocess.run([str(DFLASH), "datagen", str(config)], cwd=REPO, capture_output=True, text=True)
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"done {12 - done_before} + failed 0 + skipped {done_before} == input 12" in second.stdout
    ids = [row["id"] for row in output_rows(output)]
    assert len(ids) == len(set(ids)) == 12
    assert rejects(output) == []  # the retried failures left the rejects file


# --- failure modes, with the scripted server ---------------------------------------------------


def test_garbage_responses_are_recorded_failures(scripted: ScriptedServer, tmp_path: Path) -> None:
    texts = [
        "nonjson",
        "nochoices",
        "empty",
        "errorbody",
        "http500",
        "bad400",
        "flaky",
        "fine one",
        "fine two",
    ]
    records = [{"id": text, "messages": [{"role": "user", "content": text}]} for text in texts]
    output = tmp_path / "out"
    report = run_datagen(
        make_config(write_jsonl(tmp_path / "p.jsonl", records), output, [scripted.url], max_retries=3),
        quiet_console(),
    )
    assert (report.done, report.failed, report.input) == (3, 6, 9)
    assert "done 3 + failed 6 + skipped 0 == input 9" in report.accounting()
    assert sorted(row["id"] for row in output_rows(output)) == [
        "fine one",
        "fine two",
        "flaky",
    ]  # 503s retried
    reasons = {failure["id"]: failure["reason"] for failure in rejects(output)}
    assert "not JSON" in reasons["nonjson"]
    assert "no `choices`" in reasons["nochoices"]
    assert "empty response" in reasons["empty"]
    assert (
        "error in a 200 response" in reasons["errorbody"]
        and "gave up after 4 attempts" in reasons["errorbody"]
    )
    assert "HTTP 500" in reasons["http500"]
    assert "HTTP 400" in reasons["bad400"] and "prompt is too long" in reasons["bad400"]
    assert report.rejects_path is not None and report.exit_code == 0


def test_a_rerun_retries_previous_failures(scripted: ScriptedServer, tmp_path: Path) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", user_prompts(5))
    output = tmp_path / "out"
    config = make_config(prompts, output, [scripted.url], max_retries=1)
    scripted.broken = True
    first = run_datagen(config, quiet_console())
    assert (first.done, first.failed, first.exit_code) == (0, 5, 1)
    assert len(rejects(output)) == 5

    scripted.broken = False
    second = run_datagen(config, quiet_console())
    assert (second.done, second.failed, second.resumed) == (5, 0, 0)
    assert rejects(output) == [] and len(output_rows(output)) == 5


def test_concurrency_is_bounded_per_server_and_load_is_shared(tmp_path: Path) -> None:
    servers = [ScriptedServer(delay_s=0.03).start(), ScriptedServer(delay_s=0.03).start()]
    try:
        config = make_config(
            write_jsonl(tmp_path / "p.jsonl", user_prompts(48)),
            tmp_path / "out",
            [s.url for s in servers],
            concurrency=3,
        )
        report = run_datagen(config, quiet_console())
    finally:
        for server in servers:
            server.stop()
    assert report.done == 48
    assert all(2 <= server.peak_active <= 3 for server in servers)  # several in flight, never above the bound
    assert all(len(server.requests) >= 12 for server in servers)
    assert sum(len(server.requests) for server in servers) == 48


def test_an_unreachable_server_joins_when_it_answers(tmp_path: Path) -> None:
    live, late = ScriptedServer(delay_s=0.03).start(), ScriptedServer(delay_s=0.03, port=free_port())
    console = quiet_console()
    config = make_config(
        write_jsonl(tmp_path / "p.jsonl", user_prompts(60)),
        tmp_path / "out",
        [live.url, late.url],
        concurrency=2,
    )
    timer = threading.Timer(0.3, late.start)
    timer.start()
    try:
        report = run_datagen(config, console)
    finally:
        timer.join()
        live.stop()
        late.stop()
    log = console.file.getvalue()
    assert report.done == 60
    assert f"server {late.url} is unreachable" in log and f"server {late.url} answers again" in log
    assert len(late.requests) > 0


def test_reasoning_policies(scripted: ScriptedServer, tmp_path: Path) -> None:
    records = [
        {"id": "tags", "messages": [{"role": "user", "content": "think hard"}, {"role": "assistant", "content": "x"},
                                    {"role": "user", "content": "go on"}]},
        {"id": "field", "messages": [{"role": "user", "content": "reasoningfield please"}]},
    ]  # fmt: skip
    prompts = write_jsonl(tmp_path / "p.jsonl", records)
    rows = {}
    for policy in ("keep", "drop", "separate"):
        output = tmp_path / policy
        assert (
            run_datagen(make_config(prompts, output, [scripted.url], reasoning=policy), quiet_console()).done
            == 2
        )
        rows[policy] = {row["id"]: row for row in output_rows(output)}
    for record_id in ("tags", "field"):
        kept, dropped, separate = (rows[policy][record_id] for policy in ("keep", "drop", "separate"))
        assert kept["messages"][1]["content"] == dropped["messages"][1]["content"] == "answer"
        assert kept["messages"][1]["reasoning_content"] == "why"
        assert dropped["messages"][1]["reasoning_content"] is None and dropped["reasoning_content"][1] is None
        assert (
            separate["messages"][1]["reasoning_content"] is None and separate["reasoning_content"][1] == "why"
        )
    # the second turn was asked with the regenerated first answer, without its thinking
    second_turn = [messages for messages in scripted.requests if len(messages) == 3]
    assert second_turn and second_turn[0][1] == {"role": "assistant", "content": "answer"}


def test_split_think_forms() -> None:
    assert split_think("<think>\nplan\n</think>\n\nanswer") == ("plan", "answer")
    assert split_think("plan</think>answer") == ("plan", "answer")  # the template opened the block
    assert split_think("<think>cut off at max_tok") == ("cut off at max_tok", "")
    assert split_think("no thinking here") == (None, "no thinking here")


def test_malformed_prompts_are_counted_and_shown(scripted: ScriptedServer, tmp_path: Path) -> None:
    good = {"messages": [{"role": "user", "content": "fine"}]}
    bad = [
        "{not json",
        {"text": "no messages"},
        {"messages": [{"role": "wizard", "content": "hi"}]},
        {"messages": [{"role": "user", "content": 7}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "42"}]},
        {"messages": [{"role": "assistant", "content": "first"}, {"role": "user", "content": "q"}]},
        {
            "conversations": [
                {"from": "human", "value": "q"},
                {"from": "gpt", "value": "a"},
                {"from": "gpt", "value": "b"},
            ]
        },
        {"messages": [{"role": "user", "content": "   "}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        {"id": ["a"], "messages": [{"role": "user", "content": "q"}]},
    ]
    prompts = write_jsonl(tmp_path / "p.jsonl", [good, *bad, good, {"id": "x", **good}])
    console = quiet_console()
    report = run_datagen(make_config(prompts, tmp_path / "out", [scripted.url]), console)
    assert (report.done, report.malformed, report.duplicate, report.input) == (2, 10, 1, 13)
    assert "done 2 + failed 0 + skipped 11 == input 13" in report.accounting()
    shown = console.file.getvalue()
    for reason in [
        "p.jsonl:2: not valid JSON",
        "p.jsonl:3: expected a `messages` or `conversations` list",
        "p.jsonl:4: messages[0].role: expected one of",
        "p.jsonl:5: messages[0].content: expected a string, got int",
        "p.jsonl:6: messages[1]: tool turns are not regenerated",
        "p.jsonl:7: turn 0: assistant turn before any user turn",
        "p.jsonl:8: turns 1 and 2: two assistant turns in a row",
        "p.jsonl:9: messages[0].content: empty user turn",
        "p.jsonl:10: messages[0].content[0]: only text content parts are supported",
        "p.jsonl:11: `id` must be a non-empty string or an integer",
        "... and 1 more",
    ]:
        assert reason in shown
    duplicate = load_prompts([str(prompts)]).duplicates[0]
    assert duplicate.source.endswith("p.jsonl:12") and duplicate.reason.startswith("duplicate id")


def test_prompt_files_in_every_format(tmp_path: Path) -> None:
    record = {"messages": [{"role": "user", "content": "hi"}]}
    as_array = tmp_path / "array.json"
    as_array.write_text(json.dumps([record, {**record, "id": "b"}]))
    as_lines = write_jsonl(tmp_path / "lines.json", [{**record, "id": "c"}])  # JSON lines under a .json name
    prompts = load_prompts([str(as_array), str(as_lines)])
    assert [r.id for r in prompts.records] == [prompt_hash(prompts.records[0].turns), "b", "c"]
    assert [r.source for r in prompts.records] == [f"{as_array}#0", f"{as_array}#1", f"{as_lines}:1"]
    assert prompts.records[0].turns[-1].role == "assistant"  # the slot the target fills
    with pytest.raises(UserError, match=r"missing.jsonl: file not found"):
        load_prompts([str(tmp_path / "missing.jsonl")])
    (tmp_path / "prompts.txt").write_text("hi")
    with pytest.raises(UserError, match=r"prompts.txt: expected a .jsonl, .json or .parquet file"):
        load_prompts([str(tmp_path / "prompts.txt")])


def test_empty_prompt_set_is_a_user_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(UserError, match="no usable prompt records"):
        run_datagen(make_config(empty, tmp_path / "out", ["http://127.0.0.1:9"]), quiet_console())
    only_bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "x"}, "{oops"])
    with pytest.raises(UserError, match=r"no usable prompt records .* \(2 malformed, 0 duplicate ids\)"):
        run_datagen(make_config(only_bad, tmp_path / "out", ["http://127.0.0.1:9"]), quiet_console())

    from app.cli import main

    config = write_run_config(
        tmp_path / "run.toml", {"prompts": [str(empty)], "output_dir": str(tmp_path / "o")}
    )
    monkeypatch.setattr(sys, "argv", ["dflash", "datagen", str(config)])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2
    error_lines = capsys.readouterr().err.strip().splitlines()
    assert error_lines[-1].startswith("dflash: error: datagen.prompts: no usable prompt records")


def test_a_line_longer_than_a_terminal_is_one_line_in_a_log(tmp_path: Path, capsys: Any) -> None:
    """Written to a file (no terminal, so no width), datagen's lines are not cut at 80 columns: a
    skipped record's long path stays on its line."""
    deep = tmp_path / ("a-directory-name-long-enough-to-pass-eighty-columns-" * 2)
    deep.mkdir()
    only_bad = write_jsonl(deep / "bad.jsonl", [{"text": "x"}])
    with pytest.raises(UserError):
        run_datagen(make_config(only_bad, tmp_path / "out", ["http://127.0.0.1:9"]))
    lines = capsys.readouterr().err.splitlines()
    (line,) = [line for line in lines if "bad.jsonl" in line]
    assert line.startswith(f"  {only_bad}:") and len(line) > 100


def test_no_reachable_server_is_a_clear_error(tmp_path: Path) -> None:
    prompts = write_jsonl(tmp_path / "p.jsonl", user_prompts(2))
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(NoServerReachable, match=f"no server reachable at {dead}"):
        run_datagen(make_config(prompts, tmp_path / "out", [dead]), quiet_console())
