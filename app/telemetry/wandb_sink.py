"""wandb reporting that can never stall or crash a run.

wandb's own `init` can hang on a bad network or raise; so everything wandb does (import, init, log,
finish) happens on one background thread fed by a bounded queue. A step only enqueues a dict; when wandb
fails, the run warns once and goes on without it. Offline by default (no key needed; `wandb sync
RUN_DIR/wandb/offline-run-*` uploads later), online when `WANDB_API_KEY` is set.
"""

from __future__ import annotations

import os
import queue
import secrets
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from app.atomic import write_text_atomic
from app.telemetry.guard import warn
from app.telemetry.reporter import RunStart

WandbMode = Literal["online", "offline", "disabled"]
RUN_ID_FILE = "wandb_id"
"""The run's wandb id, kept in the run directory so that a resumed run continues the same wandb run."""
QUEUE_LIMIT = 10_000
"""Records waiting for wandb; beyond this (wandb stuck for hours) records are dropped, with one warning."""
TRAIN_KEYS = ("loss", "acc", "streak", "lr", "noise", "grad_norm", "tokens_per_s", "target_batches_per_s",
              "drafter_batches_per_s", "mfu", "tflops_per_s", "epoch_progress", "eta_s")  # fmt: skip
EVENTS_IN_SUMMARY = 50


def resolve_wandb_mode(setting: str, environ: Mapping[str, str] | None = None) -> WandbMode:
    """`telemetry.wandb` -> the mode used: auto follows WANDB_MODE, else online iff WANDB_API_KEY is set."""
    if environ is None:  # looked up per call: `datasets.map(num_proc=...)` rebinds os.environ to a copy
        environ = os.environ
    if setting in ("online", "offline", "disabled"):
        return setting  # type: ignore[return-value]
    from_env = {"online": "online", "run": "online", "offline": "offline", "dryrun": "offline",
                "disabled": "disabled"}.get(environ.get("WANDB_MODE", ""))  # fmt: skip
    if from_env is not None:
        return from_env  # type: ignore[return-value]
    return "online" if environ.get("WANDB_API_KEY") else "offline"


def wandb_metrics(record: dict[str, Any], counters: Mapping[str, int]) -> dict[str, Any]:
    """One log record (or eval record) as flat wandb history keys."""
    if "eval" in record:
        return {f"eval/{key}": value for key, value in record["eval"].items() if _is_number(value)}
    metrics = {f"train/{key}": record[key] for key in TRAIN_KEYS if _is_number(record.get(key))}
    if _is_number(record.get("tokens_per_s")):
        metrics["perf/ktok_per_s"] = record["tokens_per_s"] / 1000
    for name in ("q_pre", "q_hs"):
        for index, depth in enumerate(record.get(name) or []):
            metrics[f"queues/{name}_{index}"] = depth
    if record.get("memory_gb") is not None:
        metrics["memory/allocated_gb"], metrics["memory/reserved_gb"] = record["memory_gb"]
    metrics["health/events"] = len(record.get("events") or [])
    metrics.update({f"compile/{key}": value for key, value in counters.items()})
    return metrics


class WandbReporter:
    """Sends config, fingerprint, metrics, eval tau, compile counters and health events to wandb."""

    def __init__(
        self,
        mode: Literal["online", "offline"],
        project: str,
        run_name: str | None,
        timeout_s: float,
        compile_counters: Callable[[], Mapping[str, int]] | None = None,
    ) -> None:
        self.mode = mode
        self.project = project
        self.run_name = run_name
        self.timeout_s = timeout_s
        self.compile_counters = compile_counters
        self.failure: str | None = None
        """Why wandb was given up (set by the worker thread); None while it works."""
        self.dropped = 0
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=QUEUE_LIMIT)
        self._exit: tuple[str, int] | None = None
        self._thread: threading.Thread | None = None

    def on_start(self, start: RunStart) -> None:
        run_id = _run_id(start.run_dir)
        run_config = {"run": start.config, "fingerprint": start.fingerprint, "compile": start.compile_report}
        self._thread = threading.Thread(
            target=self._work, args=(start.run_dir, run_id, run_config), name="wandb-reporter", daemon=True
        )
        self._thread.start()

    def on_log(self, record: dict[str, Any]) -> None:
        counters = dict(self.compile_counters()) if self.compile_counters else {}
        self._put(("log", (dict(record), counters)))

    def on_checkpoint(self, path: Path, step: int) -> None:
        self._put(("checkpoint", (str(path), step)))

    def on_exit(self, reason: str, step: int) -> None:
        self._exit = (reason, step)
        if self._thread is None:
            return
        self._thread.join(self.timeout_s)
        if self._thread.is_alive():
            warn(
                f"wandb did not finish within telemetry.wandb_timeout_s={self.timeout_s:g}s; "
                f"leaving it (its run files may miss the last records)"
            )

    # ---- the worker thread --------------------------------------------------------------------------

    def _put(self, item: tuple[str, Any]) -> None:
        if self.failure is not None:
            return
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            if self.dropped == 0:
                warn(f"wandb is {QUEUE_LIMIT} records behind; dropping records until it catches up")
            self.dropped += 1

    def _work(self, run_dir: Path, run_id: str, run_config: dict[str, Any]) -> None:
        try:
            run = self._init(run_dir, run_id, run_config)
        except BaseException as error:  # wandb may raise anything, SystemExit included, from its init
            self._give_up(f"wandb did not start ({type(error).__name__}: {_first_line(error)})")
            return
        events: list[str] = []
        try:
            while True:
                try:
                    kind, payload = self._queue.get(timeout=0.2)
                except queue.Empty:
                    if self._exit is not None:
                        break
                    continue
                if kind == "log":
                    record, counters = payload
                    run.log(wandb_metrics(record, counters), step=record["step"])
                    events += [f"step {record['step']}: {event}" for event in record.get("events") or []]
                    if record.get("events"):
                        run.summary["health/event_log"] = events[-EVENTS_IN_SUMMARY:]
                else:
                    run.summary["checkpoint/step"] = payload[1]
                    run.summary["checkpoint/path"] = payload[0]
            reason, step = self._exit
            run.summary["exit_reason"] = reason
            run.summary["final_step"] = step
            run.finish(exit_code=0 if reason in ("completed", "stopped") else 1)
        except BaseException as error:
            self._give_up(f"wandb failed ({type(error).__name__}: {_first_line(error)})")

    def _init(self, run_dir: Path, run_id: str, run_config: dict[str, Any]) -> Any:
        import wandb

        settings = wandb.Settings(init_timeout=self.timeout_s, console="off", silent=True)
        return wandb.init(
            project=self.project,
            name=self.run_name or run_dir.resolve().name,
            id=run_id,
            resume="allow",
            mode=self.mode,
            # WANDB_DIR, when set, is where the user wants wandb's files; else next to the run's own.
            dir=None if os.environ.get("WANDB_DIR") else str(run_dir),
            config=run_config,
            settings=settings,
            reinit="create_new",
        )

    def _give_up(self, reason: str) -> None:
        self.failure = reason
        warn(f"{reason}; training continues without wandb")


def _run_id(run_dir: Path) -> str:
    path = run_dir / RUN_ID_FILE
    if path.is_file():
        run_id = path.read_text().strip()
        if run_id:
            return run_id
    run_id = secrets.token_hex(4)
    write_text_atomic(path, run_id + "\n")
    return run_id


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""
