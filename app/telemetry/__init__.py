"""What a run reports: the log line, metrics.jsonl, status.json, wandb, health watches, S3 sync.

`build_telemetry(config)` returns the reporters and health watches a trainer takes; every one of them
is wrapped so that its failure is a warning, never a crashed or stalled run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from app.config import RunConfig
from app.telemetry.baseline import Baseline, baseline_from_manifest
from app.telemetry.guard import GuardedReporter, GuardedWatch, TelemetryWarning
from app.telemetry.health import (
    CompileWatch,
    Counters,
    ExternalEvents,
    MemoryWatch,
    QueueWatch,
    ThroughputWatch,
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
    baseline: Baseline | None = None,
    compile_manifest: Path | None = None,
    events: ExternalEvents | None = None,
    compile_counters: Callable[[], Counters] | None = None,
) -> tuple[list[Reporter], list[HealthWatch]]:
    """The reporters (logging rank only) and health watches of a run, each guarded.

    baseline: the expected throughput; else read from `compile_manifest` (the compile cache's manifest
        of this run's key) when given; without one, throughput is reported but not judged.
    events: where other components post health events (compile-cache load results, a recompile guard).
    compile_counters: compile/cache counters to watch and report; default torch._dynamo's.
    """
    telemetry = config.telemetry
    if baseline is None and compile_manifest is not None and compile_manifest.is_file():
        baseline = baseline_from_manifest(compile_manifest)
    compile_watch = CompileWatch(telemetry.warmup_steps, compile_counters or dynamo_counters)
    watches: list[HealthWatch] = [
        MemoryWatch(telemetry.memory_window_steps, telemetry.memory_growth_threshold, telemetry.warmup_steps),
        compile_watch,
    ]
    if baseline is not None:
        watches.append(ThroughputWatch(baseline, config.compile.slow_step_threshold, telemetry.warmup_steps))
    if config.topology.target_ranks:  # colocated runs have no queues to stall
        capacities = {"q_pre": config.topology.prefetch_batches, "q_hs": config.topology.feature_queue}
        watches.append(QueueWatch(capacities, telemetry.queue_stall_steps, telemetry.warmup_steps))
    if events is not None:
        watches.append(events)
    guarded_watches: list[HealthWatch] = [GuardedWatch(watch) for watch in watches]
    if not rank_is_logger:
        return [], guarded_watches

    def latest_counters() -> Counters:
        return compile_watch.latest

    status = StatusFile(config, watches=watches, baseline=baseline, compile_counters=latest_counters)
    reporters: list[Reporter] = [status]
    mode = resolve_wandb_mode(telemetry.wandb)
    if mode != "disabled":
        reporters.append(
            WandbReporter(
                mode, telemetry.wandb_project, telemetry.run_name, telemetry.wandb_timeout_s, latest_counters
            )
        )
    if config.storage.s3_uri is not None:
        from app.storage.sync import S3Sync  # boto3 and the checkpoint store load only when S3 is used

        sync = S3Sync(config.storage, config.train.keep_last, refresh_status=status.write)
        status.storage_state = sync.state
        reporters.append(sync)
    return [GuardedReporter(reporter) for reporter in reporters], guarded_watches
