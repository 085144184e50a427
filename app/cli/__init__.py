"""The `dflash` command: one subcommand per stage of the flow.

Exit codes: 0 ok, 1 the job failed (a `JobFailed` is one line, no traceback), 2 bad usage or bad
input (a one-line message naming what).
Stage modules are imported by their subcommand only, so `dflash --help` stays fast (no torch import).
"""

from __future__ import annotations

import logging
import sys
from typing import Annotated

import typer

from app.cli import (
    bench_cmd,
    build_cache_cmd,
    config_cmd,
    datagen_cmd,
    demo_cmd,
    doctor_cmd,
    eval_cmd,
    export_cmd,
    prompts_cmd,
    pull_cmd,
    status_cmd,
    train_cmd,
)
from app.errors import JobFailed, UserError

cli = typer.Typer(
    name="dflash",
    help="Train DFlash speculative-decoding drafters reproducibly: config, doctor, train, eval, export.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _print_version(value: bool) -> None:
    if value:
        from importlib import metadata

        print(f"dflash {metadata.version('dflash-appliance')}")
        raise typer.Exit()


@cli.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """Train DFlash speculative-decoding drafters reproducibly: config, doctor, train, eval, export."""


cli.add_typer(config_cmd.group, name="config")
cli.add_typer(bench_cmd.group, name="bench")
cli.add_typer(prompts_cmd.group, name="prompts")
cli.command("datagen")(datagen_cmd.datagen)
cli.command("doctor")(doctor_cmd.doctor)
cli.command("build-cache")(build_cache_cmd.build_cache)
cli.command("train")(train_cmd.train)
cli.command("demo")(demo_cmd.demo)
cli.command("eval")(eval_cmd.evaluate)
cli.command("export")(export_cmd.export)
cli.command("status")(status_cmd.status)
cli.command("pull")(pull_cmd.pull)


class _StandardError(logging.Handler):
    """The appliance's own log records (`app.*`: the data loader's cache hits and waits) as plain
    lines on standard error, the stream of the moment (a test's capture, a redirected one)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), file=sys.stderr, flush=True)


def show_app_logs() -> None:
    """Show `app.*` log records of level INFO and above: without a handler Python drops INFO and
    prints only warnings, so the data loader's "tokenized data: cache hit at ..." never showed."""
    logger = logging.getLogger("app")
    if not any(isinstance(handler, _StandardError) for handler in logger.handlers):
        logger.addHandler(_StandardError())
    logger.setLevel(logging.INFO)
    logger.propagate = False  # a root handler a library configured would print each line twice


def main() -> None:
    """Console-script entry point: maps bad input to exit 2 with one line, never a traceback."""
    show_app_logs()
    try:
        # Without standalone mode click returns a command's `typer.Exit(code)` instead of raising it.
        exit_code = cli(standalone_mode=False)
    except UserError as error:
        print(f"dflash: error: {error}", file=sys.stderr)
        sys.exit(2)
    except JobFailed as error:
        print(f"dflash: failed: {error}", file=sys.stderr)
        sys.exit(1)
    except typer.Exit as done:
        sys.exit(done.exit_code)
    except typer.Abort:
        print("dflash: aborted", file=sys.stderr)
        sys.exit(1)
    except Exception as error:  # click usage errors carry their own exit code (2)
        import click

        # typer >= 0.29 vendors click: its usage errors derive from TyperException, not click's classes
        usage_errors = (click.ClickException, typer.exceptions.TyperException)
        if isinstance(error, usage_errors) and hasattr(error, "show"):
            error.show()
            sys.exit(error.exit_code)
        raise
    if isinstance(exit_code, int) and exit_code != 0:
        sys.exit(exit_code)
