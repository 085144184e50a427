"""Where the appliance keeps machine-local state: the built-in tiny target, tokenized data and the
inductor cache live under one root, `$DFLASH_CACHE` (the image sets it), else `~/.cache/dflash`.
Also the names of run-directory files that one stage writes and another reads."""

from __future__ import annotations

import os
from pathlib import Path

from app.errors import UserError


def cache_root() -> Path:
    """The cache root; a UserError when it, or a directory above it, is a regular file (every later
    mkdir under it would fail with the OS's words, which do not say which setting is wrong)."""
    variable = os.environ.get("DFLASH_CACHE")
    root = Path(variable or Path.home() / ".cache" / "dflash").expanduser()
    blocking = next((path for path in (root, *root.parents) if path.exists() and not path.is_dir()), None)
    if blocking is not None:
        setting = f"DFLASH_CACHE={variable}" if variable else f"the cache root {root} (set DFLASH_CACHE)"
        where = "it" if blocking == root else str(blocking)
        raise UserError(f"{setting}: {where} is a file, not a directory; point DFLASH_CACHE at a directory")
    return root


STORAGE_STATE_FILE = "storage.json"
"""A run dir's S3 sync state: written by the sync (app.storage), shown by `dflash status` (app.telemetry)."""
