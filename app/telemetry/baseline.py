"""The throughput a run should reach: what a degraded run is measured against.

The incident's run fell from 21.5K to 4.6K tok/s and nothing said so. A baseline comes from the
compile-cache manifest (`dflash build-cache` measures the drafter step at the run's exact shapes) or is
given by the caller; step time is preferred, because it is measured at fixed shapes, while tokens/s
also depends on how many real tokens the batches carry.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Baseline:
    """Expected steady-state throughput; at least one of the two is set."""

    step_time_s: float | None = None
    """Seconds per optimizer step (drafter forward + backward + optimizer) at the run's shapes."""
    tokens_per_s: float | None = None
    """Real context tokens per second, as the log line's Ktok/s counts them."""
    source: str = "given"
    """Where it comes from (a manifest path, "given", a run directory)."""

    def __post_init__(self) -> None:
        if self.step_time_s is None and self.tokens_per_s is None:
            raise ValueError("a baseline needs step_time_s or tokens_per_s")
        for name in ("step_time_s", "tokens_per_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"baseline {name} must be > 0, got {value}")

    def speed_ratio(self, record: dict[str, Any]) -> float | None:
        """Measured speed / baseline speed for one log record (1.0 = on baseline); None if not comparable."""
        if self.step_time_s is not None and record.get("drafter_batches_per_s"):
            return self.step_time_s * float(record["drafter_batches_per_s"])
        if self.tokens_per_s is not None and record.get("tokens_per_s") is not None:
            return float(record["tokens_per_s"]) / self.tokens_per_s
        return None

    def describe(self) -> str:
        parts = []
        if self.tokens_per_s is not None:
            parts.append(f"{self.tokens_per_s / 1000:.1f}Ktok/s")
        if self.step_time_s is not None:
            parts.append(f"{self.step_time_s:.3g}s/step")
        return f"{', '.join(parts)} ({self.source})"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def baseline_from_compile_report(report: dict[str, Any]) -> Baseline | None:
    """The baseline train start found in the loaded compile-cache entry (`CompileReport.to_dict()`)."""
    step_time = report.get("baseline_step_s")
    if not step_time:
        return None
    return Baseline(step_time_s=float(step_time), source=f"compile cache {report.get('cache_path')}")
