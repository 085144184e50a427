"""Where the appliance keeps machine-local state: the built-in tiny target, tokenized data and the
inductor cache live under one root, `$DFLASH_CACHE` (the image sets it), else `~/.cache/dflash`.
Also the names of run-directory files that one stage writes and another reads."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("DFLASH_CACHE") or Path.home() / ".cache" / "dflash").expanduser()


STORAGE_STATE_FILE = "storage.json"
"""A run dir's S3 sync state: written by the sync (app.storage), shown by `dflash status` (app.telemetry)."""
