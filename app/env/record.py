"""A run directory's environment record: the fingerprint of every start, appended, never rewritten.

`environment.jsonl` holds one line per start of the run (the first, then each resume):

    {"start": 2, "at": "...", "step": 1500, "accepted": [], "fingerprint": {...}, "config": {...}}

`accepted` lists what the start was allowed to run despite (`train.allow_environment_drift`): a start
with nothing accepted is a **good start**, and "what changed since this run was last right" compares
with the newest good start, never with a drifted resume that happened to come later.
`fingerprint.json` is the first start's fingerprint, written once, for tools that read one file.
A line torn by a kill mid-append is skipped on read and cut before the next append.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from app.env.fingerprint import FINGERPRINT_FILENAME, checked_fingerprint, load_fingerprint, save_fingerprint
from app.errors import UserError

ENVIRONMENT_RECORD = "environment.jsonl"


@dataclass(frozen=True)
class StartRecord:
    """One start of a run and the environment it ran in."""

    start: int
    at: str
    step: int
    accepted: list[str]
    fingerprint: dict[str, Any]
    config: dict[str, Any] | None = None
    """The resolved config this start trained with (config.json holds only the newest start's);
    None in records from before it was kept."""

    @property
    def good(self) -> bool:
        return not self.accepted

    def describe(self) -> str:
        return f"start {self.start} (step {self.step}, {self.at})"


def read_starts(run_dir: str | Path) -> list[StartRecord]:
    """Every complete start line of the run's record, oldest first ([] when there is none)."""
    path = Path(run_dir) / ENVIRONMENT_RECORD
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return _legacy_start(Path(run_dir))
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"{path}: cannot read the environment record ({error})") from None
    starts = []
    lines = text.split("\n")
    for number, line in enumerate(lines[:-1], 1):  # the text after the last newline is a torn append
        try:
            entry = json.loads(line)
            entry["fingerprint"] = checked_fingerprint(entry.get("fingerprint"), f"{path} line {number}")
            starts.append(StartRecord(**entry))
        except (json.JSONDecodeError, TypeError, AttributeError) as error:
            raise UserError(f"{path} line {number}: not a start record ({error})") from None
    return starts


def _legacy_start(run_dir: Path) -> list[StartRecord]:
    """A run directory from before the record: its one `fingerprint.json` is its first start."""
    if not (run_dir / FINGERPRINT_FILENAME).is_file():
        return []
    fingerprint = load_fingerprint(run_dir / FINGERPRINT_FILENAME)
    return [StartRecord(1, str(fingerprint.get("created_at")), 0, [], fingerprint)]


def last_good_start(run_dir: str | Path) -> StartRecord | None:
    good = [start for start in read_starts(run_dir) if start.good]
    return good[-1] if good else None


def append_start(
    run_dir: Path,
    fingerprint: dict[str, Any],
    *,
    step: int,
    accepted: list[str],
    new_run: bool,
    config: dict[str, Any] | None = None,
) -> StartRecord:
    """Record this start. A new run begins a new record (a run directory without checkpoints may hold
    the record of an abandoned attempt); a resume appends to the run's."""
    path = run_dir / ENVIRONMENT_RECORD
    starts = [] if new_run else read_starts(run_dir)
    at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    record = StartRecord(len(starts) + 1, at, step, list(accepted), fingerprint, config)
    written = [] if path.is_file() else starts  # a legacy start goes into the record first
    text = "".join(
        json.dumps(asdict(entry), sort_keys=True, default=str) + "\n" for entry in [*written, record]
    )
    if new_run:
        path.unlink(missing_ok=True)
        (run_dir / FINGERPRINT_FILENAME).unlink(missing_ok=True)
    _drop_torn_tail(path)
    with path.open("a", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    if not (run_dir / FINGERPRINT_FILENAME).exists():
        save_fingerprint(fingerprint, run_dir / FINGERPRINT_FILENAME)
    return record


def latest_fingerprint(run_dir: str | Path) -> dict[str, Any]:
    """The environment of the run's newest start (what it runs in now, or ran in last)."""
    starts = read_starts(run_dir)
    return starts[-1].fingerprint if starts else load_fingerprint(run_dir)


def _drop_torn_tail(path: Path) -> None:
    """Cut what a kill mid-append left after the last complete line, so this start gets a line of its own."""
    if not path.is_file():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with path.open("r+b") as handle:
            handle.truncate(data.rfind(b"\n") + 1)


def recorded_fingerprint(path: str | Path) -> tuple[dict[str, Any], str]:
    """The fingerprint to compare with, and what it is: a fingerprint file; or a run directory's newest
    good start (its first start when none was good; `fingerprint.json` of runs before the record)."""
    path = Path(path)
    if path.is_dir():
        starts = read_starts(path)
        if starts:
            chosen = last_good_start(path) or starts[0]
            kind = "last good start" if chosen.good else "first start (no start was good)"
            return chosen.fingerprint, f"{path}, {kind}: {chosen.describe()}"
    return load_fingerprint(path), str(path)
