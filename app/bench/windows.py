"""A finished run judged per log window, not by its mean: `dflash bench windows RUN_DIR`.

The incident's dips (single windows at half speed while the mean read 88% of the baseline) vanish in a
mean. This reads the run's metrics.jsonl and status.json and reports, from `--from-step` on: tok/s per
window (min, median, max and min / median), reserved GPU memory (spread), and what the health watches
said (library JIT after warm-up, recompiles, throughput dips).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from app.bench.pipeline import read_train_records
from app.errors import UserError
from app.telemetry.status import read_status


def window_report(run_dir: Path, from_step: int) -> dict[str, Any]:
    records = [r for r in read_train_records(run_dir / "metrics.jsonl") if r["step"] >= from_step]
    if len(records) < 2:
        raise UserError(f"{run_dir}/metrics.jsonl: fewer than 2 log windows from step {from_step}")
    rates = [float(r["tokens_per_s"]) for r in records]
    reserved = [float(r["memory_gb"][1]) for r in records if r.get("memory_gb")]
    events = [event["message"] for event in read_status(run_dir)["health"]["events"]]
    median = statistics.median(rates)
    return {
        "windows": len(records),
        "from_step": from_step,
        "tokens_per_s": {"min": min(rates), "median": median, "max": max(rates), "per_window": rates},
        "min_over_median": min(rates) / median,
        "reserved_gb": {"min": min(reserved), "max": max(reserved)} if reserved else None,
        "reserved_spread": (max(reserved) - min(reserved)) / min(reserved) if reserved else None,
        "library_jit_events": [event for event in events if event.startswith("library JIT")],
        "other_events": [event for event in events if not event.startswith("library JIT")],
    }


def format_windows(report: dict[str, Any]) -> str:
    rates = report["tokens_per_s"]
    lines = [
        f"{report['windows']} log windows from step {report['from_step']}: tok/s min {rates['min'] / 1e3:.1f}K, "
        f"median {rates['median'] / 1e3:.1f}K, max {rates['max'] / 1e3:.1f}K (min / median "
        f"{report['min_over_median']:.1%})",
        "per window: " + ", ".join(f"{rate / 1e3:.1f}K" for rate in rates["per_window"]),
    ]
    if report["reserved_gb"]:
        memory = report["reserved_gb"]
        lines.append(
            f"reserved memory: {memory['min']:.1f}-{memory['max']:.1f} GB ({report['reserved_spread']:.2%} spread)"
        )
    lines.append(f"library JIT after warm-up: {len(report['library_jit_events'])} events")
    lines += [f"  {event}" for event in report["library_jit_events"] + report["other_events"]]
    return "\n".join(lines)
