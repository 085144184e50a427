"""Whether the process writing a run is still alive, as `dflash status` can tell it.

A run killed with SIGKILL (or by the OOM killer, or with its node) writes no exit: its status.json says
"running" for ever, and it is rewritten only every few steps, so its age says little for minutes. The
logging rank therefore keeps `heartbeat.json` beside it: who writes the run (pid, host, and the
process's start time, so that a reused pid is not taken for it), rewritten every `BEAT_S` seconds by a
thread of its own (evals, checkpoints and compiles do not stop it). A reader on the writer's host asks
the OS; anywhere else, a heartbeat older than `SILENCE_S` is a dead run.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import threading
from pathlib import Path

from app.atomic import write_json_atomic

HEARTBEAT_FILE = "heartbeat.json"
BEAT_S = 10.0
"""Seconds between heartbeats: a file rewrite, nothing a run notices."""
SILENCE_S = 30.0
"""A heartbeat this old is a dead writer (three beats missed; a loaded host may delay one)."""


class Heartbeat:
    """The writer's identity and a heartbeat in `run_dir/heartbeat.json` until `stop`."""

    def __init__(self, run_dir: Path, every_s: float = BEAT_S) -> None:
        self.path = run_dir / HEARTBEAT_FILE
        self.every_s = every_s
        self.identity = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": process_start(os.getpid()),
        }
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="dflash-heartbeat", daemon=True)

    def start(self) -> None:
        self._write()
        self._thread.start()

    def stop(self) -> None:
        """No more beats; the file goes, so a finished run never reads as a dead one."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()
        self.path.unlink(missing_ok=True)

    def _beat(self) -> None:
        while not self._stopped.wait(self.every_s):
            with contextlib.suppress(OSError):  # a full disk must not end the run (its checkpoint says so)
                self._write()

    def _write(self) -> None:
        if not self.path.parent.is_dir():  # the run directory was removed under a live writer
            self._stopped.set()
            return
        at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        write_json_atomic(self.path, {**self.identity, "at": at, "every_s": self.every_s}, durable=False)


def process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22); None without /proc
    or without the process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: the fields after it follow the last ")"
    return stat[stat.rfind(")") + 2 :].split()[19]


def writer_death(run_dir: Path, now: float) -> str | None:
    """Why the run's writer is dead, or None while it lives or when this cannot tell (a run from before
    the heartbeat, an unreadable file). `now`: the reader's clock, in seconds since the epoch."""
    try:
        beat = json.loads((run_dir / HEARTBEAT_FILE).read_text())
        pid, host, at = int(beat["pid"]), str(beat["host"]), datetime.datetime.fromisoformat(beat["at"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if host == socket.gethostname() and Path("/proc/self/stat").exists():
        started = process_start(pid)
        if started is None:
            return f"its process {pid} on {host} is gone"
        if beat.get("started") is not None and started != beat["started"]:
            return f"its process {pid} on {host} is gone (the pid now runs another process)"
        return None
    silent = now - at.timestamp()
    if silent > max(SILENCE_S, 3 * float(beat.get("every_s", BEAT_S))):
        return f"its heartbeat from {host} (pid {pid}) stopped {silent:.0f}s ago"
    return None
