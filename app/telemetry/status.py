"""`status.json`: what a run is, how far it got, how healthy it is and how it ended, in one file.

Written atomically (temp file, then rename) at start, every `telemetry.status_every` steps, at once when
a health event, an eval or a checkpoint arrives, and at exit, with a heartbeat beside it while the run
lives (`liveness.py`); `dflash status RUN_DIR` renders it. A
resumed run keeps the earlier attempts' exits and health events, so the file tells the whole story.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from app.atomic import write_json_atomic
from app.config import RunConfig
from app.errors import UserError
from app.paths import STORAGE_STATE_FILE
from app.telemetry.baseline import Baseline, baseline_from_compile_report
from app.telemetry.health import active_conditions
from app.telemetry.liveness import Heartbeat
from app.telemetry.reporter import RunStart

STATUS_FILE = "status.json"
SCHEMA_VERSION = 1
EVENTS_KEPT = 200
"""Health events kept in status.json (the newest); the count covers all of them."""
RECENT_LINES = 5
"""Log lines averaged for the throughput shown (one slow window should not make a run look slow)."""


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def read_status(run_dir: str | Path) -> dict[str, Any]:
    """A run directory's status.json, or a one-line UserError saying why there is none."""
    path = Path(run_dir) / STATUS_FILE
    if not Path(run_dir).is_dir():
        raise UserError(f"{run_dir}: no such run directory")
    try:
        status = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: no status file; is {run_dir} a run directory of a started run?") from None
    except (OSError, json.JSONDecodeError) as error:
        raise UserError(f"{path}: not a readable status file ({error})") from None
    if not isinstance(status, dict) or status.get("schema") != SCHEMA_VERSION:
        raise UserError(f"{path}: not a dflash status file of schema {SCHEMA_VERSION}")
    storage = Path(run_dir) / STORAGE_STATE_FILE
    if storage.is_file():  # the S3 sync's own file (written atomically: complete or absent)
        status["storage"] = json.loads(storage.read_text())
    return status


def exit_state(reason: str) -> str:
    """ "completed", "stopped" or "failed" from the trainer's exit reason."""
    return reason if reason in ("completed", "stopped") else "failed"


class StatusFile:
    """The reporter that keeps status.json current."""

    def __init__(
        self,
        config: RunConfig,
        *,
        watches: Sequence[Any] = (),
        compile_counters: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        self.config = config
        self.every = config.telemetry.status_every
        self.watches = list(watches)
        self.baseline: Baseline | None = None
        """The loaded compile cache's measured step time, once on_start brings the compile report."""
        self.compile_counters = compile_counters
        self.path: Path | None = None
        self.status: dict[str, Any] = {}
        self.recent: list[dict[str, Any]] = []
        self.attempt_events = 0
        self.written_step = -1
        self.heartbeat: Heartbeat | None = None
        self._lock = threading.Lock()

    # ---- reporter -----------------------------------------------------------------------------------

    def on_start(self, start: RunStart) -> None:
        self.path = start.run_dir / STATUS_FILE
        self.baseline = baseline_from_compile_report(start.compile_report)
        previous = _previous_status(self.path)
        attempts = previous.get("attempts", [])
        if previous:
            attempts = [*attempts, _attempt_summary(previous)]
        self.status = {
            "schema": SCHEMA_VERSION,
            "run_name": self.config.telemetry.run_name or start.run_dir.resolve().name,
            "run_dir": str(start.run_dir.resolve()),
            "state": "running",
            "exit_reason": None,
            "started_at": now_iso(),
            "finished_at": None,
            "goal": goal(self.config),
            "config": config_summary(self.config),
            "fingerprint": fingerprint_summary(start.fingerprint),
            "compile": start.compile_report,
            "progress": {"step": previous.get("progress", {}).get("step", 0)},
            "throughput": {"baseline": self.baseline.to_dict() if self.baseline else None},
            "eval": previous.get("eval"),
            "memory_gb": None,
            "health": {
                "state": "healthy",
                "active": [],
                "events": previous.get("health", {}).get("events", []),
            },
            "last_checkpoint": previous.get("last_checkpoint"),
            "attempts": attempts,
        }
        self.status["health"]["event_count"] = previous.get("health", {}).get("event_count", 0)
        self.status["environment"] = start.environment
        # A start that accepted a drifted environment is degraded for all of this attempt.
        accepted = start.environment.get("accepted", [])
        self._add_events(self.status["progress"]["step"], [f"environment: {line}" for line in accepted])
        self.write()
        self.heartbeat = Heartbeat(start.run_dir)
        self.heartbeat.start()

    def on_log(self, record: dict[str, Any]) -> None:
        if "eval" in record:
            self.status["eval"] = {"step": record["step"], **record["eval"]}
            self.write()
            return
        self.recent = [*self.recent, record][-RECENT_LINES:]
        self.status["progress"] = _progress(record)
        self.status["throughput"] = self._throughput()
        self.status["memory_gb"] = record.get("memory_gb")
        events = record.get("events") or []
        self._add_events(record["step"], events)
        if events or record["step"] - self.written_step >= self.every:
            self.write()

    def _add_events(self, step: int, events: list[str]) -> None:
        health = self.status["health"]
        attempt = len(self.status["attempts"])
        health["events"] = [
            *health["events"],
            *({"step": step, "attempt": attempt, "message": event} for event in events),
        ][-EVENTS_KEPT:]
        health["event_count"] += len(events)
        self.attempt_events += len(events)

    def on_checkpoint(self, path: Path, step: int) -> None:
        self.status["last_checkpoint"] = {"path": str(path), "step": step, "at": now_iso()}
        self.write()

    def on_exit(self, reason: str, step: int) -> None:
        self.status["state"] = exit_state(reason)
        self.status["exit_reason"] = reason
        self.status["finished_at"] = now_iso()
        self.status["progress"]["step"] = step
        self.write()
        if self.heartbeat is not None:
            self.heartbeat.stop()

    # ---- writing ------------------------------------------------------------------------------------

    def write(self) -> None:
        """Refresh the derived sections and replace status.json atomically (safe from any thread)."""
        with self._lock:
            assert self.path is not None, "on_start comes first"
            status = self.status
            status["updated_at"] = now_iso()
            status["health"]["active"] = active_conditions(self.watches)
            status["health"]["state"] = (
                "failed"
                if status["state"] == "failed"
                else "degraded"
                if self.attempt_events or status["health"]["active"]
                else "healthy"
            )
            if self.compile_counters is not None:
                status["compile_counters"] = dict(self.compile_counters())
            write_json_atomic(self.path, status)
            self.written_step = status["progress"].get("step", 0)

    def _throughput(self) -> dict[str, Any]:
        tokens = [r["tokens_per_s"] for r in self.recent if r.get("tokens_per_s") is not None]
        rates = [r["drafter_batches_per_s"] for r in self.recent if r.get("drafter_batches_per_s")]
        mfu = [r["mfu"] for r in self.recent if r.get("mfu") is not None]
        throughput: dict[str, Any] = {
            "tokens_per_s": sum(tokens) / len(tokens) if tokens else None,
            "mfu": sum(mfu) / len(mfu) if mfu else None,
            "step_time_s": len(rates) / sum(rates) if rates else None,
            "log_lines": len(self.recent),
            "baseline": self.baseline.to_dict() if self.baseline else None,
            "vs_baseline": None,
        }
        if self.baseline is not None:
            ratios = [ratio for r in self.recent if (ratio := self.baseline.speed_ratio(r)) is not None]
            throughput["vs_baseline"] = sum(ratios) / len(ratios) if ratios else None
        return throughput


def _previous_status(path: Path) -> dict[str, Any]:
    """The status of an earlier attempt in this run directory (a resume); {} when there is none."""
    try:
        previous = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return previous if isinstance(previous, dict) and previous.get("schema") == SCHEMA_VERSION else {}


def _attempt_summary(previous: dict[str, Any]) -> dict[str, Any]:
    return {
        "started_at": previous.get("started_at"),
        "finished_at": previous.get("finished_at"),
        "step": previous.get("progress", {}).get("step"),
        "exit_reason": previous.get("exit_reason") or "no exit recorded (killed?)",
        "health": previous.get("health", {}).get("state"),
    }


def _progress(record: dict[str, Any]) -> dict[str, Any]:
    keys = ("step", "total_steps", "epoch_progress", "eta_s", "elapsed_s", "loss", "acc", "streak", "lr", "noise",
            "grad_norm", "q_pre", "q_hs")  # fmt: skip
    return {key: record[key] for key in keys if key in record}


def goal(config: RunConfig) -> dict[str, Any]:
    target = config.target
    target_name = target.path or (f"builtin {target.builtin}" if target.builtin else None)
    if target_name is None:
        target_name = f"random-weight {target.architecture.get('model_type') if target.architecture else '?'}"
    train, drafter = config.train, config.drafter
    topology = (
        f"{config.topology.target_ranks} target + {config.topology.drafter_ranks} drafter ranks"
        if config.topology.target_ranks
        else f"colocated on {config.topology.drafter_ranks} rank(s), device {train.device}"
    )
    text = (
        f"train a {drafter.num_layers}-layer DFlash drafter (block {drafter.block_size}, {train.anchors} anchors) "
        f"for {target_name}: {train.epochs} epochs"
        + (f", capped at {train.max_steps} steps" if train.max_steps else "")
        + f"; {topology}"
    )
    return {"text": text, "epochs": train.epochs, "max_steps": train.max_steps}


def config_summary(config: RunConfig) -> dict[str, Any]:
    """The settings a reader checks first (the full resolved config is config.json)."""
    return {
        "target": config.target.path or config.target.builtin or "architecture",
        "drafter.num_layers": config.drafter.num_layers,
        "drafter.block_size": config.drafter.block_size,
        "drafter.mask_token_id": config.drafter.mask_token_id,
        "data.token_budget": config.data.token_budget,
        "data.train_files": len(config.data.train_files),
        "train.anchors": config.train.anchors,
        "train.lr": config.train.lr,
        "train.precision": config.train.precision,
        "train.epochs": config.train.epochs,
        "train.max_steps": config.train.max_steps,
        "topology": f"{config.topology.target_ranks}T+{config.topology.drafter_ranks}D",
        "compile.mode": config.compile.mode,
        "telemetry.wandb": config.telemetry.wandb,
        "storage.s3_uri": config.storage.s3_uri,
    }


def fingerprint_summary(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """The environment at a glance (the full fingerprint is fingerprint.json)."""
    torch = fingerprint.get("torch") or {}
    packages = fingerprint.get("packages") or {}
    devices = (fingerprint.get("gpus") or {}).get("devices") or []
    return {
        "host": (fingerprint.get("host") or {}).get("hostname"),
        "python": (fingerprint.get("python") or {}).get("version"),
        "torch": torch.get("version"),
        "cuda": torch.get("cuda"),
        "triton": fingerprint.get("triton"),
        "transformers": fingerprint.get("transformers"),
        "gpus": [device.get("name") for device in devices],
        "lock_sha256": ((fingerprint.get("lock") or {}).get("sha256") or "")[:16] or None,
        "stray_packages": len(packages.get("stray") or []),
        "revision": ((fingerprint.get("project") or {}).get("revision") or "")[:12] or None,
        "changed": (fingerprint.get("project") or {}).get("changed"),
    }


def seconds_since(iso: str | None) -> float | None:
    if not iso:
        return None
    try:
        then = datetime.datetime.fromisoformat(iso)
    except ValueError:
        return None
    return time.time() - then.timestamp()
