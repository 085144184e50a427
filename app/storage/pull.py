"""Restore a run directory from its S3 copy so that `dflash train ... --resume` continues it elsewhere.

Only a checkpoint whose manifest exists on the server and whose every downloaded file matches it is
restored (the newest such; `latest` first). It is downloaded into a hidden staging directory and renamed
into place when verified, exactly like a locally written checkpoint.
"""

from __future__ import annotations

import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

from app.atomic import fsync_tree, replace_directory, staging_directory, write_text_atomic
from app.checkpoint.store import (
    LATEST,
    CheckpointWarning,
    checkpoint_root,
    complete_checkpoints,
    verify_checkpoint,
)
from app.errors import UserError
from app.storage.remote import RemoteRun
from app.storage.s3 import StorageError, describe_error, is_missing, make_client, parse_s3_uri


@dataclass(frozen=True)
class PulledRun:
    run_dir: Path
    checkpoint: Path
    step: int
    run_files: list[str]
    latest_kept_local: bool
    """True when the run directory already held a newer checkpoint, which `latest` keeps pointing at."""


def pull_run(
    uri: str, to: Path, *, endpoint_url: str | None = None, chunk_mb: int = 64, max_retries: int = 5
) -> PulledRun:
    """Download the newest verified checkpoint and the run files of `uri` into the run directory `to`."""
    location = parse_s3_uri(uri)
    remote = RemoteRun(make_client(endpoint_url, max_retries), location, chunk_mb)
    root = checkpoint_root(to)
    root.mkdir(parents=True, exist_ok=True)
    try:
        candidates = remote.complete_checkpoints()
        for name in reversed(candidates):
            restored = _restore_checkpoint(remote, name, root)
            if restored is not None:
                step, path = restored
                run_files = remote.download_run_files(to)
                break
        else:
            raise UserError(
                f"{location}: no complete checkpoint (one counts once its manifest.json is uploaded and every "
                f"file matches it); found {len(candidates)} with a manifest"
            )
    except (UserError, StorageError):
        raise
    except Exception as error:
        raise StorageError(f"pulling {location}: {describe_error(error)}") from None
    newest_local = complete_checkpoints(root)[-1]
    keep_local = newest_local.name > path.name
    if not keep_local:
        write_text_atomic(root / LATEST, path.name)
    return PulledRun(Path(to), path, step, run_files, keep_local)


def _restore_checkpoint(remote: RemoteRun, name: str, root: Path) -> tuple[int, Path] | None:
    """Download `name` into a staging directory, verify it, rename it into place; None if it fails to verify."""
    staging = staging_directory(root / name)
    try:
        try:
            manifest = remote.download_checkpoint(name, staging)
        except Exception as error:
            if not is_missing(error):
                raise
            problem: str | None = "a file disappeared while downloading (pruned by the writer)"
        else:
            problem = verify_checkpoint(staging)
        if problem is not None:
            warnings.warn(
                f"{remote.location}/checkpoints/{name}: {problem}; trying an older one",
                CheckpointWarning,
                stacklevel=3,
            )
            return None
        fsync_tree(staging)
        final = root / name
        replace_directory(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return int(manifest["step"]), final
