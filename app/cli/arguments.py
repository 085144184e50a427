"""Command-line arguments that several `dflash` commands take the same way."""

from __future__ import annotations

import shlex
from typing import Annotated

import typer

from app.errors import UserError

CONFIG_FORMS = "a .toml, .yaml or .json file, or a run directory"
"""What every command's CONFIG argument accepts: what `load_config` reads."""

Overrides = Annotated[list[str] | None, typer.Argument(help="section.field=value overrides.")]
"""`section.field=value` settings applied over the config file, as `load_config` reads them."""


def require_importable_stack() -> None:
    """What a command that imports torch and transformers checks first: no locked package at a version
    that another one rejects at import (transformers' 50-line ImportError), named with its fix."""
    from app.env.preflight import require_locked_stack  # packaging and metadata only, no torch

    require_locked_stack(allow_drift=True)


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


def shell_command(words: list[str]) -> str:
    """`words` as one line a POSIX shell reads back to them, quoted for a reader: a word with single
    quotes (`data.train_files=['a.jsonl']`) in double quotes where that is safe, not shlex's `'"'"'`."""
    return " ".join(_shell_word(word) for word in words)


def _shell_word(word: str) -> str:
    quoted = shlex.quote(word)
    if quoted == word or "'" not in word or any(char in word for char in '"$`\\!'):
        return quoted
    return f'"{word}"'
