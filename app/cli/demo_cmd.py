"""`dflash demo [overrides]`: the CPU demo, the README's main-job command."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from app.cli.arguments import require_importable_stack


def demo(
    overrides: Annotated[
        list[str] | None, typer.Argument(help="section.field=value overrides of configs/tiny.toml.")
    ] = None,
    prompts: Annotated[int, typer.Option(help="Conversations the tiny target regenerates.")] = 256,
) -> None:
    """Build a tiny target, regenerate data with it, train a drafter, print tau before/after and export it.

    Runs on CPU in a few minutes with nothing downloaded (the first run also builds the tiny target).
    """
    from app.cli.bars import disable_library_bars

    require_importable_stack()
    from app.demo.run import run_demo

    # The demo narrates its own steps; the libraries' bars over its tiny local files are noise there.
    disable_library_bars()
    from app.train.trainer import TrainingStopped

    try:
        run_demo(overrides=overrides or [], prompts=prompts, log=lambda line: print(line, flush=True))
    except (TrainingStopped, KeyboardInterrupt):
        # The demo has no --resume: it starts over when run again.
        print("dflash demo: stopped; run `dflash demo` again to start over", file=sys.stderr)
        raise typer.Exit(130) from None
