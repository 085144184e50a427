"""`dflash train CONFIG [overrides] [--resume]`: train a drafter (colocated, or under torchrun).

Under torchrun each rank takes its role from `topology`: drafter ranks run the trainer (DDP over
the drafter group), target ranks run the frozen target and stream features. A rank that raises
records its failure in the rendezvous store before exiting, so every other rank's watchdog brings
the job down within seconds naming it (and torchrun's summary names it too).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Annotated

import typer

from app.cli.arguments import CONFIG_FORMS, Overrides

STOPPED_EXIT_CODE = 143
"""128 + SIGTERM: stopped by a signal after checkpointing; `--resume` continues exactly."""
FOLLOWER_EXIT_DELAY_S = 2.0
"""How long a rank that fails because another one did waits before exiting (torchrun polls every 0.1 s)."""


def train(
    config: Annotated[str, typer.Argument(help=f"Run config: {CONFIG_FORMS}.")],
    overrides: Overrides = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue from the run directory's latest good checkpoint.")
    ] = False,
) -> None:
    """Train the drafter: epochs exactly as configured, checkpoints in train.output_dir.

    SIGTERM or Ctrl-C checkpoints after the current step and exits 143; `--resume` continues exactly.
    Multi-GPU topologies (topology.*) run under torchrun, one process per GPU (entrypoint.sh train).
    """
    from app.checkpoint.run_dir import require_own_directory, require_run_to_resume, require_writable
    from app.config import load_config, require_builtin_packages
    from app.data.identity import check_data_identity
    from app.data.sources import require_records
    from app.env.preflight import require_locked_stack
    from app.paths import writable_cache_root
    from app.pipeline.roles import require_launch_matching, torchrun_variables

    run_config = load_config(config, overrides or [])
    # Before torch loads (seconds on an idle machine, far longer on a loaded node), a rendezvous is
    # joined or a run directory is touched, each of these is one line: a missing group, the stack (an
    # off-lock version, an edited lock, a degrading compiler variable), torchrun variables that are no
    # integer or set outside torchrun, a cache root that cannot be written, an output directory that
    # cannot be written, training data that is missing or blank, a resume of no run or on changed data.
    require_builtin_packages(run_config.target.builtin)
    require_locked_stack(allow_drift=run_config.train.allow_environment_drift)
    torchrun_variables()
    require_launch_matching(run_config.topology)
    writable_cache_root()
    if resume:
        require_run_to_resume(run_config.train.output_dir)
    else:
        require_own_directory(run_config.train.output_dir)
    if run_config.topology.nnodes * run_config.topology.nproc_per_node == 1:
        # one process (under torchrun the logging rank probes it once torch has loaded, and the
        # tokenized cache refuses in one line when it is built: ranks creating and removing one probe
        # file at once would race)
        require_writable(run_config.train.output_dir, keep=False)
        if run_config.data.cache_dir:
            require_writable(run_config.data.cache_dir, keep=True, setting="data.cache_dir")
    require_records(run_config.data.train_files)
    if resume:
        check_data_identity(run_config, resume=True)
    from app.cli.bars import library_bars_only_on_a_tty
    from app.pipeline.distributed import wants_distributed

    library_bars_only_on_a_tty()

    if wants_distributed(run_config):
        _train_rank(run_config, resume)
        return
    from app import api

    try:
        api.train(run_config, resume=resume, log=_print)
    except api.TrainingStopped as stopped:
        print(f"dflash: {stopped}", file=sys.stderr)
        raise typer.Exit(STOPPED_EXIT_CODE) from None


def _train_rank(run_config, resume: bool) -> None:
    """One torchrun rank: join the job, run this rank's role, report a failure to the other ranks.

    A rank that did not finish cleanly (stopped by a signal, or failed) exits with `os._exit` once it
    has said why: a receive still pending in a blocked transport thread would otherwise hold the
    interpreter's teardown of the process groups for many seconds.

    Only the job's first failure writes torchrun's error file. torchrun's summary names as root cause
    the failure it dates earliest, to the second: an error file is dated when its rank raised, a rank
    without one when the agent saw it exit. A rank that fails because another did raises after that
    one's failure, but a killed rank leaves no file and is dated when the agent polls it, so a follower's
    file could date it earlier (the flaky "root cause: drafter 1" of a killed target). Without files,
    followers are dated when the agent stops them, after the rank that failed first.
    """
    import traceback

    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    from app.errors import JobFailed, UserError
    from app.pipeline.distributed import start_runtime

    runtime = start_runtime(run_config, _print)

    def log(line: str) -> None:
        _print(line if runtime.layout.is_logger else f"[{runtime.layout.name}] {line}")

    error_file = get_error_handler()  # torchrun's error file of this rank (and faulthandler on)
    error_file.initialize()
    exit_code = 0
    try:
        stopped = _run_role(run_config, runtime, resume, log)
        if stopped is not None:
            log(f"dflash: {stopped}")
            exit_code = STOPPED_EXIT_CODE
    except UserError as error:
        if _report_failure(runtime, error):
            error_file.record_exception(error)
        print(f"dflash: error: {error}", file=sys.stderr)
        exit_code = 2
    except BaseException as error:
        if _report_failure(runtime, error):
            error_file.record_exception(error)
            if not isinstance(error, JobFailed):  # its line, printed above, says all of it
                traceback.print_exc()  # the job's first failure: its traceback is the one worth reading
        else:
            time.sleep(FOLLOWER_EXIT_DELAY_S)  # let the agent see the first failure's rank exit first
        exit_code = 1
    finally:
        runtime.close(clean=exit_code == 0)
    if exit_code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)


def _report_failure(runtime, error: BaseException) -> bool:
    """Record the job's first failure in the store (every watchdog reads it) and say who failed.

    Returns True when this rank's failure is the job's first (not a consequence of another's). An
    error that only says a peer of a collective left (`lost_a_peer`) is never the first: a drafter in
    DDP's all-reduce sees a reset when another drafter exits, and could record it before the rank that
    saw the real cause (a killed target) does; it waits for that record, and writes no error file.
    """
    from app.pipeline.distributed import lost_a_peer
    from app.pipeline.roles import describe_rank

    layout = runtime.layout
    cause = f"{type(error).__name__}: {_first_line(error)}"
    peer = getattr(error, "peer_rank", None)  # a transport error caused by a lost peer blames the peer
    unnamed_peer = peer is None and lost_a_peer(error)
    if unnamed_peer:  # the rank that saw why the peer left (or the watchdog) records it in the meantime
        runtime.side.wait_failure(FOLLOWER_EXIT_DELAY_S)
    blamed = peer if peer is not None else layout.rank
    first = runtime.side.post_failure(blamed, cause if blamed == layout.rank else f"lost ({cause})")
    if first["rank"] == layout.rank and unnamed_peer:
        _print(f"dflash: {layout.name} stops: a peer left the job ({cause})")
        return False  # no error file: torchrun then names the rank that left, by when it exited
    if first["rank"] == layout.rank:
        _print(f"dflash: {layout.name} failed: {cause}")
        return True
    culprit = describe_rank(layout, first["rank"])
    _print(f"dflash: {layout.name} stops ({cause}) because {culprit} failed first: {first['cause']}")
    return False


def _run_role(run_config, runtime, resume: bool, log) -> Exception | None:
    """This rank's role to the end; returns the stop (a signal, checkpointed) rather than raising it,
    so that torchrun does not record a graceful stop as the rank's error."""
    from app.pipeline.target_worker import TargetStopped
    from app.train.ranks import run_drafter_rank, run_target_rank
    from app.train.trainer import TrainingStopped

    try:
        if runtime.layout.trains:
            run_drafter_rank(run_config, runtime, resume, log)
        else:
            run_target_rank(run_config, runtime, log)
    except (TrainingStopped, TargetStopped) as stopped:
        return stopped
    return None


def _print(line: str) -> None:
    print(line, flush=True)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
