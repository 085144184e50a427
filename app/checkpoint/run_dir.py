"""Checks of a run directory that need no torch, so `dflash train` makes them before torch loads."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from app.errors import UserError


def require_run_to_resume(run_dir: str | Path) -> None:
    """`--resume` names a run directory that exists: a mistyped path would otherwise start a new run
    from step 0 there and exit 0, looking like a resume."""
    if not Path(run_dir).exists():
        raise UserError(
            f"train.output_dir = {run_dir}: does not exist, so there is no run to resume there; check the "
            "path, or drop --resume to start a new run"
        )


@contextlib.contextmanager
def removed_if_left_empty(run_dir: str | Path) -> Iterator[None]:
    """The directories of `run_dir` that do not exist yet are removed again, deepest first, if the
    block fails and leaves them empty: a refused fresh start (a drifted environment, bad data) leaves
    no empty run directory that reads as a run."""
    run_dir = Path(run_dir).absolute()
    missing = [path for path in (run_dir, *run_dir.parents) if not path.exists()]
    try:
        yield
    except BaseException:
        for path in missing:  # deepest first; one that holds anything stops the walk
            try:
                os.rmdir(path)
            except OSError:
                break
        raise
