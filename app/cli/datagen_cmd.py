"""`dflash datagen CONFIG [overrides]`: regenerate the training conversations with the served target."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from app.cli.arguments import CONFIG_FORMS, Overrides, require_importable_stack, shell_command
from app.cli.bars import library_bars_only_on_a_tty
from app.config import load_config


def datagen(
    config: Annotated[str, typer.Argument(help=f"Run config ({CONFIG_FORMS}); its datagen section is used.")],
    overrides: Overrides = None,
) -> None:
    """Regenerate the prompts' answers with the target, written as parquet shards.

    Every prompt goes to the OpenAI-compatible servers, or with datagen.engine=local to the run's own
    target in this process.

    Resumable: rerun the same command after an interruption; completed records are skipped and
    earlier failures are retried.
    """
    run_config = load_config(config, overrides or [])
    require_importable_stack()
    library_bars_only_on_a_tty()
    if run_config.datagen.engine == "local":
        from app.datagen.local import run_local_datagen  # imported here so that `dflash --help` stays fast

        report = run_local_datagen(run_config)
    else:
        from app.datagen import run_datagen

        report = run_datagen(run_config.datagen)
    try:
        for line in report.summary():
            print(line, flush=True)
        if report.stopped_by:
            command = shell_command(["dflash", "datagen", config, *(overrides or [])])
            print(f"datagen: to resume: {command}", flush=True)
    except OSError:
        # the terminal is gone (closed window: SIGHUP, then EIO): the records are committed and the
        # exit code still tells; unwritable output must not turn it into a traceback (or the 120 of
        # a failed flush at interpreter exit)
        _discard_output()
    raise typer.Exit(report.exit_code)


def _discard_output() -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        os.dup2(devnull, stream.fileno())
    os.close(devnull)
