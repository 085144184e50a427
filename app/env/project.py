"""Where the project lives: its root (pyproject.toml + uv.lock), the lock's hash, its git revision."""

from __future__ import annotations

import shutil
import subprocess
import tomllib
from pathlib import Path

from app.atomic import file_sha256

PROJECT_NAME = "dflash-appliance"
GIT_TIMEOUT_S = 5.0
LOCK_FILE = "uv.lock"
"""The lock, by its path from the project root (the checkout's root, where git names it so too)."""


def find_project_root(starts: list[Path] | None = None) -> Path | None:
    """The nearest directory above each start whose pyproject.toml is this project's.

    Starts from the package itself (the code that actually runs), then from the working directory
    (a non-editable install in an image lives in site-packages, far from the checkout). Another
    project's pyproject.toml on the way up is skipped, not taken.
    """
    for start in starts if starts is not None else [Path(__file__).resolve().parent, Path.cwd()]:
        for directory in [start, *start.parents]:
            if _is_our_pyproject(directory / "pyproject.toml"):
                return directory
    return None


def _is_our_pyproject(path: Path) -> bool:
    try:
        project = tomllib.loads(path.read_text(encoding="utf-8")).get("project", {})
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False
    return isinstance(project, dict) and project.get("name") == PROJECT_NAME


def code_hashes(package_dir: Path | None = None) -> dict[str, str]:
    """sha256 (first 16 hex digits) of every Python file of the running package, by relative path.

    The package that runs, not the checkout: in an image it is installed in site-packages. A git
    revision says nothing about an edited file; this names it.
    """
    package = package_dir if package_dir is not None else Path(__file__).resolve().parents[1]
    return {
        path.relative_to(package).as_posix(): file_sha256(path)[:16]
        for path in sorted(package.rglob("*.py"))
        if "__pycache__" not in path.parts
    }


def git_revision(root: Path | None) -> dict:
    """HEAD's commit, whether tracked files differ from it and which (paths from the checkout's root:
    an edited `app/` file, or `uv.lock`); nulls outside a git checkout."""
    if root is None or not (root / ".git").exists() or shutil.which("git") is None:
        return {"revision": None, "dirty": None, "changed": None}
    head = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    changed = _git(root, "diff", "--name-only", "HEAD", "--")
    return {
        "revision": head.strip() if head else None,
        "dirty": None if status is None else bool(status.strip()),
        "changed": None if changed is None else sorted(changed.splitlines()),
    }


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(root), *args],
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None
