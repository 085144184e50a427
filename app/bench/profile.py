"""Where a benchmarked call spends its time: the torch profiler over one call, and its operators
ranked by self time (on the GPU on CUDA, on the host on a CPU), for a benchmark's report."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from app.compile.warmup import synchronize


def profile_table(call: Callable[[], object], device: torch.device, rows: int, what: str) -> str:
    """Run `call` once under the profiler; the `rows` operators with the most self time, each with
    its milliseconds, share of the total and call count (`what` names the call in the header)."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities, acc_events=True) as profiler:  # one call: nothing to drop
        call()
        synchronize(device)
    events = profiler.key_averages()

    def self_us(event) -> float:
        return event.self_device_time_total if cuda else event.self_cpu_time_total

    ranked = sorted((event for event in events if self_us(event) > 0), key=self_us, reverse=True)
    total = sum(self_us(event) for event in ranked)
    where = "GPU" if cuda else "host"
    lines = [
        f"profile of {what} (self time on the {where}, top {min(rows, len(ranked))} of {len(ranked)} "
        f"operators, {total / 1e3:.1f} ms in all):"
    ]
    for event in ranked[:rows]:
        share = 100 * self_us(event) / total if total else 0.0
        lines.append(f"  {self_us(event) / 1e3:9.2f} ms {share:5.1f}%  x{event.count:<5} {event.key[:90]}")
    return "\n".join(lines)
