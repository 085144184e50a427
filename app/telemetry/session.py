"""A rank's reporting, assembled once: the trainer hands it plain data at fixed points and this object
runs the health watches, prints the log line and calls every reporter (metrics.jsonl, status.json,
wandb, the S3 sync). Only the logging rank reports: the other drafter ranks' telemetry has no
reporters."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from app.telemetry.logline import LogLine
from app.telemetry.reporter import HealthWatch, Reporter, RunStart


class Telemetry:
    """The reporters and health watches of one rank, called by the trainer."""

    def __init__(self, reporters: list[Reporter], watches: list[HealthWatch], log: Callable[[str], None]):
        self.reporters = list(reporters)
        self.watches = list(watches)
        self.log = log

    def watch(self, watches: list[HealthWatch]) -> None:
        """Add watches that exist only once the run started (compile's throughput guard and findings)."""
        self.watches += watches

    def on_start(self, start: RunStart) -> None:
        for reporter in self.reporters:
            reporter.on_start(start)

    def on_window(self, line: LogLine, details: dict[str, Any]) -> None:
        """One log window: its line and the details only the record carries; the watches' events join both."""
        record = {**asdict(line), **details}
        line.events = record["events"] = [event for watch in self.watches for event in watch.check(record)]
        self.log(line.render())
        self.on_record(record)

    def on_record(self, record: dict[str, Any]) -> None:
        """A record that is not a training window (an eval result): to every reporter, as it is."""
        for reporter in self.reporters:
            reporter.on_log(record)

    def on_checkpoint(self, path: Path, step: int) -> None:
        for reporter in self.reporters:
            reporter.on_checkpoint(path, step)

    def on_exit(self, reason: str, step: int) -> None:
        for reporter in self.reporters:
            reporter.on_exit(reason, step)
