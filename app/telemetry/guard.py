"""Wrappers that keep telemetry from ever killing a run: a failing reporter or watch becomes a warning.

The trainer calls reporters inline (on_exit even from a `finally`), so an exception escaping one would
end training or hide the real cause of a crash. Every reporter and watch handed to the trainer goes
through these wrappers; one that keeps failing is switched off, with a last warning saying so.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from app.telemetry.health import HealthAbort
from app.telemetry.reporter import HealthWatch, Reporter, RunStart

MAX_CONSECUTIVE_FAILURES = 5
"""Failures in a row after which a reporter or watch is switched off for the rest of the run."""


class TelemetryWarning(UserWarning):
    """A reporter, health watch, wandb or the S3 sync failed; training goes on without it."""


def warn(message: str) -> None:
    warnings.warn(message, TelemetryWarning, stacklevel=2)


class _FailureCounter:
    def __init__(self, name: str) -> None:
        self.name = name
        self.consecutive = 0
        self.disabled = False

    def failed(self, what: str, error: Exception) -> None:
        self.consecutive += 1
        warn(f"{self.name}.{what} failed ({type(error).__name__}: {error}); training continues")
        if self.consecutive >= MAX_CONSECUTIVE_FAILURES:
            self.disabled = True
            warn(f"{self.name}: switched off after {self.consecutive} failures in a row")

    def succeeded(self) -> None:
        self.consecutive = 0


class GuardedReporter:
    """A reporter whose exceptions become `TelemetryWarning`s instead of reaching the training loop."""

    def __init__(self, inner: Reporter) -> None:
        self.inner = inner
        self._failures = _FailureCounter(type(inner).__name__)

    @property
    def disabled(self) -> bool:
        return self._failures.disabled

    def on_start(self, start: RunStart) -> None:
        self._call("on_start", start)

    def on_log(self, record: dict[str, Any]) -> None:
        self._call("on_log", record)

    def on_checkpoint(self, path: Path, step: int) -> None:
        self._call("on_checkpoint", path, step)

    def on_exit(self, reason: str, step: int) -> None:
        self._call("on_exit", reason, step)

    def _call(self, method: str, *args: Any) -> None:
        if self._failures.disabled:
            return
        try:
            getattr(self.inner, method)(*args)
        except Exception as error:
            self._failures.failed(method, error)
        else:
            self._failures.succeeded()


class GuardedWatch:
    """A health watch whose exceptions become warnings (and no events) instead of a crashed step."""

    def __init__(self, inner: HealthWatch) -> None:
        self.inner = inner
        self._failures = _FailureCounter(type(inner).__name__)

    def check(self, record: dict[str, Any]) -> list[str]:
        if self._failures.disabled:
            return []
        try:
            events = self.inner.check(record)
        except HealthAbort:
            raise  # the condition the run stops on, not a broken watch
        except Exception as error:
            self._failures.failed("check", error)
            return []
        self._failures.succeeded()
        return events
