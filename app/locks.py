"""Cross-process locks, one idiom for every writer that must be alone: filelock's native lock with a
timeout, its lock file holding who took it (pid, host, command), so a process that waits or is
refused can say who it waits for instead of hanging silently or naming nobody."""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from filelock import FileLock, Timeout

log = logging.getLogger(__name__)

WAIT_LOG_AFTER_S = 2.0
"""A wait for another holder is silent this long, then logged once naming the holder."""


class LockBusy(Exception):
    """The lock was held by another process for longer than the caller would wait."""

    def __init__(self, path: Path, holder_text: str) -> None:
        super().__init__(f"{path} is held by {holder_text}")
        self.path = path
        self.holder = holder_text


def holder(path: str | Path) -> str:
    """Who holds (or last held) the lock file `path`, as its holder wrote it; 'another process' when
    the file is gone or empty (a holder of an older version, or one between taking and writing)."""
    try:
        text = Path(path).read_text(errors="replace").strip()
    except OSError:
        text = ""
    return text or "another process"


def _write_holder(descriptor: int) -> None:
    command = shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv and sys.argv[0] else "python"
    text = f"pid {os.getpid()} on {socket.gethostname()} ({command})\n"
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, text.encode(errors="replace"), 0)


@contextlib.contextmanager
def held(
    path: str | Path, *, wait_s: float | None = None, waiting: Callable[[str], None] | None = None
) -> Iterator[None]:
    """Hold the lock file `path` for the block.

    `wait_s`: None waits as long as it takes (after WAIT_LOG_AFTER_S, `waiting` hears who holds it,
    by default a log warning); 0 refuses at once; more waits that long. A refusal raises LockBusy
    naming the holder."""
    path = Path(path)
    lock = FileLock(path, on_acquired=_write_holder, is_singleton=False, thread_local=False)
    try:
        lock.acquire(timeout=WAIT_LOG_AFTER_S if wait_s is None else wait_s)
    except Timeout:
        if wait_s is not None:
            raise LockBusy(path, holder(path)) from None
        (waiting or _log_wait)(f"waiting for {path}, held by {holder(path)}")
        lock.acquire(timeout=-1)
    try:
        yield
    finally:
        lock.release()


def _log_wait(message: str) -> None:
    log.warning("%s", message)
