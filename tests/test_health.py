"""Health watches fed log records directly: memory flatness, throughput vs baseline, stalled queues,
recompiles after warm-up (real torch.compile counters), external events, and failing watches/reporters."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from app.config import load_config
from app.telemetry import GuardedReporter, GuardedWatch, TelemetryWarning, build_telemetry
from app.telemetry.baseline import Baseline, baseline_from_compile_report
from app.telemetry.health import (
    CompileWatch,
    ExternalEvents,
    MemoryWatch,
    QueueWatch,
    ThroughputWatch,
    dynamo_counters,
)
from app.telemetry.reporter import RunStart

ROOT = Path(__file__).resolve().parents[1]


def record(step: int, **fields: Any) -> dict[str, Any]:
    """A training log record as the trainer builds it (LogLine fields + step_losses + grad_norm)."""
    base = {
        "elapsed_s": float(step),
        "step": step,
        "loss": 2.0,
        "acc": 0.5,
        "streak": 1.0,
        "lr": 1e-3,
        "noise": 0.0,
        "target_batches_per_s": 4.0,
        "drafter_batches_per_s": 4.0,
        "tokens_per_s": 20_000.0,
        "q_pre": [2],
        "q_hs": [2],
        "epoch_progress": step / 1000,
        "eta_s": 100.0,
        "memory_gb": (60.0, 70.0),
        "events": [],
        "step_losses": [2.0],
        "grad_norm": 1.0,
    }
    return {**base, **fields}


def run_watch(watch: Any, records: list[dict[str, Any]]) -> list[tuple[int, str]]:
    return [(r["step"], event) for r in records for event in watch.check(r)]


# ---- memory ---------------------------------------------------------------------------------------------


def test_flat_memory_raises_nothing_and_warmup_growth_is_ignored() -> None:
    watch = MemoryWatch(window_steps=50, growth_threshold=0.05, warmup_steps=20)
    records = [record(s, memory_gb=(30.0 + s, 40.0 + s)) for s in range(10, 30, 10)]  # grows during warm-up
    records += [record(s, memory_gb=(60.0, 70.0 + 0.01 * s)) for s in range(30, 400, 10)]  # flat after
    assert run_watch(watch, records) == []
    assert watch.active is None


def test_memory_growth_within_the_window_is_one_event_per_growth() -> None:
    watch = MemoryWatch(window_steps=50, growth_threshold=0.05, warmup_steps=0)
    reserved = {0: 70.0, 10: 70.0, 20: 72.0, 30: 75.0, 40: 75.0, 50: 75.0, 60: 80.0, 70: 80.0}
    events = run_watch(watch, [record(s, memory_gb=(60.0, r)) for s, r in reserved.items()])
    assert [step for step, _ in events] == [30, 60]
    assert "grew 7% in 30 steps (70.0 -> 75.0 GB)" in events[0][1]
    assert watch.active is not None and "80.0 GB" in watch.active


def test_slow_growth_spread_beyond_the_window_is_not_an_event() -> None:
    watch = MemoryWatch(window_steps=20, growth_threshold=0.05, warmup_steps=0)
    records = [record(s, memory_gb=(60.0, 70.0 * (1 + 0.001 * s))) for s in range(0, 200, 10)]
    assert run_watch(watch, records) == []


def test_the_memory_window_holds_growth_over_exactly_window_steps_and_no_more() -> None:
    """The edge of the window, both ways: growth spread over exactly `window_steps` is within it (an
    event), over one step more it is not; an event stays active for `window_steps` steps of flat
    memory, then clears."""
    watch = MemoryWatch(window_steps=50, growth_threshold=0.05, warmup_steps=0)
    events = run_watch(watch, [record(0, memory_gb=(60.0, 70.0)), record(50, memory_gb=(60.0, 75.0))])
    assert [step for step, _ in events] == [50] and "grew 7% in 50 steps" in events[0][1]
    assert run_watch(watch, [record(99, memory_gb=(60.0, 75.0))]) == [] and watch.active is not None
    assert run_watch(watch, [record(100, memory_gb=(60.0, 75.0))]) == [] and watch.active is None

    beyond = MemoryWatch(window_steps=50, growth_threshold=0.05, warmup_steps=0)
    assert run_watch(beyond, [record(0, memory_gb=(60.0, 70.0)), record(51, memory_gb=(60.0, 75.0))]) == []


def test_memory_an_eval_reserved_is_not_training_memory_growth() -> None:
    """The quality runs' false alarm: a periodic eval lifts reserved memory (1.2 -> 1.6 GB); the window
    holding it starts the watch again at its level, and growth after that is still an event."""
    watch = MemoryWatch(window_steps=50, growth_threshold=0.05, warmup_steps=0)
    flat = [record(s, memory_gb=(1.0, 1.2)) for s in (0, 10, 20)]
    after_eval = [record(30, memory_gb=(1.0, 1.6), evaluated=True), record(40, memory_gb=(1.0, 1.6))]
    assert run_watch(watch, flat + after_eval) == []
    events = run_watch(watch, [record(50, memory_gb=(1.0, 1.8))])
    assert [step for step, _ in events] == [50] and "(1.6 -> 1.8 GB)" in events[0][1]
    unmarked = MemoryWatch(window_steps=50, growth_threshold=0.05, warmup_steps=0)
    assert [step for step, _ in run_watch(unmarked, [*flat, record(30, memory_gb=(1.0, 1.6))])] == [30]


def test_cpu_runs_have_no_memory_to_watch() -> None:
    watch = MemoryWatch(window_steps=50, growth_threshold=0.05, warmup_steps=0)
    assert run_watch(watch, [record(s, memory_gb=None) for s in range(0, 100, 10)]) == []


# ---- throughput -----------------------------------------------------------------------------------------


def test_every_dip_against_a_step_time_baseline_is_an_event() -> None:
    """The incident's pattern: single windows at half speed between windows on speed, while the
    run's mean stays near the baseline. Each dip is an event; a slow stretch is one event."""
    watch = ThroughputWatch(
        Baseline(step_time_s=0.25, source="manifest"), slow_threshold=0.15, warmup_steps=20
    )
    rates = {10: 0.5, 20: 4.0, 30: 2.0, 40: 4.0, 50: 1.0, 60: 1.0, 70: 1.0, 80: 4.0, 90: 2.0, 100: 4.0}
    events = run_watch(
        watch, [record(s, drafter_batches_per_s=r, tokens_per_s=r * 5000) for s, r in rates.items()]
    )
    # step 10: warm-up; 30: a dip; 50-70: one slow stretch; 90: another dip
    assert [step for step, _ in events] == [30, 50, 90]
    assert (
        "10.0Ktok/s, 0.5s/step is 50% below the baseline 0.25s/step (manifest) in this log window"
        in events[0][1]
    )
    assert watch.active is None  # back on speed at step 100


def test_tokens_baseline_and_on_baseline_speed() -> None:
    watch = ThroughputWatch(Baseline(tokens_per_s=21_500), slow_threshold=0.15, warmup_steps=0)
    healthy = [record(s, tokens_per_s=20_000.0) for s in range(0, 50, 10)]
    degraded = [record(s, tokens_per_s=4_600.0) for s in range(50, 80, 10)]
    assert run_watch(watch, healthy) == []
    events = run_watch(watch, degraded)
    assert (
        len(events) == 1
        and "4.6Ktok/s" in events[0][1]
        and "79% below the baseline 21.5Ktok/s" in events[0][1]
    )


def test_baseline_from_the_compile_report_of_train_start() -> None:
    """The loaded cache entry's measured step time is the baseline; no measurement, no baseline."""
    report = {"compiled": True, "cache_path": "/cache/abc", "baseline_step_s": 0.72}
    assert baseline_from_compile_report(report) == Baseline(
        step_time_s=0.72, source="compile cache /cache/abc"
    )
    assert baseline_from_compile_report({"compiled": False, "baseline_step_s": None}) is None


# ---- queues ---------------------------------------------------------------------------------------------


def test_queues_stuck_empty_or_full_for_a_window() -> None:
    watch = QueueWatch({"q_pre": 4, "q_hs": 4}, stall_steps=30, warmup_steps=0)
    records = [record(s, q_pre=[2, 4], q_hs=[0, 1 + (s // 10) % 3]) for s in range(0, 100, 10)]
    events = run_watch(watch, records)
    assert [(step, event.split(":")[1].strip()) for step, event in events] == [
        (30, "q_pre[1] full (4/4) for 30 steps"),
        (30, "q_hs[0] empty (0/4) for 30 steps"),
    ]
    assert "drafter rank 0 is starved" in events[1][1]
    assert watch.active == "queues stuck: q_pre[1] full, q_hs[0] empty"
    moving = run_watch(watch, [record(100, q_pre=[2, 3], q_hs=[1, 1])])
    assert moving == [] and watch.active is None


def test_busy_queues_raise_nothing() -> None:
    watch = QueueWatch({"q_pre": 4, "q_hs": 4}, stall_steps=20, warmup_steps=0)
    records = [record(s, q_pre=[s % 4, (s + 1) % 4], q_hs=[1 + s % 3]) for s in range(0, 200, 10)]
    assert run_watch(watch, records) == []


def test_queue_watch_only_for_disaggregated_runs() -> None:
    colocated = load_config(ROOT / "configs" / "tiny.toml", ["telemetry.wandb=disabled"])
    _, watches = build_telemetry(colocated)
    assert not any(isinstance(w.inner, QueueWatch) for w in watches)
    split = load_config(
        ROOT / "configs" / "tiny.toml",
        [
            "telemetry.wandb=disabled",
            "topology.target_ranks=1",
            "topology.drafter_ranks=1",
            "topology.nproc_per_node=2",
        ],
    )
    _, watches = build_telemetry(split)
    assert any(isinstance(w.inner, QueueWatch) for w in watches)


# ---- compile counters -----------------------------------------------------------------------------------


def test_a_real_recompile_after_warmup_is_an_event() -> None:
    """torch.compile(dynamic=False) on a new shape recompiles: dynamo's graph counter moves after warm-up."""
    torch._dynamo.reset()
    scaled = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)
    watch = CompileWatch(warmup_steps=10)
    scaled(torch.ones(3))  # warm-up compile
    assert watch.check(record(0)) == []
    assert watch.check(record(10)) == []  # reference taken after warm-up
    scaled(torch.ones(3))
    assert watch.check(record(20)) == []  # same shape: no recompile
    scaled(torch.ones(5))
    events = watch.check(record(30))
    assert len(events) == 1 and "graphs compiled +1 after warm-up at step 30" in events[0]
    assert watch.latest["stats.unique_graphs"] >= 2
    assert set(dynamo_counters()) <= {
        "stats.unique_graphs",
        "inductor.fxgraph_cache_miss",
        "inductor.fxgraph_cache_bypass",
        "aot_autograd.autograd_cache_miss",
        "aot_autograd.autograd_cache_bypass",
        "inductor.fxgraph_cache_hit",
        "aot_autograd.autograd_cache_hit",
        "frames.total",
    }


def test_counters_fed_by_another_component() -> None:
    counters = {"inductor.fxgraph_cache_miss": 0, "inductor.fxgraph_cache_hit": 12}
    watch = CompileWatch(warmup_steps=0, read_counters=lambda: counters)
    assert watch.check(record(0)) == []
    counters["inductor.fxgraph_cache_miss"] = 2
    events = watch.check(record(10))
    assert len(events) == 1 and "inductor cache misses +2" in events[0]


def test_external_events_from_another_thread_reach_the_next_line() -> None:
    import threading

    events = ExternalEvents()
    posters = [threading.Thread(target=events.post, args=(f"compile cache: miss {i}",)) for i in range(8)]
    for thread in posters:
        thread.start()
    for thread in posters:
        thread.join()
    drained = events.check(record(10))
    assert sorted(drained) == sorted(f"compile cache: miss {i}" for i in range(8))
    assert events.check(record(20)) == []


# ---- guards ---------------------------------------------------------------------------------------------


class ExplodingWatch:
    def check(self, record: dict[str, Any]) -> list[str]:
        raise KeyError("memory_gb")


class ExplodingReporter:
    def __init__(self) -> None:
        self.calls = 0

    def on_start(self, start: RunStart) -> None:
        self.calls += 1
        raise OSError("disk full")

    def on_log(self, record: dict[str, Any]) -> None:
        self.calls += 1
        raise ValueError("cannot serialise")

    def on_checkpoint(self, path: Path, step: int) -> None:
        self.calls += 1

    def on_exit(self, reason: str, step: int) -> None:
        self.calls += 1
        raise RuntimeError("late failure")


def test_a_failing_watch_is_a_warning_and_no_events() -> None:
    watch = GuardedWatch(ExplodingWatch())
    with pytest.warns(TelemetryWarning, match=r"ExplodingWatch\.check failed \(KeyError"):
        assert watch.check(record(1)) == []


def test_a_failing_reporter_is_a_warning_then_switched_off() -> None:
    inner = ExplodingReporter()
    reporter = GuardedReporter(inner)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reporter.on_start(RunStart(Path("."), {}, {}, {}))
        reporter.on_checkpoint(Path("."), 1)  # a success resets the count of failures in a row
        for step in range(10):
            reporter.on_log(record(step))
        reporter.on_exit("completed", 10)
    messages = [str(w.message) for w in caught if issubclass(w.category, TelemetryWarning)]
    assert messages[0] == "ExplodingReporter.on_start failed (OSError: disk full); training continues"
    assert "ExplodingReporter: switched off after 5 failures in a row" in messages
    assert reporter.disabled and inner.calls == 2 + 5  # nothing is called once it is off
