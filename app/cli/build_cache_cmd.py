"""`dflash build-cache CONFIG [overrides]`: bake the compile cache of a run config on this GPU model."""

from __future__ import annotations

from typing import Annotated

import typer

from app.cli.arguments import CONFIG_FORMS, Overrides, require_importable_stack


def build_cache(
    config: Annotated[str, typer.Argument(help=f"Run config ({CONFIG_FORMS}) whose shapes to compile.")],
    overrides: Overrides = None,
    force: Annotated[
        bool, typer.Option("--force", help="Rebuild even when a matching, intact cache exists.")
    ] = False,
) -> None:
    """Compile what a training step compiles (drafter fwd+bwd with flex_attention, loss) and save it to compile_cache/<key>/.

    Run once per GPU model, torch build and config shape; `dflash train` loads the matching cache at
    start and verifies it by counters. A matching cache makes this a fast no-op.
    """
    require_importable_stack()
    from app.compile.build import build_cache as build  # torch loads only for this command
    from app.config import load_config
    from app.train.step import DrafterStep

    build(
        load_config(config, overrides or []),
        DrafterStep,
        force=force,
        log=lambda line: print(line, flush=True),
    )
