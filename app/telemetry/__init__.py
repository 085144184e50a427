"""What a run reports: the log line, metrics.jsonl, status.json, wandb, health watches.

`build_telemetry(config)` returns telemetry's reporters and health watches; every one of them is
wrapped so that its failure is a warning, never a crashed or stalled run. A run's whole list (with
metrics.jsonl and the S3 sync of app.storage) is put together in one place,
`app.train.reporting.run_telemetry`.
"""

from __future__ import annotations

from app.config import RunConfig
from app.telemetry.baseline import Baseline
from app.telemetry.guard import GuardedReporter, GuardedWatch, TelemetryWarning
from app.telemetry.health import (
    CompileWatch,
    Counters,
    ExternalEvents,
    MemoryWatch,
    QueueWatch,
    dynamo_counters,
)
from app.telemetry.reporter import HealthWatch, MetricsFile, Reporter
from app.telemetry.status import StatusFile
from app.telemetry.wandb_sink import WandbReporter, resolve_wandb_mode

__all__ = [
    "Baseline",
    "ExternalEvents",
    "GuardedReporter",
    "GuardedWatch",
    "HealthWatch",
    "MetricsFile",
    "Reporter",
    "TelemetryWarning",
    "build_telemetry",
]


def build_telemetry(
    config: RunConfig,
    *,
    rank_is_logger: bool = True,
) -> tuple[list[Reporter], list[HealthWatch]]:
    """The reporters (logging rank only) and health watches of a run, each guarded.

    The throughput baseline and the compile-cache problems come later, from the trainer's compile
    report (its watches, and `Reporter.on_start`).
    """
    telemetry = config.telemetry
    compile_watch = CompileWatch(telemetry.warmup_steps, dynamo_counters)
    watches: list[HealthWatch] = [
        MemoryWatch(telemetry.memory_window_steps, telemetry.memory_growth_threshold, telemetry.warmup_steps),
        compile_watch,
    ]
    if config.topology.target_ranks:  # colocated runs have no queues to stall
        capacities = {"q_pre": config.topology.prefetch_batches, "q_hs": config.topology.feature_queue}
        watches.append(QueueWatch(capacities, telemetry.queue_stall_steps, telemetry.warmup_steps))
    guarded_watches: list[HealthWatch] = [GuardedWatch(watch) for watch in watches]
    if not rank_is_logger:
        return [], guarded_watches

    def latest_counters() -> Counters:
        return compile_watch.latest

    status = StatusFile(config, watches=watches, compile_counters=latest_counters)
    reporters: list[Reporter] = [status]
    mode = resolve_wandb_mode(telemetry.wandb)
    if mode != "disabled":
        reporters.append(
            WandbReporter(
                mode, telemetry.wandb_project, telemetry.run_name, telemetry.wandb_timeout_s, latest_counters
            )
        )
    return [GuardedReporter(reporter) for reporter in reporters], guarded_watches
