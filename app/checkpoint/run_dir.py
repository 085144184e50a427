"""Checks of a run directory that need no torch, so `dflash train` makes them before torch loads."""

from __future__ import annotations

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
