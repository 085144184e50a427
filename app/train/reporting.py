"""A drafter rank's reporting, put together in this one place: the reporters and health watches of a
run, from its config.

On the logging rank: metrics.jsonl (unguarded: it is the run's own record, which `dflash status` and
the plots read, so failing to write it fails the run), then telemetry's status.json and wandb and, when
`storage.s3_uri` is set, the S3 sync (each guarded: a failure is a warning). Every drafter rank: the
health watches. The other drafter ranks report nothing (they would only repeat the logging rank).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from app.config import RunConfig
from app.telemetry import GuardedReporter, HealthWatch, MetricsFile, Reporter, build_telemetry
from app.telemetry.session import Telemetry


def run_telemetry(
    config: RunConfig,
    log: Callable[[str], None],
    *,
    is_logger: bool,
    reporters: Sequence[Reporter] = (),
    watches: Sequence[HealthWatch] = (),
) -> Telemetry:
    """The rank's telemetry; `reporters` and `watches` (a caller's own, a test's) join the run's."""
    found_reporters, found_watches = build_telemetry(config, rank_is_logger=is_logger)
    if not is_logger:
        return Telemetry([], [*found_watches, *watches], log)
    run_reporters: list[Reporter] = [MetricsFile(), *found_reporters]
    if config.storage.s3_uri is not None:
        from app.storage.sync import S3Sync  # boto3 and the checkpoint store load only when S3 is used

        run_reporters.append(GuardedReporter(S3Sync(config.storage, config.train.keep_last)))
    return Telemetry([*run_reporters, *reporters], [*found_watches, *watches], log)
