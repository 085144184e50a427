"""Helpers of the datagen tests: prompt files, configs, the CLI as a subprocess, output readers."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from rich.console import Console

from app.config.schema import DatagenConfig
from app.datagen.prompts import load_prompts
from app.datagen.store import LOCK_FILE, STATE_DIR
from tests.datagen_server import echo

REPO = Path(__file__).resolve().parents[1]
DFLASH = Path(sys.executable).parent / "dflash"
FAST = {"retry_backoff_s": 0.02, "probe_interval_s": 0.1, "outage_timeout_s": 2.0, "request_timeout_s": 60.0}


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def user_prompts(count: int, prefix: str = "prompt") -> list[dict[str, Any]]:
    return [
        {"messages": [{"role": "user", "content": f"{prefix} number {i}: tell me about lists"}]}
        for i in range(count)
    ]


def make_config(prompts: Path, output: Path, servers: list[str], **fields: Any) -> DatagenConfig:
    return DatagenConfig(
        prompts=[str(prompts)], output_dir=str(output), servers=servers, **{"max_tokens": 8, **FAST, **fields}
    )


def quiet_console() -> Console:
    return Console(file=io.StringIO(), width=200)


def output_rows(output: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for shard in sorted(output.glob("part-*.parquet")):
        rows.extend(pq.read_table(shard).to_pylist())
    return rows


def rejects(output: Path) -> list[dict[str, Any]]:
    path = output / ".datagen" / "rejects.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def write_run_config(path: Path, datagen: dict[str, Any]) -> Path:
    lines = [
        "[target]",
        'builtin = "tiny-lm"',
        "[drafter]",
        "num_layers = 2",
        "mask_token_id = 3",
        "[datagen]",
    ]
    lines += [f"{key} = {json.dumps(value)}" for key, value in datagen.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def start_cli(config: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(DFLASH), "datagen", str(config)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=default_hangup,
    )


def kill_after_a_timed_shard(config: Path, output: Path, timeout_s: float) -> dict[str, bytes]:
    """`dflash datagen CONFIG` killed with SIGKILL once its first shard is committed (by the timed flush,
    when shards are larger than the run), still running; the shards it left, by name."""
    run = start_cli(config)
    wait_for(lambda: any(output.glob("part-*.parquet")), timeout_s, "a shard committed by the timer")
    assert run.poll() is None, "the run finished before it could be killed"
    run.send_signal(signal.SIGKILL)
    run.wait()
    return {shard.name: shard.read_bytes() for shard in output.glob("part-*.parquet")}


def default_hangup() -> None:
    """A run started from a shell has SIGHUP at its default, also when the suite itself runs under
    nohup (which leaves it ignored, and an ignored SIGHUP rightly stays ignored by the run)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def assert_complete(rows: list[dict[str, Any]], prompts: Path) -> None:
    """Every row is one prompt of `prompts`, once, with exactly the scripted server's whole answer."""
    expected = {record.id for record in load_prompts([str(prompts)]).records}
    ids = [row["id"] for row in rows]
    assert len(ids) == len(set(ids)) and set(ids) <= expected
    for row in rows:
        asked = [{"role": m["role"], "content": m["content"]} for m in row["messages"][:-1]]
        assert row["messages"][-1] == {"role": "assistant", "content": echo(asked), "reasoning_content": None}
        assert row["finish_reasons"] == ["stop"]


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file's content, but the lock's: it names whichever run took it last."""
    lock = Path(STATE_DIR) / LOCK_FILE
    return {
        str(path.relative_to(directory)): path.read_bytes()
        for path in directory.rglob("*")
        if path.is_file() and path.relative_to(directory) != lock
    }


def wait_for(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
