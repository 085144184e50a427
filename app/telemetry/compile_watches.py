"""The health watches that come from train start's compilation: the throughput guard against the step
time `build-cache` measured, the library-JIT watch, and the problems found at start as events on the
first log line. Compile hands over plain data (`app.compile.prepare.CompileReport`); the watches,
telemetry's concern, are built here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from app.config import RunConfig
from app.telemetry.baseline import Baseline
from app.telemetry.guard import GuardedWatch
from app.telemetry.health import ExternalEvents, HealthAbort, ThroughputWatch
from app.telemetry.reporter import HealthWatch

if TYPE_CHECKING:
    from app.compile.prepare import CompileReport


def compile_watches(report: CompileReport, config: RunConfig) -> list[HealthWatch]:
    """The library-JIT watch (a baked Triton cache was loaded), the throughput guard (the cache holds a
    measured step time) and the start's problems, each guarded."""
    watches: list[HealthWatch] = []
    if report.library_jit is not None:
        abort = config.compile.on_cache_miss == "abort"
        watches.append(
            GuardedWatch(LibraryJitWatch(report.library_jit, abort=abort, source=report.library_jit_source))
        )
    if report.baseline_step_s is not None:
        watches.append(throughput_watch(report.baseline_step_s, report.baseline_source, config))
    problems = ExternalEvents()
    for problem in report.problems:
        problems.post(f"compile: {problem}")
    return [*watches, problems]


def throughput_watch(step_time_s: float, source: str, config: RunConfig) -> HealthWatch:
    """A HealthWatch raising an event when steady-state step time falls behind the baseline."""
    baseline = Baseline(step_time_s=step_time_s, source=source)
    watch = ThroughputWatch(baseline, config.compile.slow_step_threshold, config.telemetry.warmup_steps)
    return GuardedWatch(watch)


class LibraryJitAbort(HealthAbort):
    """A Triton compile after warm-up with `compile.on_cache_miss = abort`."""


class LibraryJitWatch:
    """A health watch: an event each time the job's count of library JIT after warm-up grows.

    Reads this process's count (`new_compiles`, `app.compile.library_jit.LibraryJitCounter.new`) and
    the target ranks' reported counts (`target_library_jit` of the record: one per target rank, split
    topologies)."""

    def __init__(self, new_compiles: Callable[[], int], *, abort: bool, source: str) -> None:
        self.new_compiles = new_compiles
        self.abort = abort
        self.source = source
        self.reported = 0
        self.active: str | None = None

    def check(self, record: dict[str, Any]) -> list[str]:
        total = self.new_compiles() + sum(record.get("target_library_jit") or [])
        if total <= self.reported:
            return []
        new, self.reported = total - self.reported, total
        self.active = (
            f"library JIT: {total} Triton kernel compiles or autotunings after warm-up ({new} new in this "
            f"window) although {self.source} was loaded: a target shape or library kernel the cache lacks "
            "costs seconds each; rebuild the cache with `dflash build-cache` for this config"
        )
        if self.abort:
            raise LibraryJitAbort(f"{self.active} (compile.on_cache_miss = abort)")
        return [self.active]
