"""`dflash status`'s lines, one function at a time: state, progress, throughput, compile, code, health,
what changed, checkpoint and the next steps, from status dicts as status.json holds them (the export and
checkpoint of the next steps are real files). The run directories and the whole document:
tests/test_status_report.py."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

from app.env import Difference
from app.telemetry.status_report import (
    Comparison,
    _change_lines,
    _checkpoint_lines,
    _code_lines,
    _compile_line,
    _exported_after,
    _health_lines,
    _progress_line,
    _stale_seconds,
    _state_line,
    _throughput_line,
    next_steps,
)


def ago(seconds: float) -> str:
    return (datetime.now(UTC) - timedelta(seconds=seconds)).isoformat(timespec="seconds")


# ---- sections ----------------------------------------------------------------------------------------


def test_the_state_line_of_each_state() -> None:
    assert _state_line({"state": "completed", "progress": {"step": 7}, "finished_at": "T1"}, None, None) == (
        "completed at step 7 (T1)"
    )
    assert _state_line({"state": "stopped", "progress": {}}, None, None) == "stopped at step None (None)"
    failed = {"state": "failed", "progress": {"step": 3}, "exit_reason": "failed: NonFiniteLoss: nan"}
    assert _state_line(failed, None, None) == "FAILED at step 3: NonFiniteLoss: nan"
    assert _state_line({"state": "failed", "progress": {"step": 3}}, None, None) == "FAILED at step 3: "
    running = {"state": "running", "progress": {"step": 12}, "updated_at": ago(300)}
    assert _state_line(running, None, None) == "running, step 12, status updated 5m ago"
    assert _state_line(running, 1200.0, None) == (
        "running, step 12, status updated 5m ago -- STALE: no update for 20m, the process may be dead"
    )
    assert _state_line({"state": "running", "progress": {"step": 1}}, None, None) == (
        "running, step 1, status updated 0s ago"
    )
    assert _state_line(running, 1200.0, "its process 9 on box is gone") == (
        "STOPPED without an exit at step 12 (killed: SIGKILL, out of memory or a lost node): its process 9 on "
        "box is gone; status last updated 5m ago"
    )
    assert _state_line({"state": "running", "progress": {"step": 1}}, None, "gone").endswith(
        "gone; status last updated 0s ago"
    )


def test_the_progress_line_says_step_epoch_eta_loss_and_eval() -> None:
    assert _progress_line({}) == "step 0"
    assert _progress_line({"progress": {"step": 5, "total_steps": 0}}) == "step 5"
    progress = {"step": 5, "total_steps": 100, "epoch_progress": 0.125, "eta_s": 3600.0}
    assert _progress_line({"state": "completed", "progress": progress, "goal": {"epochs": 2}}) == (
        "step 5 of 100, epoch 0.12 of 2"
    )
    assert (
        _progress_line({"state": "running", "progress": progress})
        == "step 5 of 100, epoch 0.12 of ?, ETA 60m"
    )
    assert _progress_line({"state": "running", "progress": {"step": 1, "eta_s": 0.0}}) == "step 1, ETA 0s"
    loss = {"step": 2, "loss": 1.23456, "acc": 0.5, "streak": 1.255}
    assert _progress_line({"progress": loss}) == "step 2; loss 1.2346 acc 0.500 streak 1.25"
    assert (
        _progress_line({"progress": {"step": 2, "loss": 0.0}}) == "step 2; loss 0.0000 acc 0.000 streak 0.00"
    )
    evaluated = {"tau": 2.5, "tree_tau": 3.25, "tree_budget": 64, "step": 4,
                 "domains": {"code": {"tau": 2.0, "tree_tau": 3.0}, "math": {"tau": 1.5}}}  # fmt: skip
    assert _progress_line({"progress": {"step": 4}, "eval": evaluated}) == (
        "step 4; eval tau 2.500, tree tau 3.250 at budget 64 (step 4); per domain: code 2.00 (tree 3.00), math 1.50"
    )
    assert _progress_line({"progress": {"step": 4}, "eval": {"tree_tau": 0.0, "domains": {"x": {}}}}) == (
        "step 4; eval tau 0.000, tree tau 0.000 at budget None (step None); per domain: x 0.00"
    )
    assert _progress_line({"progress": {"step": 4}, "eval": {"tau": 1.0, "step": 4}}) == (
        "step 4; eval tau 1.000 (step 4)"
    )


def test_the_compile_line_says_eager_cache_hit_or_miss() -> None:
    assert _compile_line(None) == "not reported (a run from before compile reports)"
    assert _compile_line({}) == "not reported (a run from before compile reports)"
    assert (
        _compile_line({"compiled": False, "device": "cpu"})
        == "eager on cpu (no compiled kernels on this device)"
    )
    assert _compile_line({"compiled": False}) == "eager on ? (no compiled kernels on this device)"
    hit = {"compiled": True, "key": "3f9c", "cache_path": "/c/3f9c", "cache_loaded": True, "warmup_s": 8.94,
           "warmup_counters": {"fxgraph_cache_miss": 2, "autograd_cache_miss": 3}}  # fmt: skip
    assert _compile_line(hit) == "cache 3f9c loaded from /c/3f9c; warm-up 8.9s with 5 cache misses"
    assert _compile_line({"compiled": True, "key": "k", "warmup_counters": {"autograd_cache_miss": 1}}) == (
        "NO cache for key k: compiled from scratch; warm-up 0.0s with 1 cache misses"
    )
    assert _compile_line(
        {"compiled": True, "key": "k", "warmup_counters": {"fxgraph_cache_miss": 4}}
    ).endswith("with 4 cache misses")
    assert _compile_line({"compiled": True, "key": "k"}).endswith("with 0 cache misses")


def test_the_throughput_line_against_its_baseline_and_the_last_good_run() -> None:
    assert _throughput_line({}, None) == "no log line yet"
    assert _throughput_line({"throughput": {"tokens_per_s": None}}, None) == "no log line yet"
    assert _throughput_line({"throughput": {"tokens_per_s": 0.0, "step_time_s": 0.0}}, None) == (
        "0.0Ktok/s (mean of the last ? log lines)"
    )
    throughput = {"tokens_per_s": 4600.0, "step_time_s": 1.1111, "mfu": 0.125, "log_lines": 5,
                  "baseline": {"source": "compile cache k"}, "vs_baseline": 0.225}  # fmt: skip
    good = Comparison(Path("/runs/good"), "x", status={"throughput": {"tokens_per_s": 20_000.0}})
    assert _throughput_line({"throughput": throughput}, good) == (
        "4.6Ktok/s, 1.11 s/step, mfu 12.5% (mean of the last 5 log lines); 22% of the baseline "
        "(compile cache k); last good run: 20.0Ktok/s (23% of it)"
    )
    assert _throughput_line({"throughput": {**throughput, "mfu": 0.0, "vs_baseline": 0.0}}, None) == (
        "4.6Ktok/s, 1.11 s/step, mfu 0.0% (mean of the last 5 log lines); 0% of the baseline (compile cache k)"
    )
    plain = {"tokens_per_s": 4600.0, "baseline": {"source": "s"}, "vs_baseline": None}
    assert _throughput_line({"throughput": plain}, Comparison(Path("/g"), "x")) == (
        "4.6Ktok/s (mean of the last ? log lines)"
    )
    assert _throughput_line({"throughput": {**plain, "baseline": None, "vs_baseline": 1.0}}, None) == (
        "4.6Ktok/s (mean of the last ? log lines)"
    )
    no_speed = Comparison(Path("/g"), "x", status={"throughput": {"tokens_per_s": None}})
    assert _throughput_line({"throughput": plain}, no_speed) == "4.6Ktok/s (mean of the last ? log lines)"
    # K is a thousand tokens, here and for the last good run: 21,560 tok/s is 21.6K, not 21.5K.
    same = Comparison(Path("/g"), "x", status={"throughput": {"tokens_per_s": 21_560.0}})
    assert _throughput_line({"throughput": {"tokens_per_s": 21_560.0}}, same) == (
        "21.6Ktok/s (mean of the last ? log lines); last good run: 21.6Ktok/s (100% of it)"
    )


def test_the_code_line_names_up_to_eight_changed_files() -> None:
    assert _code_lines({}) == [] and _code_lines({"changed": None, "revision": "r"}) == []
    assert _code_lines({"changed": ["app/a.py"], "revision": "abc"}) == [
        "code: 1 file differs from commit abc: app/a.py"
    ]
    eight = [f"f{i}" for i in range(8)]
    assert _code_lines({"changed": eight, "revision": "abc"}) == [
        "code: 8 files differ from commit abc: f0, f1, f2, f3, f4, f5, f6, f7"
    ]
    assert _code_lines({"changed": [*eight, "f8", "f9"]}) == [
        "code: 10 files differ from commit None: f0, f1, f2, f3, f4, f5, f6, f7 and 2 more"
    ]


def difference(field: str, breaking: bool) -> Difference:
    return Difference(field, "old", None, breaking, f"why {field}")


def test_the_health_lines_show_drift_conditions_and_the_last_ten_events() -> None:
    events = [{"step": step, "message": f"m{step}"} for step in range(1, 13)]
    status = {
        "health": {"state": "degraded", "active": ["memory: grew"], "events": events, "event_count": 12}
    }
    assert _health_lines(status, []) == [
        "health: DEGRADED (12 events)", "  active: memory: grew", "  (the last 10 of 12)",
        *(f"  step {step}: m{step}" for step in range(3, 13)),
    ]  # fmt: skip
    ten = {"health": {"state": "healthy", "events": events[:10], "event_count": 10}}
    assert _health_lines(ten, [])[:2] == ["health: HEALTHY (10 events)", "  step 1: m1"]
    eleven = {"health": {"state": "healthy", "events": events[1:11], "event_count": 11}}
    assert _health_lines(eleven, [])[:3] == [
        "health: HEALTHY (11 events)",
        "  (the last 10 of 11)",
        "  step 2: m2",
    ]
    one = {"health": {"state": "healthy", "events": events[:1], "event_count": 1}}
    assert _health_lines(one, []) == ["health: HEALTHY (1 event)", "  step 1: m1"]
    assert _health_lines({}, []) == ["health: ? (0 events)"]
    own = Comparison(Path("/r"), "x", own_run=True)
    other = Comparison(Path("/g"), "x")
    assert _health_lines({"health": {"state": "healthy"}}, [own, other]) == [
        "health: DEGRADED (0 events)",
        "  active: the environment differs from this run's last good start (breaking; see what changed)",
        "  active: the environment differs from the last good run's (breaking; see what changed)",
    ]
    assert _health_lines({"health": {"state": "failed"}}, [other])[0] == "health: FAILED (0 events)"


def test_the_change_lines_list_breaking_cosmetic_and_config_differences() -> None:
    assert _change_lines(None) == [
        "what changed: no completed, healthy run next to this one to compare with; name one with --against RUN_DIR"
    ]
    same = Comparison(Path("/runs/good"), "newest completed healthy sibling")
    assert _change_lines(same) == [
        "what changed since the last good run /runs/good (newest completed healthy sibling):",
        "  environment: same training stack",
        "  config: same settings",
    ]
    changed = Comparison(
        Path("/runs/good"), "--against", problem="no config",
        environment=[difference("torch.version", True), difference("host.hostname", False),
                     difference("python.executable", False)],
        config=[("train.lr", 0.003, 0.01)],
    )  # fmt: skip
    assert _change_lines(changed) == [
        "what changed since the last good run /runs/good (--against):",
        "  (incomplete: no config)",
        "  environment: 1 breaking difference",
        "    torch.version: old -> (absent) (why torch.version)",
        "    cosmetic: host.hostname, python.executable",
        "  config: 1 setting differs",
        "    train.lr: 0.003 -> 0.01",
    ]
    two = Comparison(Path("/r"), "start 1", own_run=True, environment=[difference("a", True), difference("b", True)],
                     config=[("x", None, [1]), ("y", {"k": 1}, 2)])  # fmt: skip
    assert _change_lines(two) == [
        "what changed since this run's last good start (start 1):",
        "  environment: 2 breaking differences",
        "    a: old -> (absent) (why a)",
        "    b: old -> (absent) (why b)",
        "  config: 2 settings differ",
        "    x: (absent) -> [1]",
        '    y: {"k": 1} -> 2',
    ]


def test_the_checkpoint_lines_and_the_s3_sync() -> None:
    assert _checkpoint_lines({}) == ["last checkpoint: none yet"]
    checkpoint = {"path": "/r/checkpoints/step_00000040", "step": 40, "at": "T4"}
    storage = {"s3_uri": "s3://b/r", "synced_checkpoint": {"name": "step_00000040", "at": "T5"},
               "pending": ["step_00000050", "step_00000060"], "last_error": "timeout"}  # fmt: skip
    assert _checkpoint_lines({"last_checkpoint": checkpoint, "storage": storage}) == [
        "last checkpoint: /r/checkpoints/step_00000040 (step 40, T4)",
        "  S3 s3://b/r: step_00000040 synced (T5); pending: step_00000050, step_00000060; last error: timeout",
    ]
    assert _checkpoint_lines({"storage": {"s3_uri": "s3://b/r", "pending": [], "last_error": None}}) == [
        "last checkpoint: none yet",
        "  S3 s3://b/r: nothing synced by this attempt yet",
    ]


# ---- what to do next ---------------------------------------------------------------------------------

CHECKPOINT = {"path": "/r/checkpoints/step_00000040", "step": 40, "at": "T"}


def test_the_next_step_after_a_failure_a_stop_a_death_or_a_stale_run(tmp_path: Path) -> None:
    run = tmp_path / "my run"
    resume = f"`dflash train '{run}' --resume` (continues from step 40)"
    nan = {"state": "failed", "exit_reason": "failed: NonFiniteLoss: nan", "last_checkpoint": CHECKPOINT}
    assert next_steps(run, nan, None, None) == [
        "the loss became NaN/inf at the step and batch named above: inspect those samples, or lower the "
        f"learning rate: `dflash train '{run}' 'train.lr=<lower>' --resume` (continues from step 40)"
    ]
    assert next_steps(run, {"state": "failed", "exit_reason": "failed: OSError"}, None, None) == [
        "fix the cause above, then start the run again"
    ]
    assert next_steps(run, {"state": "failed", "last_checkpoint": CHECKPOINT}, None, None) == [
        f"fix the cause above, then {resume}"
    ]
    assert next_steps(run, {"state": "stopped", "last_checkpoint": CHECKPOINT}, None, None, "gone") == [
        f"stopped by a signal after a checkpoint: {resume}"
    ]
    running = {"state": "running", "last_checkpoint": CHECKPOINT, "progress": {"eta_s": 600.0}}
    assert next_steps(run, running, None, 1000.0, "gone") == [
        f"the training process died without an exit: {resume}"
    ]
    assert next_steps(run, running, None, 1000.0) == [
        f"check whether the training process is alive; if it died, {resume}"
    ]
    assert next_steps(run, {**running, "state": "completed"}, None, 1000.0) != next_steps(
        run, running, None, 1000.0
    )
    assert next_steps(run, running, None, None) == ["nothing: the run is healthy; expected to finish in 10m"]
    assert next_steps(run, {"state": "running", "progress": {"eta_s": 0}}, None, None) == [
        "nothing: the run is healthy"
    ]
    assert next_steps(run, {"state": "running"}, None, None) == ["nothing: the run is healthy"]
    assert next_steps(run, {"state": "weird"}, None, None) == []


def test_health_events_and_a_breaking_drift_bring_their_advice(tmp_path: Path) -> None:
    run = tmp_path / "run"
    events = [{"step": 1, "message": "throughput: slow"}, {"step": 2, "message": "memory: grew"}]
    status = {"state": "completed", "health": {"events": events, "active": ["queues: q_hs[0] empty"]}}
    drift = Comparison(Path("/runs/good"), "x", environment=[difference("torch.version", True),
                                                             difference("host.hostname", False)])  # fmt: skip
    assert next_steps(run, status, drift, None) == [
        "the environment differs from /runs/good in 1 breaking way(s): rebuild it from uv.lock "
        "(`./uvw sync --locked`, or the image) unless the change is intended; "
        "`dflash doctor --against /runs/good` shows the details",
        "throughput is below its baseline: check that the compile cache matched and loaded with 0 misses "
        "(the compile events above), that the GPUs are the ones the cache was built on, and `dflash doctor`",
        "GPU memory is not flat: look for changing shapes or recompiles; a leak grows until OOM",
        "a pipeline stage is starved or blocked: rebalance topology.target_ranks : drafter_ranks "
        "(`dflash bench` reports each stage's capacity)",
    ]
    compiled = {"state": "running", "health": {"active": ["compile: recompiled"]}}
    assert next_steps(run, compiled, None, None) == [
        "kernels recompiled or missed the cache after warm-up: rebuild it for this stack (`just build-cache`)"
    ]
    # An event without a message adds nothing; an active condition alone brings its advice.
    joined = {"state": "running", "health": {"events": [{"message": "a"}, {}], "active": ["memory: x"]}}
    assert next_steps(run, joined, None, None)[0].startswith("GPU memory is not flat")
    cosmetic = Comparison(Path("/runs/good"), "x", environment=[difference("host.hostname", False)])
    assert next_steps(run, {"state": "running"}, cosmetic, None) == ["nothing: the run is healthy"]


def test_a_finished_run_is_told_to_export_unless_its_export_is_newer_than_its_checkpoint(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "step_00000040"
    checkpoint.mkdir(parents=True)
    status = {"state": "completed", "last_checkpoint": {"path": str(checkpoint), "step": 40, "at": "T"}}
    export_hint = (
        f"export the drafter: `dflash export {run} --out {run / 'export'}`; measure tau: `dflash eval {run}`"
    )
    assert next_steps(run, status, None, None) == [export_hint]
    weights = run / "export" / "model.safetensors"
    weights.parent.mkdir()
    weights.write_bytes(b"w")
    os.utime(checkpoint, (1000, 1000))
    os.utime(weights, (1000, 1000))  # written in the same second as the checkpoint: up to date
    assert next_steps(run, status, None, None) == [
        f"serve the drafter exported in {run / 'export'}; measure tau: `dflash eval {run}`"
    ]
    os.utime(weights, (999, 999))
    assert next_steps(run, status, None, None) == [export_hint]
    assert _exported_after(run / "export", None)  # no checkpoint to be older than
    assert _exported_after(run / "export", {"path": str(tmp_path / "deleted")})
    assert not _exported_after(tmp_path / "none", None)
    (run / "export" / "model.safetensors").unlink()
    (run / "export" / "model.safetensors").mkdir()  # not a file: no weights
    assert not _exported_after(run / "export", None)


def test_a_running_run_is_stale_after_fifteen_minutes_without_an_update() -> None:
    assert _stale_seconds({"state": "running", "updated_at": ago(14 * 60)}) is None
    stale = _stale_seconds({"state": "running", "updated_at": ago(15 * 60 + 5)})
    assert stale is not None and 905 <= stale < 915
    assert _stale_seconds({"state": "running", "updated_at": ago(15 * 61 - 10)}) is not None
    assert _stale_seconds({"state": "completed", "updated_at": ago(3600)}) is None
    assert _stale_seconds({"state": "running"}) is None
