"""The output directory of a datagen run: committed parquet shards, rejects, manifest, lock.

Layout:
    OUTPUT_DIR/part-000000.parquet ...   completed records only, each shard written atomically
    OUTPUT_DIR/.datagen/rejects.jsonl    the records that failed, with reasons (rewritten atomically)
    OUTPUT_DIR/.datagen/manifest.json    model and sampling settings every shard was made with
    OUTPUT_DIR/.datagen/lock             held while a run writes here (app.locks: names its holder)

The committed shards are the resume state: a record is done exactly when its id is in one, so a
run killed at any point loses only work not yet in a shard and never writes a record twice. The
state lives in a hidden folder so that loading the directory with `datasets` sees only parquet.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from app.atomic import replace_file, write_bytes_atomic
from app.errors import UserError
from app.locks import LockBusy, held

SHARD_GLOB = "part-*.parquet"
STATE_DIR = ".datagen"
LOCK_FILE = "lock"
"""In STATE_DIR: held while a run writes the directory, naming the run that holds it."""

MESSAGE_TYPE = pa.struct(
    [("role", pa.string()), ("content", pa.string()), ("reasoning_content", pa.string())]
)
SHARD_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("messages", pa.list_(MESSAGE_TYPE)),
        # datagen.reasoning = "separate": entry i is the reasoning behind messages[i] (null elsewhere)
        ("reasoning_content", pa.list_(pa.string())),
        ("finish_reasons", pa.list_(pa.string())),
        ("model", pa.string()),
        ("temperature", pa.float64()),
        ("top_p", pa.float64()),
        ("max_tokens", pa.int64()),
        ("seed", pa.int64()),
        ("source", pa.string()),
        # the prompt record's `domain` (null when it had none); shards written before it lack the column
        ("domain", pa.string()),
    ]
)
"""Columns of every shard; `messages` is what the training loader reads, `domain` its per-sample label."""


class OutputDirBusy(UserError):
    """Another datagen run holds the output directory's lock."""


class ShardStore:
    """Reads the resume state of an output directory and commits shards and rejects atomically."""

    def __init__(self, output_dir: str | Path) -> None:
        self.output_dir = Path(output_dir)
        self.state_dir = self.output_dir / STATE_DIR
        self.rejects_path = self.state_dir / "rejects.jsonl"
        self.manifest_path = self.state_dir / "manifest.json"
        self.completed_ids: set[str] = set()
        self.previous_rejects: dict[str, dict[str, Any]] = {}
        self._next_index = 0
        self._held = contextlib.ExitStack()  # the lock, from open to close

    def open(self) -> None:
        """Take the lock, clear temp files of a killed run, and read committed ids and rejects."""
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise UserError(f"datagen.output_dir: cannot create {self.state_dir} ({error})") from None
        try:
            self._held.enter_context(held(self.state_dir / LOCK_FILE, wait_s=0))
        except LockBusy as busy:
            raise OutputDirBusy(
                f"datagen.output_dir: {self.output_dir} is being written by another dflash datagen run "
                f"({busy.holder})"
            ) from None
        for leftover in [*self.output_dir.glob(".*.tmp"), *self.state_dir.glob(".*.tmp")]:
            leftover.unlink()
        for shard in sorted(self.output_dir.glob(SHARD_GLOB)):
            self.completed_ids.update(_shard_ids(shard))
            self._next_index = max(self._next_index, _shard_index(shard) + 1)
        self.previous_rejects = self._read_rejects()

    def close(self) -> None:
        self._held.close()

    def check_settings(self, settings: dict[str, Any]) -> None:
        """Refuse settings other than those the committed records were made with; writes nothing."""
        if not self.completed_ids or not self.manifest_path.is_file():
            return
        try:
            recorded = json.loads(self.manifest_path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise UserError(f"{self.manifest_path}: unreadable manifest ({error})") from None
        if not isinstance(recorded, dict):
            raise UserError(f"{self.manifest_path}: unreadable manifest (not a JSON object)")
        changed = [
            f"{key} {recorded.get(key)!r} -> {value!r}"
            for key, value in settings.items()
            if recorded.get(key) != value
        ]
        if changed:
            raise UserError(
                f"datagen.output_dir: {self.output_dir} holds records made with other settings "
                f"({', '.join(changed)}); use a new datagen.output_dir to generate with the new settings, "
                "or restore the old ones"
            )

    def record_settings(self, settings: dict[str, Any]) -> None:
        """Refuse other settings (`check_settings`), then record these as the directory's settings."""
        self.check_settings(settings)
        write_bytes_atomic(self.manifest_path, json.dumps(settings, indent=2, sort_keys=True).encode())

    def write_shard(self, rows: list[dict[str, Any]]) -> Path:
        """Commit `rows` as the next shard: written under a temp name, fsynced, then renamed."""
        path = self.output_dir / f"part-{self._next_index:06d}.parquet"
        temp = self.output_dir / f".{path.name}.tmp"
        table = pa.Table.from_pylist(rows, schema=SHARD_SCHEMA)
        pq.write_table(table, temp, compression="zstd")
        replace_file(temp, path)
        self._next_index += 1
        self.completed_ids.update(row["id"] for row in rows)
        return path

    def write_rejects(self, rejects: dict[str, dict[str, Any]]) -> None:
        """Rewrite the rejects file with exactly `rejects` (id -> entry); remove it when there are none."""
        if not rejects:
            self.rejects_path.unlink(missing_ok=True)
            return
        lines = "".join(json.dumps(entry, ensure_ascii=False) + "\n" for entry in rejects.values())
        write_bytes_atomic(self.rejects_path, lines.encode())

    def _read_rejects(self) -> dict[str, dict[str, Any]]:
        if not self.rejects_path.is_file():
            return {}
        rejects: dict[str, dict[str, Any]] = {}
        for line in self.rejects_path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue  # the file is only advisory: a bad line must not block a resume
            if isinstance(entry, dict) and isinstance(entry.get("id"), str):
                rejects[entry["id"]] = entry
        return rejects


def _shard_ids(shard: Path) -> list[str]:
    try:
        return pq.read_table(shard, columns=["id"]).column("id").to_pylist()
    except (pa.ArrowException, OSError, KeyError) as error:
        raise UserError(
            f"{shard}: unreadable shard ({error}); it was not written by dflash datagen, move it away"
        ) from None


def _shard_index(shard: Path) -> int:
    digits = shard.stem.removeprefix("part-")
    if not digits.isdigit():
        raise UserError(f"{shard}: unexpected shard name (expected part-NNNNNN.parquet); move it away")
    return int(digits)
