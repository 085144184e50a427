"""The identity of a run's data: every file it reads, by path, size and content digest.

Each start of a run records it in the run directory (`data_identity.json`); a resume compares the
files it would read now with the recorded ones before anything loads, so that swapped records or an
edited answer (same lengths, same batch plan) cannot continue the run silently on other data. A
changed file is refused naming it and the way out: the original data, or `train.allow_data_change`,
whose use the record keeps. A file whose path, size and modification time match the record keeps its
recorded digest (the tokenized cache trusts the same stat); any other is read and hashed. No torch:
`dflash train` checks this before torch loads.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.atomic import file_sha256, write_json_atomic
from app.config import RunConfig
from app.data.sources import resolve_sources, source_members
from app.errors import UserError

DATA_IDENTITY_FILE = "data_identity.json"
ALLOW_SETTING = "train.allow_data_change"
NAMES_SHOWN = 4
"""Files named in a refusal; more end in a count."""


def current_identity(config: RunConfig, recorded: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One entry per file the run reads (`data.train_files`, then `data.eval_files`), in reading order;
    `recorded`: a previous identity whose digests are reused for files whose stat is unchanged."""
    known = {(entry["path"], entry["size"], entry["mtime_ns"]): entry["sha256"] for entry in recorded or []}
    entries = []
    for setting, files in (
        ("data.train_files", config.data.train_files),
        ("data.eval_files", config.data.eval_files),
    ):
        for source in resolve_sources(files):
            for member in source_members(source):
                path, stat = str(member.resolve()), member.stat()
                digest = known.get((path, stat.st_size, stat.st_mtime_ns)) or _sha256(member)
                entries.append(
                    {"setting": setting, "path": path, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                     "sha256": digest}
                )  # fmt: skip
    return entries


@dataclass(frozen=True)
class DataIdentity:
    """The files a start reads, and how they differ from the run's last start (None: they do not)."""

    files: list[dict[str, Any]]
    change: str | None


def check_data_identity(config: RunConfig, *, resume: bool) -> DataIdentity:
    """The data's identity now; on a resume whose data changed, refused unless `train.allow_data_change`.
    Writes nothing: the run records it once its start is through (`record_data_identity`), so a
    refused fresh start leaves no record."""
    run_dir = Path(config.train.output_dir)
    recorded = _read(run_dir)["files"] if resume else []
    now = current_identity(config, recorded)
    change = describe_change(recorded, now) if recorded else None
    if change is not None and not config.train.allow_data_change:
        raise UserError(
            f"{run_dir}: cannot resume: the data differs from the run's last start ({change}); resume "
            f"with the original data, or set {ALLOW_SETTING}=true to continue on the changed data "
            f"(recorded in {DATA_IDENTITY_FILE})"
        )
    return DataIdentity(now, change)


def record_data_identity(
    run_dir: Path, identity: DataIdentity, *, resume: bool, log: Callable[[str], None]
) -> None:
    """Record this start's data identity in the run directory, with the accepted change, if any (said
    in the log too), after the earlier starts' accepted changes."""
    changes = _read(run_dir)["changes"] if resume else []
    if identity.change is not None:
        log(f"warning: resuming on changed data, accepted by {ALLOW_SETTING}: {identity.change}")
        at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        changes = [*changes, {"at": at, "accepted_by": ALLOW_SETTING, "change": identity.change}]
    write_json_atomic(run_dir / DATA_IDENTITY_FILE, {"files": identity.files, "changes": changes})


def describe_change(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> str | None:
    """None when the run reads the same contents in the same order; else what differs, by file."""
    if [(e["setting"], e["sha256"]) for e in before] == [(e["setting"], e["sha256"]) for e in after]:
        return None
    old = {entry["path"]: entry["sha256"] for entry in before}
    new = {entry["path"]: entry["sha256"] for entry in after}
    parts = [f"{path} changed" for path in new if path in old and old[path] != new[path]]
    parts += [f"{path} is gone" for path in old if path not in new]
    parts += [f"{path} is new" for path in new if path not in old]
    if not parts:
        parts = ["the same files in another order"]
    shown = ", ".join(parts[:NAMES_SHOWN])
    return shown + (f" and {len(parts) - NAMES_SHOWN} more" if len(parts) > NAMES_SHOWN else "")


def _read(run_dir: Path) -> dict[str, Any]:
    """The recorded identity; none (a run from before the record, or a first start) is an empty one."""
    path = run_dir / DATA_IDENTITY_FILE
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        return {"files": list(record["files"]), "changes": list(record.get("changes", []))}
    except FileNotFoundError:
        return {"files": [], "changes": []}
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UserError(
            f"{path}: not a data identity record ({error}); restore it from a copy of the run, or delete "
            "it to trust the data as it is now"
        ) from None


def _sha256(path: Path) -> str:
    try:
        return file_sha256(path)
    except OSError as error:
        raise UserError(f"{path}: cannot read the data file ({error.strerror or error})") from None
