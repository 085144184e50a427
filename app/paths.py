"""Where the appliance keeps machine-local state: the built-in tiny target, tokenized data and the
inductor cache live under one root, `$DFLASH_CACHE` (the image sets it), else `~/.cache/dflash`.
Also the names of run-directory files that one stage writes and another reads."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from app.errors import UserError


def cache_root() -> Path:
    """The cache root; a UserError when it, or a directory above it, is a regular file (every later
    mkdir under it would fail with the OS's words, which do not say which setting is wrong)."""
    root = _configured_root()
    blocking = next((path for path in (root, *root.parents) if path.exists() and not path.is_dir()), None)
    if blocking is not None:
        where = "it" if blocking == root else str(blocking)
        raise UserError(
            f"{cache_setting()}: {where} is a file, not a directory; point DFLASH_CACHE at a directory"
        )
    return root


def _configured_root() -> Path:
    return Path(os.environ.get("DFLASH_CACHE") or Path.home() / ".cache" / "dflash").expanduser()


def cache_setting() -> str:
    """The setting that chose the cache root, as an error names it."""
    variable = os.environ.get("DFLASH_CACHE")
    return (
        f"DFLASH_CACHE={variable}" if variable else f"the cache root {_configured_root()} (set DFLASH_CACHE)"
    )


def make_cache_dir(directory: Path) -> Path:
    """Create `directory` (under the cache root) and check it takes a file: on a read-only file system
    or without permission, a UserError naming the setting, not the OS's traceback from deep inside."""
    try:
        create_writable(directory)
    except OSError as error:
        raise UserError(
            f"{cache_setting()}: cannot create or write {directory} ({error.strerror or error}); "
            "point DFLASH_CACHE at a writable directory"
        ) from None
    return directory


def create_writable(directory: Path) -> None:
    """Create `directory` and write and remove a probe file in it; the OS's error where either fails
    (a read-only file system, no permission: the directory may exist and still refuse files)."""
    directory.mkdir(parents=True, exist_ok=True)
    handle, probe = tempfile.mkstemp(prefix=".write-probe-", dir=directory)  # its own name: threads and
    os.close(handle)  # processes probing the same directory at once never remove each other's probe
    os.unlink(probe)


def writable_cache_root() -> Path:
    """The cache root, created and checked writable (before anything heavy loads)."""
    return make_cache_dir(cache_root())


STORAGE_STATE_FILE = "storage.json"
"""A run dir's S3 sync state: written by the sync (app.storage), shown by `dflash status` (app.telemetry)."""
