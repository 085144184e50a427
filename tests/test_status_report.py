"""`dflash status`'s report in-process, on run directories written by the tests (status.json,
environment.jsonl, config.json, a heartbeat), no trainer: which run is the last good one, the comparison
with it and with the run's own last good start, and the whole document. Each line's wording and the next
steps: tests/test_status_report_lines.py."""

from __future__ import annotations

import copy
import json
import os
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from app.errors import UserError
from app.telemetry.liveness import HEARTBEAT_FILE
from app.telemetry.status import SCHEMA_VERSION, STATUS_FILE
from app.telemetry.status_report import (
    _config_differences,
    _flat_config,
    _flatten,
    _shown,
    compare_runs,
    find_last_good_run,
    is_good,
    own_comparison,
    render_status,
    stack_was_right,
)

# The smallest fingerprint today's checks find no problem in (packages checked against uv.lock).
FINGERPRINT: dict[str, Any] = {
    "schema": 1,
    "host": {"hostname": "box-a", "machine": "x86_64"},
    "python": {"version": "3.11.9"},
    "torch": {"version": "2.9.0+cu128"},
    "gpus": {},
    "lock": {"sha256": "ab12"},
    "packages": {"checked": True, "stray": [], "mismatched": [], "duplicates": []},
    "project": {"revision": "0123456789ab", "changed": []},
}
CONFIG = {"train": {"lr": 0.003, "output_dir": "/runs/a"}, "telemetry": {"run_name": "a"}, "seed": 1}


def fingerprint(**sections: Any) -> dict[str, Any]:
    """FINGERPRINT with whole sections replaced."""
    return {**copy.deepcopy(FINGERPRINT), **sections}


def start(number: int, *, step: int = 0, accepted: list[str] | None = None, config: Any = CONFIG,
          **sections: Any) -> dict[str, Any]:  # fmt: skip
    return {"start": number, "at": f"2026-01-0{number}T00:00:00+00:00", "step": step,
            "accepted": accepted or [], "fingerprint": fingerprint(**sections), "config": config}  # fmt: skip


def make_run(
    directory: Path,
    state: str = "completed",
    health: str = "healthy",
    finished_at: str | None = "2026-01-02T00:00:00+00:00",
    starts: list[dict[str, Any]] | None = None,
    config: dict[str, Any] | None = CONFIG,
    **fields: Any,
) -> Path:
    """A run directory as the trainer leaves it: status.json, environment.jsonl, config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    status = {
        "schema": SCHEMA_VERSION, "run_name": directory.name, "run_dir": str(directory), "state": state,
        "finished_at": finished_at, "health": {"state": health, "active": [], "events": [], "event_count": 0},
        "progress": {"step": 10}, **fields,
    }  # fmt: skip
    (directory / STATUS_FILE).write_text(json.dumps(status))
    if starts is None:
        starts = [start(1)]
    (directory / "environment.jsonl").write_text("".join(json.dumps(entry) + "\n" for entry in starts))
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))
    return directory


def ago(seconds: float) -> str:
    return (datetime.now(UTC) - timedelta(seconds=seconds)).isoformat(timespec="seconds")


# ---- which run is the last good one ----------------------------------------------------------------


def test_a_good_run_is_completed_and_healthy() -> None:
    assert is_good({"state": "completed", "health": {"state": "healthy"}})
    assert not is_good({"state": "running", "health": {"state": "healthy"}})
    assert not is_good({"state": "completed", "health": {"state": "degraded"}})
    assert not is_good({"state": "completed"})


def test_the_last_good_run_is_the_newest_good_sibling_with_a_right_stack(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    this = make_run(runs / "this", finished_at="2026-03-01T00:00:00+00:00")  # itself is never its reference
    (runs / "a-no-status").mkdir()  # sorted first: an unreadable sibling is skipped, not the end
    (runs / "a-file").write_text("not a run")
    make_run(runs / "b-older", finished_at="2026-01-02T00:00:00+00:00")
    make_run(runs / "c-newest", finished_at="2026-01-05T00:00:00+00:00")
    make_run(runs / "d-unfinished", finished_at=None)
    make_run(runs / "e-degraded", health="degraded", finished_at="2026-02-01T00:00:00+00:00")
    make_run(runs / "f-running", state="running", finished_at="2026-02-01T00:00:00+00:00")
    make_run(runs / "g-edited", finished_at="2026-02-01T00:00:00+00:00",
             starts=[start(1, project={"changed": ["app/train/step.py"]})])  # fmt: skip
    assert find_last_good_run(runs / "a-no-status" / ".." / "this") == runs / "c-newest"
    assert find_last_good_run(this) == runs / "c-newest"
    alone = make_run(tmp_path / "alone" / "run")
    assert find_last_good_run(alone) is None
    make_run(tmp_path / "alone" / "unfinished", finished_at=None)
    assert find_last_good_run(alone) == tmp_path / "alone" / "unfinished"


def test_a_stack_is_right_when_every_start_was_good_clean_and_alike(tmp_path: Path) -> None:
    def right(name: str, starts: list[dict[str, Any]] | None) -> bool:
        return stack_was_right(make_run(tmp_path / name, starts=starts))

    assert right("one", [start(1)])
    assert right(
        "resumed-alike", [start(1), start(2, step=5, host={"hostname": "box-b", "machine": "x86_64"})]
    )
    assert not right("none", [])
    assert not right("accepted", [start(1), start(2, accepted=["torch.version ..."])])
    assert not right("accepted-first", [start(1, accepted=["torch.version ..."]), start(2)])
    assert not right("edited-app", [start(1), start(2, project={"changed": ["docs/x.md", "app/x.py"]})])
    assert right("edited-docs", [start(1, project={"changed": ["docs/x.md", "tests/app/y.py"]})])
    assert right("no-project", [start(1, project=None)])
    assert not right("drifted", [start(1), start(2, torch={"version": "2.11.0"})])
    # Every later start is held against the first one, not against each other.
    assert not right("drifted-twice", [start(1), start(2, torch={"version": "2.11.0"}),
                                       start(3, torch={"version": "2.11.0"})])  # fmt: skip
    # Today's checks on the newest start: packages never checked against uv.lock is a problem.
    unchecked = {"checked": False}
    assert not right("unchecked", [start(1), start(2, packages=unchecked)])
    broken = tmp_path / "broken"
    make_run(broken)
    (broken / "environment.jsonl").write_text("not json\n")
    assert not stack_was_right(broken)
    legacy = make_run(tmp_path / "legacy", starts=[])  # a run from before the record: fingerprint.json
    (legacy / "environment.jsonl").unlink()
    assert not stack_was_right(legacy)
    (legacy / "fingerprint.json").write_text(json.dumps(FINGERPRINT))
    assert stack_was_right(legacy)


# ---- comparisons -------------------------------------------------------------------------------------


def test_a_run_of_one_start_or_no_good_earlier_start_has_no_own_comparison(tmp_path: Path) -> None:
    assert own_comparison(make_run(tmp_path / "one", starts=[start(1)])) is None
    assert own_comparison(make_run(tmp_path / "none", starts=[])) is None
    drifted = [start(1, accepted=["x"]), start(2)]
    assert own_comparison(make_run(tmp_path / "drifted", starts=drifted)) is None
    broken = make_run(tmp_path / "broken")
    (broken / "environment.jsonl").write_text("{\n")
    assert own_comparison(broken) is None


def test_a_resume_is_compared_with_its_last_good_start_before_the_newest(tmp_path: Path) -> None:
    newer_config = {**CONFIG, "train": {"lr": 0.01, "output_dir": "/runs/b"}, "seed": None}
    starts = [start(1, torch={"version": "2.8.0"}), start(2, step=40),
              start(3, step=80, accepted=["torch.version ..."], torch={"version": "2.11.0"}, config=newer_config)]  # fmt: skip
    run = make_run(tmp_path / "run", starts=starts)
    own = own_comparison(run)
    assert own is not None and own.own_run and own.against == run and own.problem is None
    assert own.chosen_by == (
        "start 2 (step 40, 2026-01-02T00:00:00+00:00), to the newest: start 3 (step 80, 2026-01-03T00:00:00+00:00)"
    )
    assert [(d.field, d.old, d.new, d.breaking) for d in own.environment] == [
        ("torch.version", "2.9.0+cu128", "2.11.0", True)
    ]
    assert own.config == [("seed", 1, None), ("train.lr", 0.003, 0.01)]  # output_dir always differs
    assert own.status is None
    # Two good starts: the newest is compared with the one before it.
    own = own_comparison(make_run(tmp_path / "two", starts=[start(1), start(2, step=9)]))
    assert own is not None and own.chosen_by.startswith("start 1 (step 0, ")
    assert own.environment == [] and own.config == []
    # A start recorded without its config: the comparison says it is incomplete.
    own = own_comparison(make_run(tmp_path / "old", starts=[start(1, config=None), start(2)]))
    assert own is not None and own.problem == "a start of the record holds no config" and own.config == []
    # Its target unknown, a fast-kernel change of such a start stays breaking (the target may be hybrid).
    kernels = {"fla": {"present": True, "version": "0.6.0", "error": None}}
    own = own_comparison(
        make_run(tmp_path / "old2", starts=[start(1), start(2, config=None, fast_kernels=kernels)])
    )
    assert own is not None and own.problem == "a start of the record holds no config"
    assert [(d.field, d.breaking) for d in own.environment] == [
        ("fast_kernels.fla.present", True), ("fast_kernels.fla.version", True)
    ]  # fmt: skip


def test_another_run_is_compared_at_its_last_good_start_with_this_runs_newest(tmp_path: Path) -> None:
    against = make_run(tmp_path / "good", throughput={"tokens_per_s": 20_000.0},
                       starts=[start(1, torch={"version": "2.7.0"}), start(2, accepted=["x"])])  # fmt: skip
    run = make_run(tmp_path / "run", config={**CONFIG, "train": {"lr": 0.01, "output_dir": "/r"}, "x": [1]},
                   starts=[start(1, torch={"version": "2.8.0"}), start(2, transformers="4.57.0")])  # fmt: skip
    comparison = compare_runs(run, against, "--against")
    assert comparison.against == against and comparison.chosen_by == "--against" and not comparison.own_run
    assert comparison.status is not None and comparison.status["throughput"] == {"tokens_per_s": 20_000.0}
    assert [(d.field, d.old, d.new) for d in comparison.environment] == [
        ("torch.version", "2.7.0", "2.9.0+cu128"), ("transformers", None, "4.57.0")
    ]  # fmt: skip
    assert comparison.config == [("train.lr", 0.003, 0.01), ("x", None, [1])]
    assert comparison.problem is None


def test_a_comparison_missing_its_records_says_what_is_missing(tmp_path: Path) -> None:
    against = tmp_path / "gone"
    against.mkdir()
    run = make_run(tmp_path / "run", config=None)
    comparison = compare_runs(run, against, "why")
    assert comparison.status is None and comparison.environment == [] and comparison.config == []
    assert comparison.problem == (
        f"run directory {against} has no fingerprint.json; expected a fingerprint saved by `dflash doctor "
        f"--save` or a run; {against / 'config.json'}: no resolved config recorded"
    )
    make_run(against, config=None)
    (run / "config.json").write_text(json.dumps(CONFIG))
    assert (
        compare_runs(run, against, "why").problem == f"{against / 'config.json'}: no resolved config recorded"
    )
    (against / "config.json").write_text("{")
    problem = compare_runs(run, against, "why").problem
    assert problem is not None and problem.startswith(f"{against / 'config.json'}: unreadable (Expecting")


def test_config_differences_are_sorted_and_leave_out_the_keys_that_always_differ() -> None:
    before = {
        "b": 1,
        "a": 2,
        "same": 3,
        "train.output_dir": "x",
        "telemetry.run_name": "x",
        "storage.s3_uri": "x",
    }
    after = {
        "b": 2,
        "c": 4,
        "same": 3,
        "train.output_dir": "y",
        "telemetry.run_name": "y",
        "storage.s3_uri": "y",
    }
    assert _config_differences(before, after) == [("a", 2, None), ("b", 1, 2), ("c", None, 4)]


def test_a_config_is_flattened_to_section_dot_field(tmp_path: Path) -> None:
    assert _flatten({"train": {"lr": 1, "arch": {"x": 1}}, "seed": 3}) == {
        "train.lr": 1, "train.arch": {"x": 1}, "seed": 3
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({"a": {"b": 1}}))
    assert _flat_config(tmp_path) == {"a.b": 1}
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").mkdir()
    with pytest.raises(UserError, match=r"config\.json: unreadable \(\[Errno 21\] Is a directory"):
        _flat_config(tmp_path)


def test_values_are_shown_absent_as_json_or_as_text() -> None:
    assert _shown(None) == "(absent)"
    assert _shown([1, "a"]) == '[1, "a"]' and _shown({"k": None}) == '{"k": null}'
    assert _shown(0) == "0" and _shown("x y") == "x y" and _shown(False) == "False"


# ---- the whole document ------------------------------------------------------------------------------


def test_a_resumed_run_in_another_stack_is_degraded_against_both_references(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    good = make_run(
        runs / "good", throughput={"tokens_per_s": 20_000.0}, finished_at="2026-01-01T00:00:00+00:00"
    )
    checkpoint = runs / "run" / "checkpoints" / "step_00000040"
    run = make_run(
        runs / "run", finished_at="2026-01-09T00:00:00+00:00", goal={"text": "train a drafter"},
        progress={"step": 40, "total_steps": 40, "loss": 1.5, "acc": 0.5, "streak": 1.0},
        throughput={"tokens_per_s": 10_000.0, "log_lines": 5}, compile={"compiled": False, "device": "cpu"},
        fingerprint={"changed": ["app/a.py"], "revision": "abc"}, memory_gb=[60.04, 70.06],
        attempts=[{"exit_reason": "stopped", "step": 20, "finished_at": "T2"},
                  {"exit_reason": "failed: X", "step": 30}],
        last_checkpoint={"path": str(checkpoint), "step": 40, "at": "T9"},
        starts=[start(1), start(2, step=20, accepted=["torch ..."], torch={"version": "2.11.0"})],
        config={**CONFIG, "train": {"lr": 0.01, "output_dir": "/x"}}, run_dir="/data/runs/run",
    )  # fmt: skip
    torch_line = (
        "    torch.version: 2.9.0+cu128 -> 2.11.0 (another torch build: other kernels, compile cache invalid)"
    )
    text, healthy = render_status(run)
    assert not healthy
    assert text.splitlines() == [
        "run run (/data/runs/run)",  # where the run started (the directory was moved since)
        "goal: train a drafter",
        "state: completed at step 40 (2026-01-09T00:00:00+00:00)",
        "progress: step 40 of 40; loss 1.5000 acc 0.500 streak 1.00",
        "throughput: 10.0Ktok/s (mean of the last 5 log lines); last good run: 20.0Ktok/s (50% of it)",
        "compile: eager on cpu (no compiled kernels on this device)",
        "code: 1 file differs from commit abc: app/a.py",
        "memory: 60.0 GB allocated / 70.1 GB reserved",
        "earlier attempt: stopped at step 20 (T2)",
        "earlier attempt: failed: X at step 30 (?)",
        "",
        "health: DEGRADED (0 events)",
        "  active: the environment differs from this run's last good start (breaking; see what changed)",
        "  active: the environment differs from the last good run's (breaking; see what changed)",
        "",
        f"what changed since the last good run {good} (newest completed healthy sibling):",
        "  environment: 1 breaking difference",
        torch_line,
        "  config: 1 setting differs",
        "    train.lr: 0.003 -> 0.01",
        "what changed since this run's last good start (start 1 (step 0, 2026-01-01T00:00:00+00:00), "
        "to the newest: start 2 (step 20, 2026-01-02T00:00:00+00:00)):",
        "  environment: 1 breaking difference",
        torch_line,
        "  config: same settings",
        "",
        f"last checkpoint: {checkpoint} (step 40, T9)",
        "",
        "next:",
        f"  - the environment differs from {good} in 1 breaking way(s): rebuild it from uv.lock "
        f"(`./uvw sync --locked`, or the image) unless the change is intended; "
        f"`dflash doctor --against {good}` shows the details",
    ]
    assert text.endswith("shows the details\n")
    # Asked against the good run by name: the same comparison, chosen by --against.
    assert f"what changed since the last good run {good} (--against):" in render_status(run, good)[0]
    with pytest.raises(UserError, match="no such run directory"):
        render_status(run, runs / "nope")
    (runs / "empty").mkdir()
    with pytest.raises(UserError, match="no status file"):
        render_status(run, runs / "empty")


def test_a_healthy_run_alone_is_healthy_and_told_to_export(tmp_path: Path) -> None:
    run = make_run(tmp_path / "runs" / "good", finished_at="2026-01-01T00:00:00+00:00", memory_gb=None)
    status = json.loads((run / STATUS_FILE).read_text())
    del status["run_dir"], status["progress"]
    (run / STATUS_FILE).write_text(json.dumps(status))
    # A heartbeat left by a process long gone does not make a finished run a dead one.
    (run / HEARTBEAT_FILE).write_text(
        json.dumps({"pid": 2**31 - 1, "host": os.uname().nodename, "at": ago(0)})
    )
    text, healthy = render_status(run)
    assert healthy
    assert text == "\n".join([
        f"run good ({run})", "goal: ?", "state: completed at step None (2026-01-01T00:00:00+00:00)",
        "progress: step 0", "throughput: no log line yet", "compile: not reported (a run from before compile reports)",
        "", "health: HEALTHY (0 events)", "",
        "what changed: no completed, healthy run next to this one to compare with; name one with --against RUN_DIR",
        "", "last checkpoint: none yet", "", "next:",
        f"  - export the drafter: `dflash export {run} --out {run / 'export'}`; measure tau: `dflash eval {run}`",
    ]) + "\n"  # fmt: skip


def test_a_running_run_is_unhealthy_when_dead_stale_or_degraded(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", state="running", finished_at=None, updated_at=ago(300),
                   progress={"step": 3, "eta_s": 120.0})  # fmt: skip
    text, healthy = render_status(run)
    assert healthy and "state: running, step 3, status updated 5m ago" in text
    assert text.endswith("next:\n  - nothing: the run is healthy; expected to finish in 2m\n")
    (run / HEARTBEAT_FILE).write_text(
        json.dumps({"pid": 2**31 - 1, "host": os.uname().nodename, "at": ago(0)})
    )
    text, healthy = render_status(run)
    assert not healthy
    assert (
        "state: STOPPED without an exit at step 3 (killed: SIGKILL, out of memory or a lost node): its process "
        f"{2**31 - 1} on {os.uname().nodename} is gone; status last updated 5m ago"
    ) in text.splitlines()
    assert "  - the training process died without an exit: start the run again" in text.splitlines()
    # Written on another host: a heartbeat silent for over 30 s is a dead writer, a fresh one is not.
    beat = {"pid": 7, "host": "another-host", "at": ago(0)}
    (run / HEARTBEAT_FILE).write_text(json.dumps(beat))
    assert render_status(run)[1]
    (run / HEARTBEAT_FILE).write_text(json.dumps({**beat, "at": ago(600)}))
    text, healthy = render_status(run)
    assert not healthy
    assert re.search(r"^state: STOPPED without an exit at step 3 .*: its heartbeat from another-host \(pid 7\) "
                     r"stopped 60\ds ago; status last updated 5m ago$", text, re.MULTILINE)  # fmt: skip
    (run / HEARTBEAT_FILE).unlink()
    stale = make_run(tmp_path / "stale", state="running", finished_at=None, updated_at=ago(20 * 60))
    text, healthy = render_status(stale)
    assert not healthy and "STALE: no update for 20m" in text
    assert (
        "  - check whether the training process is alive; if it died, start the run again"
        in text.splitlines()
    )
    # A status without its health section (none written yet) is not taken for a healthy run.
    bare = make_run(tmp_path / "bare", state="running", finished_at=None, updated_at=ago(300))
    status = json.loads((bare / STATUS_FILE).read_text())
    del status["health"]
    (bare / STATUS_FILE).write_text(json.dumps(status))
    text, healthy = render_status(bare)
    assert not healthy and "\nhealth: ? (0 events)\n" in text
    degraded = make_run(tmp_path / "degraded", state="running", health="degraded", finished_at=None)
    assert not render_status(degraded)[1]
