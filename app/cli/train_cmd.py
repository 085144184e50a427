"""`dflash train CONFIG [overrides] [--resume]`: train a drafter (colocated, or under torchrun)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer


def train(
    config: Annotated[str, typer.Argument(help="Run config (.toml or .yaml).")],
    overrides: Annotated[list[str] | None, typer.Argument(help="section.field=value overrides.")] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue from the run directory's latest good checkpoint.")
    ] = False,
) -> None:
    """Train the drafter: epochs exactly as configured, checkpoints in train.output_dir.

    SIGTERM or Ctrl-C checkpoints after the current step and exits 143; `--resume` continues exactly.
    """
    from app.config import load_config
    from app.train.trainer import Trainer, TrainingStopped

    run_config = load_config(config, overrides or [])
    try:
        Trainer(run_config, resume=resume, log=lambda line: print(line, flush=True)).run()
    except TrainingStopped as stopped:
        print(f"dflash: {stopped}", file=sys.stderr)
        raise typer.Exit(143) from None
