"""`dflash status RUN_DIR`: a run's status.json as a short document a person can act on.

Goal, progress, health, what changed since the last good run (environment fingerprint and config diff),
the last checkpoint, and what to do next. "The last good run" is `--against RUN_DIR` when given, else
the newest sibling run directory (same parent) whose status says completed and healthy and whose
recorded stack was right (see `stack_was_right`). A resumed run is also compared with its own last good
start, so a change a resume was allowed to run with shows under what changed.
"""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.env import (
    Difference,
    assess,
    diff_fingerprints,
    latest_fingerprint,
    read_starts,
    recorded_fingerprint,
)
from app.env.guard import for_target
from app.errors import UserError
from app.telemetry.liveness import writer_death
from app.telemetry.logline import format_duration
from app.telemetry.status import read_status, seconds_since

STALE_AFTER_S = 15 * 60
"""A running run whose status.json is older than this is probably dead (it is rewritten every few steps)."""
EVENTS_SHOWN = 10
CHANGED_FILES_SHOWN = 8
"""Files named on the status's code line (a checkout with many edits ends in "and N more")."""
CONFIG_KEYS_THAT_ALWAYS_DIFFER = {"train.output_dir", "telemetry.run_name", "storage.s3_uri"}


@dataclass
class Comparison:
    """This run against an earlier good one."""

    against: Path
    chosen_by: str
    environment: list[Difference] = field(default_factory=list)
    config: list[tuple[str, Any, Any]] = field(default_factory=list)
    status: dict[str, Any] | None = None
    problem: str | None = None
    """Why the comparison is incomplete (a missing fingerprint or config), if it is."""
    own_run: bool = False
    """Against the run's own last good start rather than another run."""


def is_good(status: dict[str, Any]) -> bool:
    return status.get("state") == "completed" and status.get("health", {}).get("state") == "healthy"


def find_last_good_run(run_dir: Path) -> Path | None:
    """The newest completed, healthy sibling of `run_dir` (by finish time), or None."""
    run_dir = run_dir.resolve()
    good: list[tuple[str, Path]] = []
    for sibling in sorted(run_dir.parent.iterdir()):
        if sibling == run_dir or not sibling.is_dir():
            continue
        try:
            status = read_status(sibling)
        except UserError:
            continue
        if is_good(status) and stack_was_right(sibling):
            good.append((status.get("finished_at") or "", sibling))
    return max(good)[1] if good else None


def stack_was_right(run_dir: Path) -> bool:
    """Whether a run trained in one right stack throughout. A status that says healthy is not enough:
    the guard of its day may have missed a drift (a check added since, a resume into another stack that
    no rule caught then), and taking such a run as the reference calls a good run degraded. So every
    start is good and ran the committed code, none differs from the first in a breaking way, and
    today's checks find no problem."""
    try:
        starts = read_starts(run_dir)
    except UserError:
        return False
    if not starts or not all(start.good for start in starts):
        return False
    if any(_ran_edited_code(start.fingerprint) for start in starts):
        return False
    first = starts[0].fingerprint
    if any(d.breaking for start in starts[1:] for d in diff_fingerprints(first, start.fingerprint)):
        return False
    return not any(finding.level == "problem" for finding in assess(starts[-1].fingerprint))


def _ran_edited_code(fingerprint: dict[str, Any]) -> bool:
    """Whether a start ran appliance code that differs from its checkout's commit (an edit under
    `app/`): no reference for a run of the committed code, whose code hashes it would not match."""
    changed = (fingerprint.get("project") or {}).get("changed") or []
    return any(path.startswith("app/") for path in changed)


def own_comparison(run_dir: Path) -> Comparison | None:
    """The run's newest start against its last good start before it (None for a run of one start):
    a torch or GPU change a resume was allowed to run with shows under what changed, not only as the
    health events it raised."""
    try:
        starts = read_starts(run_dir)
    except UserError:
        return None
    earlier = [start for start in starts[:-1] if start.good]
    if not earlier:
        return None
    reference, newest = earlier[-1], starts[-1]
    comparison = Comparison(
        against=run_dir,
        chosen_by=f"{reference.describe()}, to the newest: {newest.describe()}",
        environment=for_target(newest, diff_fingerprints(reference.fingerprint, newest.fingerprint)),
        own_run=True,
    )
    if reference.config is None or newest.config is None:
        comparison.problem = "a start of the record holds no config"
    else:
        comparison.config = _config_differences(_flatten(reference.config), _flatten(newest.config))
    return comparison


def compare_runs(run_dir: Path, against: Path, chosen_by: str) -> Comparison:
    comparison = Comparison(against=against, chosen_by=chosen_by)
    try:
        comparison.status = read_status(against)
    except UserError:
        comparison.status = None
    problems = []
    try:
        # The other run at its last good start; this one as it runs now (its newest start).
        reference, _ = recorded_fingerprint(against)
        comparison.environment = diff_fingerprints(reference, latest_fingerprint(run_dir))
    except UserError as error:
        problems.append(str(error))
    try:
        before, after = (_flat_config(path) for path in (against, run_dir))
    except UserError as error:
        problems.append(str(error))
    else:
        comparison.config = _config_differences(before, after)
    comparison.problem = "; ".join(problems) or None
    return comparison


def _config_differences(before: dict[str, Any], after: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    return [
        (key, before.get(key), after.get(key))
        for key in sorted(before.keys() | after.keys())
        if before.get(key) != after.get(key) and key not in CONFIG_KEYS_THAT_ALWAYS_DIFFER
    ]


def render_status(run_dir: Path, against: Path | None = None) -> tuple[str, bool]:
    """The status document and whether the run is healthy (not degraded, failed or stale)."""
    status = read_status(run_dir)
    if against is not None:
        read_status(against)  # a wrong --against is a usage error, said before anything else
        comparison: Comparison | None = compare_runs(run_dir, against, "--against")
    else:
        last_good = find_last_good_run(run_dir)
        comparison = (
            compare_runs(run_dir, last_good, "newest completed healthy sibling") if last_good else None
        )
    stale_s = _stale_seconds(status)
    dead = writer_death(run_dir, time.time()) if status.get("state") == "running" else None
    lines = [
        f"run {status.get('run_name')} ({status.get('run_dir', run_dir)})",
        f"goal: {status.get('goal', {}).get('text', '?')}",
        f"state: {_state_line(status, stale_s, dead)}",
        f"progress: {_progress_line(status)}",
        f"throughput: {_throughput_line(status, comparison)}",
        f"compile: {_compile_line(status.get('compile'))}",
        *_code_lines(status.get("fingerprint") or {}),
    ]
    if status.get("memory_gb"):
        allocated, reserved = status["memory_gb"]
        lines.append(f"memory: {allocated:.1f} GB allocated / {reserved:.1f} GB reserved")
    for attempt in status.get("attempts", []):
        lines.append(
            f"earlier attempt: {attempt.get('exit_reason')} at step {attempt.get('step')} ({attempt.get('finished_at') or '?'})"
        )
    own = own_comparison(run_dir)
    drifted = [c for c in (own, comparison) if c is not None and any(d.breaking for d in c.environment)]
    lines += ["", *_health_lines(status, drifted), "", *_change_lines(comparison)]
    lines += [*(_change_lines(own) if own is not None else []), ""]
    lines += _checkpoint_lines(status)
    steps = next_steps(run_dir, status, comparison, stale_s, dead)
    lines += ["", "next:", *(f"  - {step}" for step in steps)]
    healthy = (
        status.get("health", {}).get("state") == "healthy"
        and stale_s is None
        and dead is None
        and not drifted
    )
    return "\n".join(lines) + "\n", healthy


# ---- sections ---------------------------------------------------------------------------------------


def _state_line(status: dict[str, Any], stale_s: float | None, dead: str | None) -> str:
    state, step = status.get("state"), status.get("progress", {}).get("step")
    updated = seconds_since(status.get("updated_at"))
    if dead is not None:
        return (
            f"STOPPED without an exit at step {step} (killed: SIGKILL, out of memory or a lost node): {dead}; "
            f"status last updated {format_duration(updated or 0)} ago"
        )
    if state == "running":
        line = f"running, step {step}, status updated {format_duration(updated or 0)} ago"
        if stale_s is not None:
            line += f" -- STALE: no update for {format_duration(stale_s)}, the process may be dead"
        return line
    if state == "failed":
        return f"FAILED at step {step}: {str(status.get('exit_reason', '')).removeprefix('failed: ')}"
    return f"{state} at step {step} ({status.get('finished_at')})"


def _progress_line(status: dict[str, Any]) -> str:
    progress, goal = status.get("progress", {}), status.get("goal", {})
    parts = [
        f"step {progress.get('step', 0)}"
        + (f" of {progress['total_steps']}" if progress.get("total_steps") else "")
    ]
    if progress.get("epoch_progress") is not None:
        parts.append(f"epoch {progress['epoch_progress']:.2f} of {goal.get('epochs', '?')}")
    if status.get("state") == "running" and progress.get("eta_s") is not None:
        parts.append(f"ETA {format_duration(progress['eta_s'])}")
    line = ", ".join(parts)
    if progress.get("loss") is not None:
        line += f"; loss {progress['loss']:.4f} acc {progress.get('acc', 0):.3f} streak {progress.get('streak', 0):.2f}"
    if status.get("eval"):
        evaluated = status["eval"]
        tree = evaluated.get("tree_tau")
        tree_text = (
            f", tree tau {tree:.3f} at budget {evaluated.get('tree_budget')}" if tree is not None else ""
        )
        line += f"; eval tau {evaluated.get('tau', 0):.3f}{tree_text} (step {evaluated.get('step')})"
        domains = evaluated.get("domains") or {}
        if domains:
            line += "; per domain: " + ", ".join(
                f"{name} {part.get('tau', 0):.2f}"
                + (f" (tree {part['tree_tau']:.2f})" if part.get("tree_tau") is not None else "")
                for name, part in domains.items()
            )
    return line


def _compile_line(report: dict[str, Any] | None) -> str:
    """What train start did about compilation: eager, or which cache entry and what warm-up cost."""
    if not report:
        return "not reported (a run from before compile reports)"
    if not report.get("compiled"):
        return f"eager on {report.get('device', '?')} (no compiled kernels on this device)"
    counters = report.get("warmup_counters") or {}
    misses = counters.get("fxgraph_cache_miss", 0) + counters.get("autograd_cache_miss", 0)
    source = (
        f"cache {report.get('key')} loaded from {report.get('cache_path')}"
        if report.get("cache_loaded")
        else f"NO cache for key {report.get('key')}: compiled from scratch"
    )
    return f"{source}; warm-up {report.get('warmup_s', 0):.1f}s with {misses} cache misses"


def _throughput_line(status: dict[str, Any], comparison: Comparison | None) -> str:
    throughput = status.get("throughput") or {}
    if throughput.get("tokens_per_s") is None:
        return "no log line yet"
    line = f"{throughput['tokens_per_s'] / 1000:.1f}Ktok/s"
    if throughput.get("step_time_s"):
        line += f", {throughput['step_time_s']:.3g} s/step"
    if throughput.get("mfu") is not None:
        line += f", mfu {throughput['mfu']:.1%}"
    line += f" (mean of the last {throughput.get('log_lines', '?')} log lines)"
    baseline = throughput.get("baseline")
    if baseline and throughput.get("vs_baseline") is not None:
        line += f"; {throughput['vs_baseline']:.0%} of the baseline ({baseline.get('source')})"
    then = ((comparison.status or {}).get("throughput") or {}).get("tokens_per_s") if comparison else None
    if then:
        line += f"; last good run: {then / 1000:.1f}Ktok/s ({throughput['tokens_per_s'] / then:.0%} of it)"
    return line


def _code_lines(fingerprint: dict[str, Any]) -> list[str]:
    """The checkout's files that differed from its commit when the run last started (development is
    allowed; a run of uncommitted code says so, as the commit alone would not reproduce it)."""
    changed = fingerprint.get("changed") or []
    if not changed:
        return []
    shown = ", ".join(changed[:CHANGED_FILES_SHOWN]) + (
        f" and {len(changed) - CHANGED_FILES_SHOWN} more" if len(changed) > CHANGED_FILES_SHOWN else ""
    )
    return [
        f"code: {len(changed)} file{' differs' if len(changed) == 1 else 's differ'} from commit "
        f"{fingerprint.get('revision')}: {shown}"
    ]


def _health_lines(status: dict[str, Any], drifted: list[Comparison]) -> list[str]:
    """`drifted`: the comparisons (the last good run, the run's own last good start) whose environment
    differs in a breaking way: whatever the run itself saw, its numbers and speed are not comparable."""
    health = status.get("health", {})
    events, count = health.get("events", []), health.get("event_count", 0)
    state = "degraded" if drifted and health.get("state") == "healthy" else health.get("state", "?")
    lines = [f"health: {str(state).upper()} ({count} event{'s' * (count != 1)})"]
    lines += [
        f"  active: the environment differs from {_reference(c, possessive=True)} (breaking; see what changed)"
        for c in drifted
    ]
    lines += [f"  active: {condition}" for condition in health.get("active", [])]
    if count > len(events[-EVENTS_SHOWN:]):
        lines.append(f"  (the last {len(events[-EVENTS_SHOWN:])} of {count})")
    lines += [f"  step {event.get('step')}: {event.get('message')}" for event in events[-EVENTS_SHOWN:]]
    return lines


def _change_lines(comparison: Comparison | None) -> list[str]:
    if comparison is None:
        return [
            "what changed: no completed, healthy run next to this one to compare with; "
            "name one with --against RUN_DIR"
        ]
    lines = [f"what changed since {_reference(comparison)} ({comparison.chosen_by}):"]
    if comparison.problem:
        lines.append(f"  (incomplete: {comparison.problem})")
    breaking = [d for d in comparison.environment if d.breaking]
    cosmetic = [d for d in comparison.environment if not d.breaking]
    if breaking:
        lines.append(f"  environment: {len(breaking)} breaking difference{'s' * (len(breaking) != 1)}")
        lines += [f"    {d.field}: {_shown(d.old)} -> {_shown(d.new)} ({d.why})" for d in breaking]
    else:
        lines.append("  environment: same training stack")
    if cosmetic:
        lines.append(f"    cosmetic: {', '.join(d.field for d in cosmetic)}")
    if comparison.config:
        count = len(comparison.config)
        lines.append(f"  config: {count} setting{'s differ' if count != 1 else ' differs'}")
        lines += [f"    {key}: {_shown(old)} -> {_shown(new)}" for key, old, new in comparison.config]
    else:
        lines.append("  config: same settings")
    return lines


def _checkpoint_lines(status: dict[str, Any]) -> list[str]:
    checkpoint = status.get("last_checkpoint")
    lines = [
        f"last checkpoint: {checkpoint['path']} (step {checkpoint['step']}, {checkpoint['at']})"
        if checkpoint
        else "last checkpoint: none yet"
    ]
    storage = status.get("storage")
    if storage:
        synced = storage.get("synced_checkpoint")
        line = f"  S3 {storage.get('s3_uri')}: " + (
            f"{synced['name']} synced ({synced['at']})" if synced else "nothing synced by this attempt yet"
        )
        if storage.get("pending"):
            line += f"; pending: {', '.join(storage['pending'])}"
        if storage.get("last_error"):
            line += f"; last error: {storage['last_error']}"
        lines.append(line)
    return lines


# ---- what to do next ----------------------------------------------------------------------------------


HEALTH_ADVICE = (
    (
        "throughput:",
        "throughput is below its baseline: check that the compile cache matched and loaded with 0 misses "
        "(the compile events above), that the GPUs are the ones the cache was built on, and `dflash doctor`",
    ),
    (
        "compile:",
        "kernels recompiled or missed the cache after warm-up: rebuild it for this stack (`just build-cache`)",
    ),
    ("memory:", "GPU memory is not flat: look for changing shapes or recompiles; a leak grows until OOM"),
    (
        "queues:",
        "a pipeline stage is starved or blocked: rebalance topology.target_ranks : drafter_ranks "
        "(`dflash bench` reports each stage's capacity)",
    ),
)
"""(marker of a health event, what to do about it) for the next steps of `dflash status`."""


EXPORT_DIR = "export"
"""Where the next steps suggest exporting a finished run, and where the demo exports its drafter."""


def next_steps(
    run_dir: Path,
    status: dict[str, Any],
    comparison: Comparison | None,
    stale_s: float | None,
    dead: str | None = None,
) -> list[str]:
    state, reason = status.get("state"), str(status.get("exit_reason") or "")
    checkpoint = status.get("last_checkpoint")

    def resume(*overrides: str) -> str:
        command = shlex.join(["dflash", "train", str(run_dir), *overrides, "--resume"])
        return (
            f"`{command}` (continues from step {checkpoint['step']})" if checkpoint else "start the run again"
        )

    steps: list[str] = []
    if state == "failed" and "NonFiniteLoss" in reason:
        steps.append(
            "the loss became NaN/inf at the step and batch named above: inspect those samples, or lower the "
            f"learning rate: {resume('train.lr=<lower>')}"
        )
    elif state == "failed":
        steps.append(f"fix the cause above, then {resume()}")
    elif state == "stopped":
        steps.append(f"stopped by a signal after a checkpoint: {resume()}")
    elif dead is not None:
        steps.append(f"the training process died without an exit: {resume()}")
    elif state == "running" and stale_s is not None:
        steps.append(f"check whether the training process is alive; if it died, {resume()}")
    messages = " ".join(event.get("message", "") for event in status.get("health", {}).get("events", []))
    messages += " ".join(status.get("health", {}).get("active", []))
    breaking = [d for d in comparison.environment if d.breaking] if comparison else []
    if breaking and comparison is not None:
        steps.append(
            f"the environment differs from {comparison.against} in {len(breaking)} breaking way(s): rebuild it "
            f"from uv.lock (`./uvw sync --locked`, or the image) unless the change is intended; "
            f"`dflash doctor --against {comparison.against}` shows the details"
        )
    steps += [advice for marker, advice in HEALTH_ADVICE if marker in messages]
    if not steps and state == "completed":
        export = run_dir / EXPORT_DIR
        if _exported_after(export, checkpoint):
            steps.append(f"serve the drafter exported in {export}; measure tau: `dflash eval {run_dir}`")
        else:
            steps.append(
                f"export the drafter: `dflash export {run_dir} --out {export}`; measure tau: `dflash eval {run_dir}`"
            )
    if not steps and state == "running":
        eta = status.get("progress", {}).get("eta_s")
        steps.append(
            "nothing: the run is healthy" + (f"; expected to finish in {format_duration(eta)}" if eta else "")
        )
    return steps


# ---- helpers ------------------------------------------------------------------------------------------


def _reference(comparison: Comparison, possessive: bool = False) -> str:
    if comparison.own_run:
        return "this run's last good start"
    return "the last good run's" if possessive else f"the last good run {comparison.against}"


def _exported_after(export: Path, checkpoint: dict[str, Any] | None) -> bool:
    """Whether `export` holds weights written after the run's last checkpoint (the demo exports there
    itself; an export of an earlier checkpoint is stale)."""
    weights = export / "model.safetensors"
    if not weights.is_file():
        return False
    last = Path(checkpoint["path"]) if checkpoint else None
    return last is None or not last.exists() or weights.stat().st_mtime >= last.stat().st_mtime


def _stale_seconds(status: dict[str, Any]) -> float | None:
    if status.get("state") != "running":
        return None
    age = seconds_since(status.get("updated_at"))
    return age if age is not None and age > STALE_AFTER_S else None


def _flat_config(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "config.json"
    try:
        return _flatten(json.loads(path.read_text()))
    except FileNotFoundError:
        raise UserError(f"{path}: no resolved config recorded") from None
    except (OSError, json.JSONDecodeError) as error:
        raise UserError(f"{path}: unreadable ({error})") from None


def _flatten(config: dict[str, Any]) -> dict[str, Any]:
    """`section.field` -> value (a field's own mapping, e.g. target.architecture, is compared whole)."""
    return {
        f"{section}.{key}" if isinstance(fields, dict) else section: value
        for section, fields in config.items()
        for key, value in (fields.items() if isinstance(fields, dict) else [(section, fields)])
    }


def _shown(value: Any) -> str:
    if value is None:
        return "(absent)"
    if isinstance(value, list | dict):
        return json.dumps(value)
    return str(value)
