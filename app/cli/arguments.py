"""Command-line arguments that several `dflash` commands take the same way."""

from __future__ import annotations

from typing import Annotated

import typer

Overrides = Annotated[list[str] | None, typer.Argument(help="section.field=value overrides.")]
"""`section.field=value` settings applied over the config file, as `load_config` reads them."""
