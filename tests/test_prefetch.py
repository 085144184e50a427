"""The data thread that prepares batches ahead of the step (`app.pipeline.prefetch.Prefetcher`)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from app.pipeline.prefetch import POLL_S, Prefetcher

CPU = torch.device("cpu")


def test_results_come_in_order_then_none_and_at_most_depth_wait() -> None:
    prepared: list[int] = []

    def prepare(item: int) -> int:
        prepared.append(item)
        return item * 10

    prefetcher = Prefetcher(iter(range(6)), prepare, depth=2, device=CPU)
    deadline = time.monotonic() + 5
    while prefetcher.waiting() < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(3 * POLL_S)
    # two waiting in the queue, a third prepared and held by the thread: no further
    assert prefetcher.waiting() == 2 and len(prepared) == 3
    assert [prefetcher.next() for _ in range(6)] == [0, 10, 20, 30, 40, 50]
    assert prefetcher.next() is None


def test_an_error_in_the_thread_is_raised_to_the_consumer_after_the_good_results() -> None:
    def prepare(item: int) -> int:
        if item == 2:
            raise ValueError("record 2 is bad")
        return item

    prefetcher = Prefetcher(iter(range(5)), prepare, depth=4, device=CPU)
    assert [prefetcher.next(), prefetcher.next()] == [0, 1]
    with pytest.raises(ValueError, match="record 2 is bad"):
        prefetcher.next()


def test_poll_runs_while_waiting_and_may_give_up() -> None:
    release = threading.Event()

    def prepare(item: int) -> int:
        release.wait(10)
        return item

    polls = []

    def poll() -> None:
        polls.append(time.monotonic())
        if len(polls) == 2:
            raise TimeoutError("the consumer gave up")

    prefetcher = Prefetcher(iter(range(3)), prepare, depth=1, device=CPU)
    with pytest.raises(TimeoutError, match="gave up"):
        prefetcher.next(poll=poll)
    release.set()
    prefetcher.close()


def test_close_ends_the_thread_without_draining_the_items() -> None:
    prepared: list[int] = []
    prefetcher = Prefetcher(
        iter(range(1000)), lambda item: prepared.append(item) or item, depth=1, device=CPU
    )
    assert prefetcher.next() == 0
    prefetcher.close()
    prefetcher._thread.join(timeout=5 * POLL_S)
    assert not prefetcher._thread.is_alive() and len(prepared) < 10
