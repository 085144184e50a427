"""Atomic writes shared by every writer of files and directories."""

from __future__ import annotations

from pathlib import Path

from app.atomic import replace_directory


def staged(tmp_path: Path, content: str) -> Path:
    staging = tmp_path / f".staging-{content}"
    staging.mkdir()
    (staging / "file.txt").write_text(content)
    return staging


def test_replace_directory_installs_a_new_one_and_replaces_an_old_one_leaving_nothing_aside(
    tmp_path: Path,
) -> None:
    target = tmp_path / "out"
    replace_directory(staged(tmp_path, "first"), target)
    assert (target / "file.txt").read_text() == "first"
    (target / "stale.txt").write_text("from the first version")

    replace_directory(staged(tmp_path, "second"), target)
    assert sorted(p.name for p in target.iterdir()) == ["file.txt"]  # the old directory is gone whole
    assert (target / "file.txt").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging or set-aside directory left
