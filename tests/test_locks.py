"""app.locks: one process at a time, and whoever waits or is refused is told who holds the lock."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.locks import LockBusy, held, holder
from tests.helpers import ROOT

HOLD = (
    "import sys, time\n"
    "from app.locks import held\n"
    "with held(sys.argv[1]):\n"
    "    print('held', flush=True)\n"
    "    time.sleep(float(sys.argv[2]))\n"
)


def hold_in_another_process(path: Path, seconds: float) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path), str(seconds)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None and process.stdout.readline() == "held\n"
    return process


def test_a_refusal_names_the_process_holding_the_lock(tmp_path: Path) -> None:
    path = tmp_path / "lock"
    other = hold_in_another_process(path, 30)
    try:
        with pytest.raises(LockBusy) as refused, held(path, wait_s=0):
            pass
        expected = f"pid {other.pid} on {socket.gethostname()} (-c {path} 30)"
        assert refused.value.holder == expected
        assert str(refused.value) == f"{path} is held by {expected}"
        with pytest.raises(LockBusy), held(path, wait_s=0.3):  # a bounded wait ends refused too
            pass
    finally:
        other.kill()
        other.wait()
    with held(path, wait_s=0):  # the dead holder's lock is free again, and names this process now
        assert holder(path).startswith(f"pid {os.getpid()} on {socket.gethostname()} (")


def test_a_waiter_says_whom_it_waits_for_and_gets_the_lock_when_it_is_released(tmp_path: Path) -> None:
    path = tmp_path / "lock"
    other = hold_in_another_process(path, 2.5)
    heard: list[str] = []
    started = time.monotonic()
    try:
        with held(path, waiting=heard.append):
            waited = time.monotonic() - started
            assert holder(path).startswith(f"pid {os.getpid()} on ")
    finally:
        other.kill()
        other.wait()
    assert heard == [f"waiting for {path}, held by pid {other.pid} on {socket.gethostname()} (-c {path} 2.5)"]
    assert 2 <= waited < 30


def test_no_holder_written_reads_as_another_process(tmp_path: Path) -> None:
    assert holder(tmp_path / "missing") == "another process"
    (tmp_path / "empty").write_text("")
    assert holder(tmp_path / "empty") == "another process"


def test_the_holder_line_survives_any_command_line_and_any_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "lock"
    monkeypatch.setattr(sys, "argv", ["/usr/bin/dflash", "train", "caf\udce9.toml"])  # undecodable argv
    with held(path, wait_s=0):
        assert holder(path) == f"pid {os.getpid()} on {socket.gethostname()} (dflash train 'caf?.toml')"
    for argv in ([], [""]):  # an embedded interpreter's empty argv
        monkeypatch.setattr(sys, "argv", argv)
        with held(path, wait_s=0):
            assert holder(path) == f"pid {os.getpid()} on {socket.gethostname()} (python)"
    path.write_bytes(b"pid 7 on h\xff (x)\n")  # written by something else: read, not refused
    assert holder(path) == "pid 7 on h\ufffd (x)"


def test_a_refusal_carries_the_lock_s_path(tmp_path: Path) -> None:
    path = tmp_path / "lock"
    with held(path), pytest.raises(LockBusy) as refused, held(path, wait_s=0):
        pass
    assert refused.value.path == path


def test_without_a_listener_the_wait_is_a_log_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import threading

    path = tmp_path / "lock"

    def wait_for_it() -> None:
        with held(path):
            pass

    with held(path):
        waiter = threading.Thread(target=wait_for_it)
        with caplog.at_level("WARNING", logger="app.locks"):
            waiter.start()
            deadline = time.monotonic() + 30
            while not caplog.messages and time.monotonic() < deadline:
                time.sleep(0.05)
    waiter.join(timeout=30)
    (message,) = caplog.messages
    assert message.startswith(f"waiting for {path}, held by pid {os.getpid()} on {socket.gethostname()} (")
    assert [record.levelname for record in caplog.records] == ["WARNING"] and not waiter.is_alive()
