"""The environment check every training process runs at start, before anything heavy loads.

Two kinds of finding refuse a start: the doctor's problems (not the locked stack: an inference-stack
or stray package, a version the lock does not pin, a package the lock installs that is absent, a
compiler flag that disables or degrades compilation), and on a resume every breaking difference from
the run's last good start (another torch build, an edited file of the appliance; the hybrid-target
kernels only where the run's target uses them). The refusal names
each finding and its fix in a line. `train.allow_environment_drift` runs anyway; the start then records
what it accepted and the run's status says DEGRADED.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from app.env.diff import Difference, diff_fingerprints
from app.env.fingerprint import FAST_KERNELS, collect_fingerprint
from app.env.health import Finding, assess
from app.env.project import LOCK_FILE
from app.env.record import StartRecord, last_good_start
from app.errors import UserError

ALLOW_SETTING = "train.allow_environment_drift"
LINES_SHOWN = 12
"""Findings listed in a refusal; a polluted venv's hundred package differences end in one "more" line."""


@dataclass(frozen=True)
class EnvironmentCheck:
    """What the start found: the fingerprint it recorded and what it ran despite (nothing: a good start)."""

    fingerprint: dict[str, Any]
    problems: list[Finding] = field(default_factory=list)
    drift: list[Difference] = field(default_factory=list)
    since: StartRecord | None = None
    """The run's last good start that `drift` compares with (a resume only)."""
    other: list[str] = field(default_factory=list)
    """Further degradations the run's config accepted (e.g. a hybrid target's slow kernel path)."""

    @property
    def accepted(self) -> list[str]:
        """One line per finding the start was allowed to run despite."""
        lines = [finding.line() for finding in self.problems]
        if self.since is not None:
            lines += [
                f"since {self.since.describe()}: {d.field} {_shown(d.old)} -> {_shown(d.new)} ({d.why})"
                for d in self.drift
            ]
        return [*lines, *self.other]

    @property
    def notes(self) -> list[str]:
        """What a start says without refusing: tracked files edited against the checkout's commit
        (development is legitimate, but the run must not be silent about the code it ran)."""
        project = self.fingerprint.get("project") or {}
        edited = [path for path in project.get("changed") or [] if path != LOCK_FILE]  # the lock: a problem
        if not edited:
            return []
        shown = ", ".join(edited[:8]) + (f" and {len(edited) - 8} more" if len(edited) > 8 else "")
        commit = (project.get("revision") or "?")[:12]
        return [f"this run's code differs from commit {commit} in {len(edited)} file(s): {shown}"]

    def also_accepting(self, lines: list[str]) -> EnvironmentCheck:
        return replace(self, other=[*self.other, *lines])


def check_environment(run_dir: Path | None, *, resume: bool, allow_drift: bool) -> EnvironmentCheck:
    """Fingerprint this process and refuse a start in a drifted environment unless `allow_drift`.

    `run_dir`: where the run's record lives (None on a rank that does not read it, e.g. a target rank
    on another node); on a resume its last good start is the reference.
    """
    fingerprint = collect_fingerprint()
    problems = [finding for finding in assess(fingerprint) if finding.level == "problem"]
    since = last_good_start(run_dir) if resume and run_dir is not None else None
    drift = _breaking_drift(since, fingerprint) if since else []
    check = EnvironmentCheck(fingerprint, problems, drift, since)
    if check.accepted and not allow_drift:
        raise UserError(_refusal(check, run_dir))
    return check


def _breaking_drift(since: StartRecord, fingerprint: dict[str, Any]) -> list[Difference]:
    return [d for d in for_target(since, diff_fingerprints(since.fingerprint, fingerprint)) if d.breaking]


def for_target(start: StartRecord, differences: list[Difference]) -> list[Difference]:
    """`differences` as they matter to the run of `start`: the hybrid-target kernels' (fla,
    causal_conv1d) are cosmetic for a target without the linear-attention layers they serve (a Qwen3
    drafter recorded where flash-linear-attention was installed runs the same code without it)."""
    kernels = [d for d in differences if d.field.startswith("fast_kernels.") and d.breaking]
    if not kernels or _target_is_hybrid(start):  # the target is only looked up when it matters
        return differences
    why = "; this run's target has no linear-attention layer, so none of its code runs them"
    return [replace(d, breaking=False, why=d.why + why) if d in kernels else d for d in differences]


def _target_is_hybrid(start: StartRecord) -> bool:
    """Whether the recorded start's target is a hybrid one; a start recorded without its config, or
    a target that no longer loads, counts as hybrid (the kernels' differences then still refuse)."""
    if start.config is None:
        return True
    from app.config import load_config
    from app.model.target import is_hybrid, target_text_config

    try:
        return is_hybrid(target_text_config(load_config(start.config).target))
    except (UserError, OSError, ValueError):
        return True


def fast_kernel_gaps(fingerprint: dict[str, Any]) -> list[str]:
    """The hybrid-target kernels this process lacks, as `module (distribution: why)`: flash-linear-
    attention, and a causal conv (causal-conv1d's, else flash-linear-attention's Triton one)."""
    from app.model.causal_conv import fast_causal_conv

    kernels = fingerprint.get("fast_kernels") or {}
    present = {module: bool(status.get("present")) for module, status in kernels.items()}
    conv = fast_causal_conv(present, cuda=True)  # the question is asked of a run on CUDA
    gaps = []
    for module, status in kernels.items():
        if module == "causal_conv1d" and conv is not None:
            continue
        if not status.get("present"):
            why = f": {status['error']}" if status.get("error") else ": not installed"
            gaps.append(f"{module} ({FAST_KERNELS.get(module, module)}{why})")
    return gaps


def _refusal(check: EnvironmentCheck, run_dir: Path | None) -> str:
    lines = check.accepted
    shown = [f"  - {line}" for line in lines[:LINES_SHOWN]]
    if len(lines) > LINES_SHOWN:
        shown.append(f"  - ... and {len(lines) - LINES_SHOWN} more (`dflash doctor`)")
    if check.drift:
        shown.append(
            f"  restore the recorded stack (`dflash doctor --against {run_dir}` lists every difference), "
            "or start a new run in another train.output_dir"
        )
    return "\n".join(
        [
            f"the environment is not one this run may train in ({len(lines)} finding{'s' * (len(lines) != 1)}):",
            *shown,
            f"to train anyway, set {ALLOW_SETTING}=true (the run's status then says DEGRADED)",
        ]
    )


def _shown(value: Any) -> str:
    return "(absent)" if value is None else str(value)
