"""Health watches: turn log records into events when a run degrades the way the incident's run did.

Each watch sees every training log record (`check(record) -> events`) after warm-up and raises an
event when a condition starts (not on every line while it lasts); `active` names the condition in force
now, for status.json. Events appear in the log line, status.json and wandb.

- memory: reserved GPU memory must stay flat after warm-up (fixed shapes mean flat memory);
- throughput: steady-state speed below the baseline by more than `compile.slow_step_threshold`;
- queues: `q_pre` / `q_hs` stuck empty or full for a window (a starved or blocked pipeline stage);
- compile: recompiles and compile-cache misses after warm-up (counters from torch._dynamo or the caller);
- library JIT: Triton kernels compiled or autotuned after warm-up (`app.telemetry.compile_watches`);
- external: events posted by other components (the compile-cache loader, a data loader).
A non-finite loss is not a watch: the trainer stops with `NonFiniteLoss`, which becomes the exit reason.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from app.telemetry.baseline import Baseline

Counters = dict[str, int]


class HealthAbort(RuntimeError):
    """A watch's condition the run is configured to stop on (not a failure of the watch itself)."""


class _Warmup:
    """Health checks start `steps` steps after the first record this process sees (start or resume)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.first_step: int | None = None

    def over(self, step: int) -> bool:
        if self.first_step is None:
            self.first_step = step
        return step - self.first_step >= self.steps


class MemoryWatch:
    """Reserved GPU memory growing by more than `growth_threshold` within `window_steps` is an event.

    A window with a periodic eval (`evaluated`) starts the watch again from its level: the eval's
    decoding reserves memory of its own (1.2 -> 1.6 GB on SmolLM2), which is not training's growing."""

    def __init__(self, window_steps: int, growth_threshold: float, warmup_steps: int) -> None:
        self.window_steps = window_steps
        self.growth_threshold = growth_threshold
        self.warmup = _Warmup(warmup_steps)
        self.samples: list[tuple[int, float]] = []
        self.active: str | None = None
        self._last_event_step = 0

    def check(self, record: dict[str, Any]) -> list[str]:
        step, memory = record["step"], record.get("memory_gb")
        if memory is None or not self.warmup.over(step):
            return []
        reserved = float(memory[1])
        if record.get("evaluated"):
            self.samples = [(step, reserved)]
            return []
        self.samples = [(s, r) for s, r in self.samples if s >= step - self.window_steps]
        self.samples.append((step, reserved))
        floor_step, floor = min(self.samples, key=lambda sample: sample[1])
        if floor > 0 and (reserved - floor) / floor > self.growth_threshold:
            message = (
                f"memory: reserved GPU memory grew {(reserved - floor) / floor:.0%} in {step - floor_step} steps "
                f"({floor:.1f} -> {reserved:.1f} GB) after warm-up; fixed shapes should keep it flat "
                f"(changing shapes, recompiles or a leak)"
            )
            # Growth from here on is measured against the new level, so a leak keeps raising events.
            self.samples = [(step, reserved)]
            self.active, self._last_event_step = message, step
            return [message]
        if self.active is not None and step - self._last_event_step >= self.window_steps:
            self.active = None
        return []


class ThroughputWatch:
    """Speed below baseline / (1 + slow_threshold) in a log window is an event (one per dip: it is
    reported again only after a window back on speed).

    A record's rates are over its window's training time already (`app.train.metrics` leaves out the
    `paused_s` of an eval or a checkpoint's host copy), so a pause does not read as a dip, and a single
    slow window of a run whose mean looks fine still is one.
    """

    def __init__(
        self, baseline: Baseline, slow_threshold: float, warmup_steps: int, sustain: int = 1
    ) -> None:
        self.baseline = baseline
        self.slow_threshold = slow_threshold
        self.warmup = _Warmup(warmup_steps)
        self.sustain = sustain
        self.slow_lines = 0
        self.active: str | None = None

    def check(self, record: dict[str, Any]) -> list[str]:
        if not self.warmup.over(record["step"]):
            return []
        ratio = self.baseline.speed_ratio(record)
        if ratio is None:
            return []
        if ratio >= 1 / (1 + self.slow_threshold):
            self.slow_lines, self.active = 0, None
            return []
        self.slow_lines += 1
        if self.slow_lines != self.sustain:
            return []
        measured = [f"{record.get('tokens_per_s', 0.0) / 1000:.1f}Ktok/s"]
        if record.get("drafter_batches_per_s"):
            measured.append(f"{1 / record['drafter_batches_per_s']:.3g}s/step")
        lines = "this log window" if self.sustain == 1 else f"{self.sustain} log windows in a row"
        self.active = (
            f"throughput: {', '.join(measured)} is {1 - ratio:.0%} below the baseline {self.baseline.describe()} "
            f"in {lines} (degraded kernels? a compile or library JIT? a missed compile cache? another GPU?)"
        )
        return [self.active]


QUEUE_HINTS = {
    ("q_pre", "empty"): "target rank {i} has no prepared batch waiting: data preparation is the bottleneck",
    (
        "q_pre",
        "full",
    ): "target rank {i} is not consuming its prepared batches: its forward is stalled or slow",
    ("q_hs", "empty"): "drafter rank {i} is starved: the target ranks feeding it are too slow or stalled",
    ("q_hs", "full"): "drafter rank {i} cannot keep up: the target ranks wait on it",
}


@dataclass
class _Stuck:
    state: str
    since_step: int
    reported: bool = False


class QueueWatch:
    """A queue depth pinned at 0 or at its capacity for `stall_steps` steps is an event (once per stall)."""

    def __init__(self, capacities: dict[str, int], stall_steps: int, warmup_steps: int) -> None:
        self.capacities = capacities
        self.stall_steps = stall_steps
        self.warmup = _Warmup(warmup_steps)
        self.stuck: dict[tuple[str, int], _Stuck] = {}

    @property
    def active(self) -> str | None:
        reported = [f"{name}[{i}] {stuck.state}" for (name, i), stuck in self.stuck.items() if stuck.reported]
        return f"queues stuck: {', '.join(reported)}" if reported else None

    def check(self, record: dict[str, Any]) -> list[str]:
        step = record["step"]
        if not self.warmup.over(step):
            return []
        events = []
        for name, capacity in self.capacities.items():
            for i, depth in enumerate(record.get(name) or []):
                state = "empty" if depth <= 0 else "full" if depth >= capacity else None
                if state is None:
                    self.stuck.pop((name, i), None)
                    continue
                stuck = self.stuck.get((name, i))
                if stuck is None or stuck.state != state:
                    self.stuck[(name, i)] = _Stuck(state, step)
                elif not stuck.reported and step - stuck.since_step >= self.stall_steps:
                    stuck.reported = True
                    hint = QUEUE_HINTS[(name, state)].format(i=i)
                    events.append(
                        f"queues: {name}[{i}] {state} ({depth}/{capacity}) for {step - stuck.since_step} steps: {hint}"
                    )
        return events


WATCHED_COUNTERS = {
    "stats.unique_graphs": "graphs compiled",
    "inductor.fxgraph_cache_miss": "inductor cache misses",
    "inductor.fxgraph_cache_bypass": "inductor cache bypasses",
    "aot_autograd.autograd_cache_miss": "autograd cache misses",
    "aot_autograd.autograd_cache_bypass": "autograd cache bypasses",
}
"""Counters that must not move after warm-up: every increase is a recompile or a compile-cache miss."""

REPORTED_COUNTERS = (
    *WATCHED_COUNTERS,
    "inductor.fxgraph_cache_hit",
    "aot_autograd.autograd_cache_hit",
    "frames.total",
)


def dynamo_counters() -> Counters:
    """torch._dynamo's compile and cache counters of this process (only the ones reported)."""
    from torch._dynamo.utils import counters

    values = {f"{group}.{name}": value for group, names in counters.items() for name, value in names.items()}
    return {key: int(values[key]) for key in REPORTED_COUNTERS if key in values}


class CompileWatch:
    """Recompiles and compile-cache misses after warm-up are events; `latest` is reported to wandb/status."""

    def __init__(self, warmup_steps: int, read_counters: Callable[[], Counters] = dynamo_counters) -> None:
        self.warmup = _Warmup(warmup_steps)
        self.read_counters = read_counters
        self.latest: Counters = {}
        self.reference: Counters | None = None
        self.active: str | None = None

    def check(self, record: dict[str, Any]) -> list[str]:
        self.latest = dict(self.read_counters())
        if not self.warmup.over(record["step"]):
            return []
        if self.reference is None:
            self.reference = self.latest
            return []
        grown = {
            key: self.latest.get(key, 0) - self.reference.get(key, 0)
            for key in WATCHED_COUNTERS
            if self.latest.get(key, 0) > self.reference.get(key, 0)
        }
        self.reference = self.latest
        if not grown:
            return []
        changes = ", ".join(f"{WATCHED_COUNTERS[key]} +{count}" for key, count in grown.items())
        self.active = (
            f"compile: {changes} after warm-up at step {record['step']}: kernels were recompiled or "
            f"missed the compile cache (expect slow steps; `dflash doctor`, rebuild the cache)"
        )
        return [self.active]


class ExternalEvents:
    """Events raised outside the log path (compile-cache loader, recompile guard, data loader, ...).

    `post` may be called from any thread; the events appear on the next log line.
    """

    active: str | None = None

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[str] = []

    def post(self, message: str) -> None:
        with self._lock:
            self._pending.append(message)

    def check(self, record: dict[str, Any]) -> list[str]:
        with self._lock:
            events, self._pending = self._pending, []
        return events


def active_conditions(watches: list[Any]) -> list[str]:
    """The conditions in force now, one line each, for status.json."""
    return [watch.active for watch in watches if getattr(watch, "active", None)]
