"""Atomic, checksummed training checkpoints with keep-last-N and a `latest` pointer.

Layout of a run directory's `checkpoints/`:

    step_000500/
        model.safetensors     drafter weights (fp32)
        optimizer.pt          optimizer state
        state.json            step, epoch, data cursor, scheduler, training signal, metrics
        rng.pt                torch CPU (+ CUDA) generator states
        manifest.json         sha256 + size of every file above; written last
    latest                    name of the newest complete checkpoint

A checkpoint is written into a hidden temp directory and renamed into place only when complete, so
a crash never leaves a partial `step_*`; the next write deletes what a killed writer left hidden. On load, the manifest's checksums are verified; a truncated
or corrupt checkpoint is skipped with a warning and the previous good one is used. The trainer calls
`save_checkpoint` from a background thread on a host copy of its state (`app.checkpoint.writer`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from app.atomic import (
    file_sha256,
    fsync_tree,
    remove_abandoned_temp_files,
    replace_directory,
    staging_directory,
    write_json_atomic,
    write_text_atomic,
)
from app.checkpoint.run_dir import require_own_directory, require_run_to_resume, require_writable
from app.errors import UserError

MANIFEST = "manifest.json"
LATEST = "latest"
PREFIX = "step_"
"""Written and removed in the run directory at the start, to prove that checkpoints can be written there."""
RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
"""How safetensors (Rust) reports the OS error of a failed write: only in its message."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped because it is incomplete or corrupt."""


@dataclass
class Checkpoint:
    """A loaded checkpoint: weights, optimizer state, RNG states and the JSON training state."""

    path: Path
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    rng_state: dict[str, Any]
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    rng_state: dict[str, Any],
    state: dict[str, Any],
    keep_last: int,
) -> Path:
    """Write `step_<step>/` atomically, point `latest` at it, then prune to `keep_last` checkpoints.

    When the OS refuses a write (disk full, file size limit, quota) the OSError is raised, whichever
    library wrote the file; the partial checkpoint is removed and the earlier ones stay as they were."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    remove_abandoned_staging(root)
    final = root / f"{PREFIX}{step:08d}"
    staging = staging_directory(final)
    try:
        save_file(
            {name: t.detach().contiguous().cpu() for name, t in model_state.items()},
            staging / "model.safetensors",
        )
        # Through Python files: torch.save to a path reports a failed write without its OS error.
        with open(staging / "optimizer.pt", "wb") as handle:
            torch.save(optimizer_state, handle)
        with open(staging / "rng.pt", "wb") as handle:
            torch.save(rng_state, handle)
        (staging / "state.json").write_text(json.dumps({**state, "step": step}, indent=2, sort_keys=True))
        files = {
            p.name: {"sha256": file_sha256(p), "bytes": p.stat().st_size} for p in sorted(staging.iterdir())
        }
        write_json_atomic(staging / MANIFEST, {"step": step, "files": files})
        fsync_tree(staging)
        replace_directory(staging, final)  # a rerun of the same step (resumed, then stopped at once)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        refusal = _os_error_behind(error)
        if refusal is not None and refusal is not error:
            raise OSError(refusal.errno, refusal.strerror) from error
        raise
    write_text_atomic(root / LATEST, final.name)
    for old in complete_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def remove_abandoned_staging(root: Path) -> None:
    """Delete the hidden staging and set-aside directories of a writer that was killed mid-write.
    One writer per run writes one checkpoint at a time, so any found before a write are abandoned."""
    for path in root.glob(f".{PREFIX}*"):
        shutil.rmtree(path, ignore_errors=True)


def complete_checkpoints(root: Path) -> list[Path]:
    """Checkpoint directories with a manifest, oldest step first (temp directories are never listed)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(PREFIX) and (p / MANIFEST).is_file()]
    return sorted(found, key=_step_of)


def latest_checkpoint(root: Path) -> Path | None:
    """The complete checkpoint a resume starts from (unverified): the one `latest` names, else the newest."""
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if (named / MANIFEST).is_file():
            return named
    found = complete_checkpoints(root)
    return found[-1] if found else None


def check_run_directory(run_dir: str | Path, resume: bool) -> None:
    """Before anything heavy loads: make sure the run directory can be written (not hours later, at
    the first checkpoint), remove what a killed write left, and refuse to start a new run in a
    directory holding another run's checkpoints (the two would mix, and pruning would delete the new ones).
    What a SIGKILL left is removed: a status or config file's temp file, a checkpoint's staging."""
    if resume:
        require_run_to_resume(run_dir)
    if not resume:
        require_own_directory(run_dir)
    require_writable(run_dir, keep=True)
    remove_abandoned_temp_files(run_dir)
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return
    remove_abandoned_temp_files(root)
    remove_abandoned_staging(root)
    existing = complete_checkpoints(root)
    if existing and not resume:
        raise UserError(
            f"{run_dir}: holds the checkpoints of an earlier run (newest {existing[-1].name}); continue it "
            "with --resume, or start a new run with another train.output_dir"
        )


def _os_error_behind(error: BaseException) -> OSError | None:
    """The OS's refusal behind a failed write, if that is what it was: torch.save keeps the OSError of
    the file it writes only as the context of its RuntimeError, safetensors only in its message."""
    for cause in (
        error,
        error.__cause__,
        error.__context__,
    ):  # one level: an OSError handled before is not it
        if isinstance(cause, OSError):
            return cause
    found = RUST_OS_ERROR.search(str(error))
    if found is None:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code))


def _step_of(path: Path) -> int:
    digits = path.name[len(PREFIX) :]
    return int(digits) if digits.isdigit() else -1


def verify_checkpoint(path: Path, checksums: bool = True) -> str | None:
    """None when every file matches the manifest, else the reason it does not. `checksums=False`
    checks presence and sizes only (milliseconds, where hashing a large run's optimizer state takes
    a while): what a resume can refuse before anything heavy loads."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        for name, expected in manifest["files"].items():
            file = path / name
            if not file.is_file():
                return f"{name} is missing"
            if file.stat().st_size != expected["bytes"]:
                return f"{name} is truncated ({file.stat().st_size} of {expected['bytes']} bytes)"
            if checksums and file_sha256(file) != expected["sha256"]:
                return f"{name} fails its sha256 checksum"
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"unreadable manifest ({error})"
    return None


def load_latest_checkpoint(
    run_dir: str | Path, map_location: str | torch.device = "cpu"
) -> Checkpoint | None:
    """The newest checkpoint that verifies, falling back past corrupt ones with a warning; None if there is none."""
    root = checkpoint_root(run_dir)
    candidates = complete_checkpoints(root)
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        # `latest` wins when it is intact; newer unpointed directories come from an interrupted prune/pointer write
        candidates = [p for p in candidates if p != named] + ([named] if named in candidates else [])
    for path in reversed(candidates):
        problem = verify_checkpoint(path)
        if problem is not None:
            warnings.warn(
                f"checkpoint {path}: {problem}; falling back to the previous one",
                CheckpointWarning,
                stacklevel=2,
            )
            continue
        return Checkpoint(
            path=path,
            model_state=load_file(path / "model.safetensors", device=str(map_location)),
            optimizer_state=torch.load(path / "optimizer.pt", map_location=map_location, weights_only=True),
            rng_state=torch.load(path / "rng.pt", map_location="cpu", weights_only=True),
            state=json.loads((path / "state.json").read_text()),
        )
    return None


def check_training_signal(saved: dict[str, Any], current: dict[str, Any], source: Path) -> None:
    """Refuse to resume when anything that defines what the drafter learns has changed."""
    for field in sorted(set(saved) | set(current)):
        if saved.get(field) != current.get(field):
            raise UserError(
                f"{source}: cannot resume: training signal {field} changed from {saved.get(field)!r} to "
                f"{current.get(field)!r}; start a new run (new train.output_dir) or restore the old value"
            )
