"""Command-line arguments that several `dflash` commands take the same way."""

from __future__ import annotations

from typing import Annotated

import typer

from app.errors import UserError

CONFIG_FORMS = "a .toml, .yaml or .json file, or a run directory"
"""What every command's CONFIG argument accepts: what `load_config` reads."""

Overrides = Annotated[list[str] | None, typer.Argument(help="section.field=value overrides.")]
"""`section.field=value` settings applied over the config file, as `load_config` reads them."""


def int_list(text: str, option: str, minimum: int) -> list[int]:
    """`"16,64,256"` -> [16, 64, 256]; a one-line error naming `option` unless every item is an
    integer >= `minimum`."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or any(value < minimum for value in values):
        raise UserError(f"{option}: expected integers >= {minimum} separated by commas, got {text!r}")
    return values
