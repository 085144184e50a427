"""The throughput a run should reach: what a degraded run is measured against.

The incident's run fell from 21.5K to 4.6K tok/s and nothing said so. A baseline comes from the
compile-cache manifest (`dflash build-cache` measures the drafter step at the run's exact shapes) or is
given by the caller; step time is preferred, because it is measured at fixed shapes, while tokens/s
also depends on how many real tokens the batches carry.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from app.errors import UserError

STEP_TIME_KEYS = ("step_time_s", "measured_step_time_s")
TOKENS_KEYS = ("tokens_per_s", "baseline_tokens_per_s")


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

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str) -> Baseline | None:
        """The baseline in a manifest-like mapping (top level or its `measured` section); None if it has none."""
        for section in (data, data.get("measured")):
            if not isinstance(section, dict):
                continue
            step_time = _first_number(section, STEP_TIME_KEYS)
            tokens = _first_number(section, TOKENS_KEYS)
            if step_time is not None or tokens is not None:
                return cls(step_time_s=step_time, tokens_per_s=tokens, source=source)
        return None


def baseline_from_manifest(path: str | Path) -> Baseline | None:
    """The measured baseline of a compile-cache manifest (JSON); None when it records no measurement."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: no such compile-cache manifest") from None
    except (OSError, json.JSONDecodeError) as error:
        raise UserError(f"{path}: not a readable JSON manifest ({error})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object (a compile-cache manifest)")
    return Baseline.from_dict(data, source=str(path))


def _first_number(section: dict[str, Any], keys: tuple[str, ...]) -> float | None:
    for key in keys:
        value = section.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            return float(value)
    return None
