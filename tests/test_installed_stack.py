"""What is installed, checked before anything imports it: a locked package at another version (one
that transformers itself checks at import), a copy on PYTHONPATH shadowing the venv's, a file edited
inside an installed package. The faults are planted for real in a temporary directory on the path,
never in the venv."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from app.env.preflight import require_locked_versions
from app.errors import UserError
from tests.helpers import run_dflash
from tests.test_doctor import write_distribution

SYNC = "fix: ./uvw sync (in the image: rebuild it from uv.lock)"


def test_a_locked_package_transformers_rejects_is_the_guards_line_not_its_traceback(tmp_path: Path) -> None:
    """safetensors 0.7.0 shadowing the locked 0.8.0: transformers' import-time check raised a 50-line
    ImportError advising `pip install transformers -U`; `dflash train` names the package and the fix
    in one line before anything imports transformers, and makes no run directory."""
    site = tmp_path / "site"
    write_distribution(site, "safetensors", "0.7.0")
    run_dir = tmp_path / "run"
    done = run_dflash(
        "train", "configs/tiny.toml", f"train.output_dir={run_dir}", env={"PYTHONPATH": str(site)}
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        f"dflash: error: safetensors 0.7.0 installed, uv.lock pins 0.8.0; {SYNC}"
    ], done.stderr
    assert not run_dir.exists()


def test_an_allowed_drift_runs_off_lock_versions_but_not_one_an_installed_package_rejects(
    tmp_path: Path,
) -> None:
    accepted, rejected = tmp_path / "accepted", tmp_path / "rejected"
    write_distribution(accepted, "safetensors", "0.9.0")  # transformers asks for >= 0.8.0
    write_distribution(rejected, "safetensors", "0.7.0")
    require_locked_versions(allow_drift=True, search_path=[str(accepted), *sys.path])
    with pytest.raises(UserError) as refused:
        require_locked_versions(allow_drift=False, search_path=[str(accepted), *sys.path])
    assert str(refused.value) == f"safetensors 0.9.0 installed, uv.lock pins 0.8.0; {SYNC}"
    with pytest.raises(UserError) as refused:
        require_locked_versions(allow_drift=True, search_path=[str(rejected), *sys.path])
    assert str(refused.value) == (
        "safetensors 0.7.0 installed, uv.lock pins 0.8.0 (transformers requires safetensors>=0.8.0: "
        f"not even train.allow_environment_drift can run it); {SYNC}"
    )
    require_locked_versions(allow_drift=False)  # this venv is the lock
