"""The one-line training log in the incident's format, so runs compare at a glance:

[23m] step=14 loss=10.6894 acc=0.011 streak=0.0 lr=7.53e-06 noise=0.0006 | tgt=0.11b/s dft=0.11b/s (4.6Ktok/s) |
q_pre=[50, 46] q_hs=[0] | epoch~0.01 ETA=36.9d | mem=61.2/70.0GB
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LogLine:
    """Everything one log line shows; rates are over the window since the previous line."""

    elapsed_s: float
    step: int
    loss: float
    acc: float
    streak: float
    lr: float
    noise: float
    target_batches_per_s: float
    drafter_batches_per_s: float
    tokens_per_s: float
    q_pre: list[int]
    q_hs: list[int]
    epoch_progress: float
    eta_s: float | None
    memory_gb: tuple[float, float] | None = None
    """(allocated, reserved) GPU memory of this rank, GB; None on CPU."""
    events: list[str] = field(default_factory=list)
    """Health events raised since the previous line (degraded throughput, memory growth, ...)."""

    def render(self) -> str:
        parts = [
            f"[{format_duration(self.elapsed_s)}] step={self.step} loss={self.loss:.4f} acc={self.acc:.3f} "
            f"streak={self.streak:.2f} lr={self.lr:.3g} noise={self.noise:.4f}",
            f"tgt={self.target_batches_per_s:.2f}b/s dft={self.drafter_batches_per_s:.2f}b/s "
            f"({self.tokens_per_s / 1000:.1f}Ktok/s)",
            f"q_pre={self.q_pre} q_hs={self.q_hs}",
            f"epoch~{self.epoch_progress:.2f} ETA={format_duration(self.eta_s) if self.eta_s is not None else '?'}",
        ]
        if self.memory_gb is not None:
            parts.append(f"mem={self.memory_gb[0]:.1f}/{self.memory_gb[1]:.1f}GB")
        parts.extend(f"!! {event}" for event in self.events)
        return " | ".join(parts)


def format_duration(seconds: float) -> str:
    """Compact human duration: 42s, 23m, 5.2h, 36.9d."""
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f}m"
    if seconds < 36 * 3600:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"
