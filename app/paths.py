"""Where the appliance keeps machine-local state: the built-in tiny target, tokenized data and the
inductor cache live under one root, `$DFLASH_CACHE` (the image sets it), else `~/.cache/dflash`."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("DFLASH_CACHE") or Path.home() / ".cache" / "dflash").expanduser()
