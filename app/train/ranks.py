"""The two roles a process runs, each set up by one function in this one layer: a drafter rank trains
(the Trainer; alone it is the colocated single-process run, under torchrun it trains its share of
each round with DDP over the drafter group); a target rank streams the frozen target's features to
the drafter ranks. `dflash train` picks the role; both raise TrainingStopped / TargetStopped on a
signal, after the state that matters is safe."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from app.checkpoint.run_dir import removed_if_left_empty
from app.compile.prepare import prepare_target_rank
from app.config import RunConfig
from app.data.batching import BatchPlanner
from app.data.identity import check_data_identity, record_data_identity
from app.data.tokenize import pad_token_id
from app.env.guard import check_environment
from app.pipeline.distributed import Runtime
from app.pipeline.inputs import load_run_inputs
from app.pipeline.target_worker import TargetWorker
from app.train.metrics import NonFiniteLoss
from app.train.resume import precheck_resume
from app.train.trainer import Trainer, TrainResult

Log = Callable[[str], None]


def run_drafter_rank(config: RunConfig, runtime: Runtime | None, resume: bool, log: Log) -> TrainResult:
    """Train the drafter on this rank (`runtime` None: the whole run in this process)."""
    is_logger = runtime is None or runtime.layout.is_logger
    if resume and is_logger:
        precheck_resume(config)  # before the data and the target load, not minutes later
    data = check_data_identity(config, resume=resume) if is_logger else None
    # the logging rank creates the run directory (the others never touch it)
    with removed_if_left_empty(config.train.output_dir) if is_logger else contextlib.nullcontext():
        trainer = Trainer(config, resume=resume, log=log, runtime=runtime)
    if data is not None:  # recorded once the start is through: a refused start leaves no record
        record_data_identity(trainer.run_dir, data, resume=trainer.resumed, log=log)
    try:
        return trainer.run()
    except NonFiniteLoss as error:  # its checkpoints settled: name the one to go on from
        raise error.resuming_from(trainer.run_dir) from None


def run_target_rank(config: RunConfig, runtime: Runtime, log: Log) -> None:
    """Run the frozen target over this rank's batches of every epoch and send their features."""
    # Its own environment, before the target loads (the run's record is the logging drafter rank's).
    check = check_environment(None, resume=False, allow_drift=config.train.allow_environment_drift)
    # Main thread, before the worker's threads exist and before the target loads: a hybrid target's
    # library Triton kernels come from the baked compile-cache entry instead of 40 s of JIT in every process.
    entry = prepare_target_rank(config, runtime.device, log)
    inputs = load_run_inputs(config, runtime, fingerprint=check.fingerprint)
    for line in inputs.accepted:
        log(f"warning: DEGRADED target rank: {line}")
    assert inputs.train_data is not None and inputs.target is not None
    planner = BatchPlanner.from_config(inputs.train_data.lengths, config.data, config.train.seed)
    TargetWorker(
        config,
        runtime,
        inputs.train_data,
        inputs.target,
        planner,
        pad_token_id(inputs.tokenizer),
        log,
        cache_loaded=entry is not None,
    ).run()
