"""Where a benchmarked call spends its time: the torch profiler over one call, and its GPU kernels
(on CUDA) or host operators (on a CPU) ranked by time, for a benchmark's report."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from app.compile.warmup import synchronize


def profile_table(call: Callable[[], object], device: torch.device, rows: int, what: str) -> str:
    """Run `call` once under the profiler; the `rows` entries with the most time, each with its
    milliseconds, share of the total and call count (`what` names the call in the header). On CUDA
    the entries are GPU kernels, each counted once (an operator's device time is its kernels' time, so
    ranking both would count it twice); on a CPU, operators by self time on the host."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities, acc_events=True) as profiler:  # one call: nothing to drop
        call()
        synchronize(device)
    events = profiler.key_averages()

    def time_us(event) -> float:
        if cuda:
            return event.self_device_time_total if event.device_type == DeviceType.CUDA else 0.0
        return event.self_cpu_time_total

    ranked = sorted((event for event in events if time_us(event) > 0), key=time_us, reverse=True)
    total = sum(time_us(event) for event in ranked)
    where, kind = ("GPU", "kernels") if cuda else ("host", "operators")
    lines = [
        f"profile of {what} (time on the {where}, top {min(rows, len(ranked))} of {len(ranked)} "
        f"{kind}, {total / 1e3:.1f} ms in all):"
    ]
    for event in ranked[:rows]:
        share = 100 * time_us(event) / total if total else 0.0
        lines.append(f"  {time_us(event) / 1e3:9.2f} ms {share:5.1f}%  x{event.count:<5} {event.key[:90]}")
    return "\n".join(lines)
