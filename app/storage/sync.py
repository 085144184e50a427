"""Mirror a run directory to `storage.s3_uri` from a background thread: a step never waits on the network.

The trainer hands over each complete checkpoint; the sync thread uploads the newest one pending (an
older one still queued is superseded), then the run files. A failed round (server down, no credentials)
is retried at the next checkpoint or after `storage.retry_interval_s`, sending only what is missing;
nothing partial is ever visible to a reader (see app.storage.remote for the upload order).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from app.atomic import write_json_atomic
from app.checkpoint.store import MANIFEST
from app.config.schema import StorageConfig
from app.paths import STORAGE_STATE_FILE
from app.storage.remote import RemoteRun
from app.storage.s3 import StorageError, describe_error, make_client, parse_s3_uri
from app.telemetry.guard import warn
from app.telemetry.reporter import RunStart
from app.telemetry.status import now_iso

CLOSING_RETRY_S = 10.0
"""Retry interval while the run exits and the last checkpoint is not up yet."""


def open_remote(storage: StorageConfig) -> RemoteRun:
    assert storage.s3_uri is not None, "storage.s3_uri is not set"
    client = make_client(storage.endpoint_url, storage.max_retries)
    return RemoteRun(client, parse_s3_uri(storage.s3_uri), storage.multipart_chunk_mb)


def upload_export(storage: StorageConfig, export_dir: Path) -> None:
    """Upload one export directory to `exports/<its name>/` and wait for it (for `dflash export`)."""
    remote = open_remote(storage)
    try:
        remote.upload_export(export_dir)
    except StorageError:
        raise
    except Exception as error:
        raise StorageError(f"uploading {export_dir} to {remote.location}: {describe_error(error)}") from None


class S3Sync:
    """A reporter that mirrors checkpoints and run files to S3."""

    def __init__(self, storage: StorageConfig, keep_last: int) -> None:
        assert storage.s3_uri is not None, "S3Sync needs storage.s3_uri"
        self.storage = storage
        self.location = parse_s3_uri(storage.s3_uri)
        self.keep_last = keep_last
        self.run_dir: Path | None = None
        self._remote: RemoteRun | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._thread: threading.Thread | None = None
        self._pending_checkpoint: Path | None = None
        self._closing = False
        self._synced: dict[str, Any] | None = None
        self._last_error: str | None = None
        self._failed_rounds = 0

    # ---- reporter -----------------------------------------------------------------------------------

    def on_start(self, start: RunStart) -> None:
        self.run_dir = start.run_dir
        self._thread = threading.Thread(target=self._work, name="s3-sync", daemon=True)
        self._thread.start()
        self._wake.set()  # the first round sends the run files: an early warning when S3 is unreachable

    def on_log(self, record: dict[str, Any]) -> None:
        pass  # status.json and metrics.jsonl travel with every round

    def on_checkpoint(self, path: Path, step: int) -> None:
        with self._lock:
            self._pending_checkpoint = path
        self._wake.set()

    def on_exit(self, reason: str, step: int) -> None:
        """Give the last checkpoint `storage.exit_timeout_s` to reach S3; the local run is complete anyway."""
        with self._lock:
            self._closing = True
        self._wake.set()
        if self._thread is None:
            return
        self._thread.join(self.storage.exit_timeout_s)
        if self._thread.is_alive():
            with self._lock:
                pending = self._pending_checkpoint.name if self._pending_checkpoint else "the run files"
                error = self._last_error or "still uploading"
            warn(
                f"S3 sync: {pending} not uploaded to {self.location} within storage.exit_timeout_s="
                f"{self.storage.exit_timeout_s:g}s ({error}); the remote keeps its last complete checkpoint"
            )

    # ---- for callers --------------------------------------------------------------------------------

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until a round has ended with nothing left to upload; False on timeout."""
        return self._idle.wait(timeout_s)

    def state(self) -> dict[str, Any]:
        """For status.json: the remote, the last synced checkpoint, what is pending, the last error."""
        with self._lock:
            pending = [self._pending_checkpoint.name] if self._pending_checkpoint else []
            return {
                "s3_uri": str(self.location),
                "synced_checkpoint": self._synced,
                "pending": pending,
                "last_error": self._last_error,
                "failed_rounds": self._failed_rounds,
            }

    # ---- the sync thread ----------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._lock:
                failing, closing = self._last_error is not None, self._closing
            retry_in = (CLOSING_RETRY_S if closing else self.storage.retry_interval_s) if failing else None
            self._wake.wait(retry_in)
            self._wake.clear()
            self._idle.clear()
            with self._lock:
                closing = self._closing  # read before the round
            ok = self._round(closing)
            with self._lock:
                done = ok and self._pending_checkpoint is None
            if done:
                self._idle.set()
                if closing:
                    return

    def _round(self, closing: bool) -> bool:
        with self._lock:
            checkpoint = self._pending_checkpoint
        try:
            if self._remote is None:
                self._remote = open_remote(self.storage)
            if checkpoint is not None:
                self._sync_checkpoint(self._remote, checkpoint)
            self._write_state()  # before the run files go: the remote copy says what it holds
            assert self.run_dir is not None
            self._remote.upload_run_files(self.run_dir)
        except Exception as error:  # a failed round must not end the thread: the next one retries
            self._remote = None  # a fresh client next round: it picks up credentials that appeared meanwhile
            described = describe_error(error)
            # Warned before the failure is counted: whoever sees the count has been warned.
            warn(
                f"S3 sync to {self.location} failed ({described}); retrying at the next checkpoint "
                f"or in {CLOSING_RETRY_S if closing else self.storage.retry_interval_s:g}s"
            )
            with self._lock:
                self._last_error = described
                self._failed_rounds += 1
            self._write_state()
            return False
        with self._lock:
            self._last_error = None
        return True

    def _write_state(self) -> None:
        """`storage.json` in the run dir: what `dflash status` shows of the sync (its own file, so the
        status reporter and this one never call each other)."""
        if self.run_dir is not None:
            write_json_atomic(self.run_dir / STORAGE_STATE_FILE, self.state())

    def _sync_checkpoint(self, remote: RemoteRun, checkpoint: Path) -> None:
        # Without a manifest it was pruned locally (keep_last) before its turn; a newer one supersedes it.
        if (checkpoint / MANIFEST).is_file():
            manifest = remote.upload_checkpoint(checkpoint)
            with self._lock:
                self._synced = {"name": checkpoint.name, "step": manifest.get("step"), "at": now_iso()}
            remote.prune_checkpoints(checkpoint.name, self.keep_last)
        with self._lock:
            if self._pending_checkpoint == checkpoint:
                self._pending_checkpoint = None
