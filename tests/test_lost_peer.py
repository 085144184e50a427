"""A rank whose collective fails only because a peer left the job is a follower, never the job's first
failure: in a killed target's job a drafter in DDP's all-reduce sees the other drafter's exit as a
connection reset, and if it recorded that first, torchrun would name it instead of the killed rank
(the flaky end of tests/test_distributed.py's killed-target test). Here the gloo error is real (two
processes, one killed mid all-reduce), and the failure report runs in this process."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from app.cli import train_cmd
from app.cli.train_cmd import _report_failure
from app.pipeline.distributed import lost_a_peer
from tests.test_metrics_gather import drafter_runtime  # drafter 0 (rank 1) of 1 target + 2 drafters

REPO = Path(__file__).resolve().parents[1]

ALL_REDUCE_WITH_A_KILLED_PEER = """
import json, os, signal, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from app.pipeline.distributed import lost_a_peer
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2,
                        timeout=timedelta(seconds=30))
dist.barrier()
if rank == 1:
    time.sleep(0.5)  # rank 0 is inside the all-reduce by now
    os.kill(os.getpid(), signal.SIGKILL)
try:
    dist.all_reduce(torch.ones(4))
    print(json.dumps({"raised": None}))
except Exception as error:
    print(json.dumps({"raised": type(error).__name__, "message": str(error), "lost": lost_a_peer(error)}))
"""


def test_a_gloo_all_reduce_whose_peer_is_killed_says_it_lost_a_peer(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", ALL_REDUCE_WITH_A_KILLED_PEER, str(rank), store],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    (out, err), _ = (rank.communicate(timeout=60) for rank in ranks)
    assert ranks[1].returncode == -9
    outcome = json.loads(out.strip().splitlines()[-1]) if out.strip() else err[-2000:]
    assert outcome["raised"] is not None and outcome["lost"], outcome
    assert lost_a_peer(RuntimeError(outcome["message"]))  # the same text, judged in this process


@pytest.mark.parametrize(
    "message",
    [
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:41225: Connection reset by peer",
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:10443",
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:460] Write error [127.0.0.1]:5334: Broken pipe",
        "NCCL Error 6: remote process exited or there was a network error",
    ],
)
def test_the_errors_of_a_peer_that_left_are_recognised(message: str) -> None:
    assert lost_a_peer(RuntimeError(message))
    assert not lost_a_peer(ValueError(message))  # not a collective's error


def test_other_errors_are_not_a_lost_peer() -> None:
    assert not lost_a_peer(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not lost_a_peer(RuntimeError("[pair.cc:534] Read error: Connection timed out"))


def test_a_lost_peer_waits_for_the_rank_that_saw_why_and_follows_it() -> None:
    runtime = drafter_runtime(1, None)

    def target_lost_seen_by_drafter_1() -> None:
        time.sleep(0.3)
        runtime.side.post_failure(0, "lost (TransportError: receiving epoch 0 batch 3 from target 0 failed)")

    poster = threading.Thread(target=target_lost_seen_by_drafter_1)
    poster.start()
    started = time.monotonic()
    first = _report_failure(
        runtime, RuntimeError("[pair.cc:534] Read error [::1]:5: Connection reset by peer")
    )
    poster.join()
    assert first is False  # no error file: the killed target stays torchrun's root cause
    assert runtime.side.failure()["rank"] == 0
    assert time.monotonic() - started < 1.5  # it stops waiting once the cause is recorded


def test_a_lost_peer_nobody_explains_is_recorded_but_writes_no_error_file(monkeypatch) -> None:
    monkeypatch.setattr(train_cmd, "FOLLOWER_EXIT_DELAY_S", 0.2)
    runtime = drafter_runtime(1, None)
    started = time.monotonic()
    first = _report_failure(runtime, RuntimeError("Connection closed by peer [127.0.0.1]:10443"))
    assert time.monotonic() - started >= 0.2  # it gave the rank that knows why its chance
    assert first is False
    recorded = runtime.side.failure()
    assert recorded["rank"] == 1 and "Connection closed by peer" in recorded["cause"]  # every rank stops


def test_an_own_error_is_the_first_failure_at_once() -> None:
    runtime = drafter_runtime(1, None)
    started = time.monotonic()
    assert _report_failure(runtime, RuntimeError("CUDA out of memory")) is True
    assert time.monotonic() - started < 0.5
    assert runtime.side.failure() == {"rank": 1, "cause": "RuntimeError: CUDA out of memory"}
