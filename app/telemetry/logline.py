"""The one-line training log in the incident's format, so runs compare at a glance. A split run
(target ranks streaming features to drafter ranks):

[23m] step=14/3000 loss=10.6894 acc=0.011 streak=0.0 tree_streak=0.0 lr=7.53e-06 noise=0.0006 | tgt=0.11b/s dft=0.11b/s
(4.6Ktok/s) mfu=41.3% | q_pre=[50, 46] q_hs=[0] | epoch~0.01 ETA=36.9d | mem=61.2/70.0GB

Only fields that mean something for the run are shown: a colocated run (every rank its own target,
also a single CPU process) has one batch rate and no queues, a run without feature noise no noise,
a CPU no memory and no mfu. `legend` is the line that explains them once at the start; the guide
(docs/guide.md, Reading the log line) describes each field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from app.telemetry.hardware import Peak, describe_peak

if TYPE_CHECKING:
    import torch

    from app.config import RunConfig


SHOWN_PAUSE_S = 1.0
"""A shorter pause (a checkpoint's host copy, typically) is left unsaid: it would only add noise."""


@dataclass
class LogLine:
    """Everything one log line shows; rates are over the window since the previous line."""

    elapsed_s: float
    step: int
    total_steps: int
    """The run's last step (train.epochs of the plan, or train.max_steps when that is fewer)."""
    loss: float
    acc: float
    streak: float
    lr: float
    noise: float | None
    """Std of the feature noise at this step; None when the run adds none (train.feature_noise_std = 0)."""
    target_batches_per_s: float
    drafter_batches_per_s: float
    tokens_per_s: float
    q_pre: list[int]
    q_hs: list[int]
    epoch_progress: float
    eta_s: float | None
    memory_gb: tuple[float, float] | None = None
    """(allocated, reserved) GPU memory of this rank, GB; None on CPU."""
    mfu: float | None = None
    """This rank's drafter FLOP/s over its GPU's peak (`app.telemetry.hardware`); None without a peak."""
    colocated: bool = False
    """Target and drafter share each process: the target rate equals the drafter rate and there are no
    queues (q_pre, q_hs stay 0), so the line shows one rate and no queues."""
    events: list[str] = field(default_factory=list)
    """Health events raised since the previous line (degraded throughput, memory growth, ...)."""
    tree_streak: float | None = None
    """Mean leading slots on a path of the DDTree tree, over the blocks sampled on this line's step
    (`telemetry.tree_streak_blocks`); None when not measured."""
    paused_s: float = 0.0
    """Seconds of the window spent not training (an eval, a checkpoint's host copy); the rates, mfu
    and ETA leave them out. Shown from `SHOWN_PAUSE_S` on."""

    def render(self) -> str:
        eta = format_duration(self.eta_s) if self.eta_s is not None else "?"
        head = (
            f"[{format_duration(self.elapsed_s)}] step={self.step}/{self.total_steps} loss={self.loss:.4f} "
            f"acc={self.acc:.3f} streak={self.streak:.2f}"
        )
        if self.tree_streak is not None:
            head += f" tree_streak={self.tree_streak:.2f}"
        head += f" lr={self.lr:.3g}"
        if self.noise is not None:
            head += f" noise={self.noise:.4f}"
        rates = (
            f"{self.drafter_batches_per_s:.2f}b/s"
            if self.colocated
            else f"tgt={self.target_batches_per_s:.2f}b/s dft={self.drafter_batches_per_s:.2f}b/s"
        ) + f" ({self.tokens_per_s / 1000:.1f}Ktok/s)"
        if self.mfu is not None:
            rates += f" mfu={100 * self.mfu:.1f}%"
        if self.paused_s >= SHOWN_PAUSE_S:
            rates += f" paused={format_duration(self.paused_s)}"
        parts = [head, rates]
        if not self.colocated:
            parts.append(f"q_pre={self.q_pre} q_hs={self.q_hs}")
        parts.append(f"epoch~{self.epoch_progress:.2f} ETA={eta}")
        if self.memory_gb is not None:
            parts.append(f"mem={self.memory_gb[0]:.1f}/{self.memory_gb[1]:.1f}GB")
        parts.extend(f"!! {event}" for event in self.events)
        return " | ".join(parts)


def legend(config: RunConfig, device: torch.device, peak: Peak | None, *, colocated: bool) -> str:
    """The line that explains the log line's rate, queue and mfu fields once, at the start of a run."""
    if colocated:
        rates = "b/s = batches trained per second, Ktok/s = their real context tokens per second"
    else:
        topology = config.topology
        rates = (
            "tgt / dft = batches the target ranks produced / the drafter ranks trained per second, Ktok/s = "
            f"real context tokens trained per second, q_pre = batches each target rank has prepared ahead "
            f"(at most topology.prefetch_batches = {topology.prefetch_batches}), q_hs = feature batches "
            f"waiting at each drafter rank (at most topology.feature_queue = {topology.feature_queue}; "
            "empty: the drafters starve, full: the targets wait on them)"
        )
    paused = "paused = time in an eval or a checkpoint's copy, left out of the rates, mfu and ETA"
    return f"log line: {rates}; {paused}; {describe_peak(peak, device, config.train.precision)}"


def format_duration(seconds: float) -> str:
    """Compact human duration: 42s, 23m, 5.2h, 36.9d."""
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f}m"
    if seconds < 36 * 3600:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"
