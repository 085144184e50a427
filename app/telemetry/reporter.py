"""What a run tells the outside world, through reporters the trainer calls at fixed points.

The trainer knows nothing of files, wandb or S3: it calls every reporter at start, on each log
line, after each complete checkpoint and at exit. A reporter must never stall or crash training:
slow work goes to a background thread, and failures become warnings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


@dataclass(frozen=True)
class RunStart:
    """What every reporter is told when the run starts."""

    run_dir: Path
    config: dict[str, Any]
    """The resolved run config, JSON-ready."""
    fingerprint: dict[str, Any]
    """The environment fingerprint (`dflash doctor`)."""
    compile_report: dict[str, Any]
    """What train start did about compilation (`CompileReport.to_dict()`: cache key, loaded or not,
    warm-up counters, the loaded cache's measured step time)."""
    environment: dict[str, Any] = field(default_factory=dict)
    """This start in the run's environment record: its number and what it accepted
    (`train.allow_environment_drift`); anything accepted makes the run DEGRADED."""


class Reporter(Protocol):
    def on_start(self, start: RunStart) -> None: ...

    def on_log(self, record: dict[str, Any]) -> None:
        """One log line's metrics (step, loss, acc, streak, lr, noise, rates, queues, memory, events)."""

    def on_checkpoint(self, path: Path, step: int) -> None:
        """A complete, checksummed checkpoint now exists at `path`."""

    def on_exit(self, reason: str, step: int) -> None:
        """The run ends: "completed", "stopped" (signal, checkpointed) or "failed: <cause>"."""


class MetricsFile:
    """Appends every log record to `metrics.jsonl` in the run directory (what `dflash status --plot` reads)."""

    def __init__(self) -> None:
        self.path: Path | None = None

    def on_start(self, start: RunStart) -> None:
        self.path = start.run_dir / "metrics.jsonl"

    def on_log(self, record: dict[str, Any]) -> None:
        assert self.path is not None, "on_start comes first"
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")

    def on_checkpoint(self, path: Path, step: int) -> None:
        pass

    def on_exit(self, reason: str, step: int) -> None:
        pass


class HealthWatch(Protocol):
    def check(self, record: dict[str, Any]) -> list[str]:
        """Health events (one line each) raised by this log record; shown in the log line and reported."""
