"""The appliance from Python (a notebook, another tool): the `dflash` commands without the command line.

Each function is the one its command runs, so a run started here is a run like any other: the same
checks, the same run directory (checkpoints, metrics.jsonl, status.json), `dflash status` and
`--resume` work on it. Bad input raises `UserError` (the command's exit 2) with the same one line.

    from app import api

    config = api.load_config("configs/tiny.toml", ["train.max_steps=40"])
    trained = api.train(config)                        # TrainResult: run_dir, steps, losses, checkpoint
    print(api.evaluate(trained.run_dir).tau)           # `dflash eval RUN_DIR`
    api.export(trained.run_dir, "runs/demo/export")    # `dflash export RUN_DIR --out DIR`

A topology of several processes (topology.nproc_per_node x nnodes > 1) runs under torchrun, one
process per GPU: `dflash train` there, not this module.
"""

from __future__ import annotations

from collections.abc import Callable

from app.config import RunConfig, load_config, require_builtin_packages
from app.errors import UserError
from app.evaluate.trained import TrainedEvaluation
from app.evaluate.trained import evaluate_trained as evaluate
from app.export.trained import TrainedExport
from app.export.trained import export_trained as export
from app.train.trainer import TrainingStopped, TrainResult

__all__ = [
    "RunConfig",
    "TrainResult",
    "TrainedEvaluation",
    "TrainedExport",
    "TrainingStopped",
    "UserError",
    "evaluate",
    "export",
    "load_config",
    "train",
]


def train(config: RunConfig, *, resume: bool = False, log: Callable[[str], None] = print) -> TrainResult:
    """Train in this process into `train.output_dir` (`dflash train CONFIG [--resume]`), logging each
    line to `log`. SIGTERM or Ctrl-C checkpoint and raise TrainingStopped; `resume=True` continues."""
    from app.pipeline.distributed import wants_distributed
    from app.pipeline.roles import layout_from_environment
    from app.train.ranks import run_drafter_rank

    if wants_distributed(config):
        topology = config.topology
        raise UserError(
            f"topology: {topology.nnodes * topology.nproc_per_node} processes configured; they run under "
            "torchrun, one per GPU: `dflash train` (docs/guide.md, Train)"
        )
    # under a torchrun of several processes, every one would train alone into the same run directory
    layout_from_environment(config.topology)
    require_builtin_packages(config.target.builtin)  # before the run directory or any model
    return run_drafter_rank(config, None, resume, log)
