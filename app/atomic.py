"""Write files so that readers see the old content or the new one, never a partial file; and, where
the write is durable, so that a power loss cannot undo it: the file is flushed before its rename and
the directory holding the new name after it (a rename lives in its directory's data until that is
flushed).

Temp files and staging directories get the modes a plain `open`/`mkdir` would give under the
process umask, not tempfile's private 0600/0700: exports, checkpoints and status files are read by
other users (a serving container, a teammate's `dflash status`), and a rename keeps the mode.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any


def write_bytes_atomic(path: str | Path, data: bytes, *, durable: bool = True) -> None:
    """Write to a temp file in the same directory, fsync, then rename over `path`. `durable=False`
    skips the fsync, for files a crash may lose but must never leave half-written (a cache's)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~process_umask())
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        replace_file(temp, path, durable=durable)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def replace_file(temp: str | Path, path: str | Path, *, durable: bool = True) -> None:
    """Rename the finished file `temp` over `path` (same directory); durable: `temp` flushed first and
    the directory after, so that neither the content nor the rename can be lost to a power cut."""
    if durable:
        with open(temp, "rb") as handle:
            os.fsync(handle.fileno())
    os.replace(temp, path)
    if durable:
        fsync_directory(Path(path).parent)


def fsync_directory(directory: str | Path) -> None:
    """Flush a directory's entries (the renames and creations in it)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file's content, hex."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


TEMP_FILE = re.compile(r"^\..+\.[A-Za-z0-9_]{8}\.tmp$")
"""The name `write_bytes_atomic` writes a file under before its rename (tempfile's 8 random characters)."""


def remove_abandoned_temp_files(directory: str | Path) -> None:
    """Delete the temp files that writers killed before their rename left in `directory` (not below
    it). Only for a directory whose one writer is the caller, at its start (a run's directory)."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for path in directory.iterdir():
        if TEMP_FILE.match(path.name) and path.is_file():
            path.unlink(missing_ok=True)


def write_text_atomic(path: str | Path, text: str, *, durable: bool = True) -> None:
    write_bytes_atomic(path, text.encode(), durable=durable)


def write_json_atomic(path: str | Path, data: Any, *, durable: bool = True) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n", durable=durable)


def staging_directory(target: str | Path) -> Path:
    """A new hidden directory beside `target` to build it in, then `replace_directory` it into place
    (same filesystem, so the rename is atomic); its mode is a plain mkdir's."""
    target = Path(target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    staging.chmod(0o777 & ~process_umask())
    return staging


def process_umask() -> int:
    """The umask, read without setting it (os.umask sets it, racing with other threads' file creation)."""
    try:
        found = re.search(r"^Umask:\s+([0-7]+)$", Path("/proc/self/status").read_text(), re.MULTILINE)
    except OSError:
        found = None
    if found:
        return int(found.group(1), 8)
    current = os.umask(0o022)  # no /proc (macOS): read it by setting it back at once
    os.umask(current)
    return current


def _open_to_umask(tree: Path) -> None:
    """Give every entry of `tree` the mode a plain mkdir/open gives (exec bits kept): some writers
    (safetensors, tempfile) create private 0600 files, which other users could not read."""
    umask = process_umask()
    for path in [tree, *tree.rglob("*")]:
        if path.is_symlink():
            continue
        executable = path.is_dir() or path.stat().st_mode & 0o111
        path.chmod((0o777 if executable else 0o666) & ~umask)


def fsync_tree(directory: str | Path) -> None:
    """Flush every file in `directory` and the directory itself (before renaming it into place)."""
    directory = Path(directory)
    for file in directory.iterdir():
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
    fsync_directory(directory)


def replace_directory(staging: str | Path, target: str | Path) -> None:
    """Rename the finished `staging` directory to `target` (same filesystem), its entries opened to
    the modes the umask gives. An existing `target` is set aside first and deleted after, so at
    every moment one complete version is in place or being renamed, and a crash leaves at worst a
    hidden `.NAME.old.*` directory beside it."""
    staging, target = Path(staging), Path(target)
    _open_to_umask(staging)
    if not target.exists():
        os.rename(staging, target)
        fsync_directory(target.parent)
        return
    retired = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
    os.rename(target, retired / target.name)
    try:
        os.rename(staging, target)
    except OSError:
        os.rename(retired / target.name, target)  # the old version goes back: never neither
        retired.rmdir()
        raise
    fsync_directory(target.parent)
    shutil.rmtree(retired, ignore_errors=True)


def publish_directory(staging: str | Path, target: str | Path) -> bool:
    """Rename the finished `staging` directory to `target` unless a complete `target` is there already
    (another process, say on another node sharing the directory, built it first: the first complete
    build wins and `staging` is removed). True when this call published it."""
    staging, target = Path(staging), Path(target)
    _open_to_umask(staging)
    try:
        os.rename(staging, target)  # fails on a non-empty target: never replaces a finished build
    except OSError:
        if not target.is_dir():
            raise
        shutil.rmtree(staging, ignore_errors=True)
        return False
    fsync_directory(target.parent)
    return True
