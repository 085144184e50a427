"""Write files so that readers see the old content or the new one, never a partial file."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write to a temp file in the same directory, fsync, then rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    write_bytes_atomic(path, text.encode())


def write_json_atomic(path: str | Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def fsync_tree(directory: str | Path) -> None:
    """Flush every file in `directory` and the directory itself (before renaming it into place)."""
    directory = Path(directory)
    for file in directory.iterdir():
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_directory(staging: str | Path, target: str | Path) -> None:
    """Rename the finished `staging` directory to `target` (same filesystem). An existing `target` is
    set aside first and deleted after, so at every moment one complete version is in place or being
    renamed, and a crash leaves at worst a hidden `.NAME.old.*` directory beside it."""
    staging, target = Path(staging), Path(target)
    if not target.exists():
        os.rename(staging, target)
        return
    retired = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
    os.rename(target, retired / target.name)
    os.rename(staging, target)
    shutil.rmtree(retired, ignore_errors=True)
