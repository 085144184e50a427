"""`dflash datagen CONFIG [overrides]`: regenerate the training conversations with the served target."""

from __future__ import annotations

import shlex
from typing import Annotated

import typer

from app.cli.arguments import Overrides
from app.config import load_config


def datagen(
    config: Annotated[str, typer.Argument(help="Config file (.toml or .yaml); its datagen section is used.")],
    overrides: Overrides = None,
) -> None:
    """Send every prompt to the OpenAI-compatible servers and write the target's answers as parquet shards.

    Resumable: rerun the same command after an interruption; completed records are skipped and
    earlier failures are retried.
    """
    from app.datagen import run_datagen  # imported here so that `dflash --help` stays fast

    run_config = load_config(config, overrides or [])
    report = run_datagen(run_config.datagen)
    for line in report.summary():
        print(line, flush=True)
    if report.stopped_by:
        command = shlex.join(["dflash", "datagen", config, *(overrides or [])])
        print(f"datagen: to resume: {command}", flush=True)
    raise typer.Exit(report.exit_code)
