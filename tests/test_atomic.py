"""Atomic writes shared by every writer of files and directories."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from app.atomic import (
    file_sha256,
    publish_directory,
    replace_directory,
    replace_file,
    staging_directory,
    write_bytes_atomic,
    write_json_atomic,
)


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


def test_a_failed_replacement_puts_the_old_directory_back(tmp_path: Path) -> None:
    """The new version cannot be renamed in (here: staged on another filesystem, EXDEV): the old one
    is back in place, nothing is left set aside, and the error is raised."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the test's tmp dir")
    target = tmp_path / "out"
    replace_directory(staged(tmp_path, "first"), target)
    elsewhere = Path(tempfile.mkdtemp(dir=shm))
    try:
        with pytest.raises(OSError):
            replace_directory(staged(elsewhere, "second"), target)
    finally:
        shutil.rmtree(elsewhere)
    assert (target / "file.txt").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_atomic_files_and_staged_directories_get_the_modes_the_umask_gives(
    tmp_path: Path, umask: int
) -> None:
    previous = os.umask(umask)
    try:
        write_json_atomic(tmp_path / "status.json", {"state": "running"})
        staging = staging_directory(tmp_path / "checkpoint")
        replace_directory(staging, tmp_path / "checkpoint")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "status.json").stat().st_mode) == 0o666 & ~umask
    assert stat.S_IMODE((tmp_path / "checkpoint").stat().st_mode) == 0o777 & ~umask


def test_a_durable_write_flushes_the_file_before_its_rename_and_the_directory_after(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A rename lives in its directory's data: unflushed, a power cut can undo it."""
    flushed: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        flushed.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    write_bytes_atomic(tmp_path / "file", b"new")
    assert len(flushed) == 2 and Path(flushed[0]).name.startswith(".file.")  # the temp file first
    assert flushed[1] == str(tmp_path)
    flushed.clear()
    (tmp_path / ".shard.tmp").write_bytes(b"rows")
    replace_file(tmp_path / ".shard.tmp", tmp_path / "shard")  # durable unless said otherwise
    assert flushed == [str(tmp_path / ".shard.tmp"), str(tmp_path)]
    flushed.clear()
    write_bytes_atomic(tmp_path / "cache", b"may be lost", durable=False)
    assert flushed == []
    for swap in (replace_directory, replace_directory, publish_directory):
        flushed.clear()
        swap(staged(tmp_path, f"v{len(list(tmp_path.iterdir()))}"), tmp_path / f"out-{swap.__name__}")
        assert flushed == [str(tmp_path)]


def test_the_first_complete_build_is_published_and_a_later_one_is_discarded(tmp_path: Path) -> None:
    target = tmp_path / "out"
    assert publish_directory(staged(tmp_path, "first"), target) is True
    second = staged(tmp_path, "second")
    assert publish_directory(second, target) is False
    assert (target / "file.txt").read_text() == "first" and not second.exists()
    (tmp_path / "a file").write_text("")
    with pytest.raises(NotADirectoryError):  # not a finished build in the way: the OS's error stands
        publish_directory(staged(tmp_path, "third"), tmp_path / "a file")


def test_file_sha256_is_the_digest_of_the_whole_content(tmp_path: Path) -> None:
    data = os.urandom(3 << 20)  # several reads' worth
    (tmp_path / "blob").write_bytes(data)
    assert file_sha256(tmp_path / "blob") == hashlib.sha256(data).hexdigest()
