"""wandb: a real offline run (its .wandb file parsed back), and wandb failing for real (unreachable
server, missing package) while training goes on."""

from __future__ import annotations

import json
import socket
import struct
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from app.config import load_config
from app.env import collect_fingerprint
from app.telemetry import TelemetryWarning
from app.telemetry.reporter import RunStart
from app.telemetry.status import read_status
from app.telemetry.wandb_sink import RUN_ID_FILE, WandbReporter, resolve_wandb_mode, wandb_metrics
from app.train.trainer import Trainer
from tests.helpers import SMALL

ROOT = Path(__file__).resolve().parents[1]


def read_wandb_records(path: Path) -> list[Any]:
    """The protobuf records of a .wandb file (a LevelDB-style log: 32 KiB blocks of checksummed chunks)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a wandb transaction log"
    block, position, pending, records = 32768, 7, b"", []
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a chunk header is padding
            position += block - position % block
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if kind == 0:
            break
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk of a record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wait_for_exit_record(path: Path, timeout_s: float = 60.0) -> list[Any]:
    """wandb's service process may still be flushing the log when `finish()` returns: wait for its end."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = read_wandb_records(path)
        if (
            any(record.WhichOneof("record_type") == "exit" for record in records)
            or time.monotonic() > deadline
        ):
            return records
        time.sleep(0.2)


def items(update: Any) -> dict[str, Any]:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in update}


def train_record(step: int, events: list[str] = ()) -> dict[str, Any]:  # type: ignore[assignment]
    return {
        "elapsed_s": 1.0 * step, "step": step, "loss": 3.0 / step, "acc": 0.1 * step, "streak": 0.5, "lr": 1e-3,
        "noise": 0.0, "target_batches_per_s": 2.0, "drafter_batches_per_s": 2.0, "tokens_per_s": 4600.0,
        "q_pre": [1, 2], "q_hs": [0], "epoch_progress": 0.01 * step, "eta_s": 60.0, "memory_gb": (61.2, 70.0),
        "events": list(events), "step_losses": [3.0 / step], "grad_norm": 0.7,
    }  # fmt: skip


def test_offline_run_holds_config_fingerprint_history_and_summary(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-home"))
    (tmp_path / "wandb-home").mkdir()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = load_config(ROOT / "configs" / "tiny.toml").model_dump(mode="json")
    reporter = WandbReporter(
        "offline",
        "dflash-test",
        "unit",
        timeout_s=60,
        compile_counters=lambda: {"inductor.fxgraph_cache_miss": 0},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", TelemetryWarning)  # nothing may go wrong here
        compile_report = {"compiled": True, "key": "3f9c0d1e", "cache_loaded": True}
        reporter.on_start(RunStart(run_dir, config, collect_fingerprint(), compile_report))
        reporter.on_log(train_record(2))
        reporter.on_log(train_record(4, ["memory: reserved GPU memory grew 9%"]))
        reporter.on_log({"step": 4, "eval": {"tau": 2.75, "rounds": 12, "generated_tokens": 33}})
        reporter.on_checkpoint(run_dir / "checkpoints" / "step_00000004", 4)
        reporter.on_exit("completed", 4)
    assert reporter.failure is None

    run_id = (run_dir / RUN_ID_FILE).read_text().strip()
    [offline] = list((tmp_path / "wandb-home" / "wandb").glob(f"offline-run-*-{run_id}"))
    [log_file] = list(offline.glob("run-*.wandb"))
    records = wait_for_exit_record(log_file)
    kinds = [record.WhichOneof("record_type") for record in records]
    assert {"run", "history", "summary", "exit"} <= set(kinds)

    run = next(record.run for record in records if record.WhichOneof("record_type") == "run")
    logged_config = items(run.config.update)
    assert logged_config["run"]["drafter"]["block_size"] == 8
    assert logged_config["fingerprint"]["torch"]["version"].startswith("2.")
    assert logged_config["compile"] == {"compiled": True, "key": "3f9c0d1e", "cache_loaded": True}

    history = [items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    by_step = {}
    for row in history:
        by_step.setdefault(row["_step"], {}).update(row)
    assert by_step[2]["train/loss"] == pytest.approx(1.5) and by_step[2]["perf/ktok_per_s"] == pytest.approx(
        4.6
    )
    assert by_step[2]["queues/q_pre_1"] == 2 and by_step[2]["memory/reserved_gb"] == 70.0
    assert by_step[2]["compile/inductor.fxgraph_cache_miss"] == 0
    assert by_step[4]["health/events"] == 1 and by_step[4]["eval/tau"] == 2.75

    summary: dict[str, Any] = {}
    for record in records:
        if record.WhichOneof("record_type") == "summary":
            summary.update(items(record.summary.update))
    assert summary["exit_reason"] == "completed" and summary["checkpoint/step"] == 4
    assert summary["health/event_log"] == ["step 4: memory: reserved GPU memory grew 9%"]
    exit_record = next(record.exit for record in records if record.WhichOneof("record_type") == "exit")
    assert exit_record.exit_code == 0


def test_wandb_that_cannot_reach_its_server_does_not_stop_training(
    tiny_lm_dir, tiny_conversations, tmp_path: Path, monkeypatch
) -> None:
    """Online mode against a port nobody listens on: init fails after its timeout, the run completes."""
    with socket.socket() as probe:  # a free port, closed again: connections to it are refused
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    monkeypatch.setenv("WANDB_API_KEY", "f" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{dead_port}")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    run_dir = tmp_path / "run"
    config = load_config(
        ROOT / "configs" / "tiny.toml",
        [*SMALL, f"data.train_files=['{tiny_conversations}']", f"train.output_dir={run_dir}", "train.max_steps=3",
         "telemetry.wandb=auto", "telemetry.wandb_timeout_s=3"],
    )  # fmt: skip
    lines: list[str] = []
    trainer = Trainer(config, log=lines.append)
    guarded = trainer.telemetry.reporters
    wandb_reporter = next(r.inner for r in guarded if isinstance(getattr(r, "inner", None), WandbReporter))
    assert wandb_reporter.mode == "online"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = trainer.run()
        # The run may end before wandb gives up (its exit wait is bounded too): let the thread finish.
        wandb_reporter._thread.join(120)
    assert result.steps == 3 and len(result.losses) == 3
    assert sum(line.startswith("[") for line in lines) == 3
    telemetry_warnings = [str(w.message) for w in caught if issubclass(w.category, TelemetryWarning)]
    assert any(
        message.startswith("wandb did not start (") and "training continues without wandb" in message
        for message in telemetry_warnings
    ), telemetry_warnings
    assert wandb_reporter.failure is not None
    assert read_status(run_dir)["state"] == "completed"


def test_wandb_not_installed_is_a_warning(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # `import wandb` raises ImportError
    reporter = WandbReporter("offline", "dflash-test", None, timeout_s=10)
    with pytest.warns(TelemetryWarning, match=r"wandb did not start \(ModuleNotFoundError"):
        reporter.on_start(RunStart(tmp_path, {}, {}, {}))
        reporter.on_exit("completed", 0)
    reporter.on_log(train_record(1))  # after giving up, records are dropped at once
    assert reporter._queue.empty()


@pytest.mark.parametrize(
    ("setting", "environ", "mode"),
    [
        ("auto", {}, "offline"),
        ("auto", {"WANDB_API_KEY": "k"}, "online"),
        ("auto", {"WANDB_API_KEY": "k", "WANDB_MODE": "offline"}, "offline"),
        ("auto", {"WANDB_MODE": "disabled"}, "disabled"),
        ("offline", {"WANDB_API_KEY": "k"}, "offline"),
        ("disabled", {"WANDB_API_KEY": "k"}, "disabled"),
        ("online", {}, "online"),
    ],
)
def test_wandb_mode(setting: str, environ: dict[str, str], mode: str) -> None:
    assert resolve_wandb_mode(setting, environ) == mode


def test_eval_records_become_eval_keys() -> None:
    assert wandb_metrics({"step": 10, "eval": {"tau": 3.1, "rounds": 7, "note": "x"}}, {}) == {
        "eval/tau": 3.1,
        "eval/rounds": 7,
    }
