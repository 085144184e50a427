"""Where a benchmarked call spends its time: the torch profiler over one call, and its GPU kernels
(on CUDA) or host operators (on a CPU) ranked by time, for a benchmark's report. On CUDA also where
the GPU waited: a step's time minus its kernels' is time the host did not keep the GPU fed."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from app.compile.warmup import synchronize


def profile_table(call: Callable[[], object], device: torch.device, rows: int, what: str) -> str:
    """Run `call` once under the profiler; the `rows` entries with the most time, each with its
    milliseconds, share of the total and call count (`what` names the call in the header). On CUDA
    the entries are GPU kernels, each counted once (an operator's device time is its kernels' time, so
    ranking both would count it twice), and a last line says where the GPU sat idle (`device_idle`);
    on a CPU, operators by self time on the host."""
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
    if cuda:
        timeline = profiler.events()
        kernels = [_span(event) for event in timeline if event.device_type == DeviceType.CUDA]
        started = min(event.time_range.start for event in timeline if event.device_type == DeviceType.CPU)
        lines.append(device_idle(kernels, started))
    return "\n".join(lines)


IDLE_GAP_US = 5.0
"""A shorter wait between two kernels is a launch's usual latency, not a GPU starved by the host."""


def device_idle(kernels: Sequence[tuple[float, float, str]], started_us: float) -> str:
    """One line: how long the GPU waited from `started_us` (the call's first host operator) to its first
    kernel, and in gaps of `IDLE_GAP_US` or more between kernels (kernels of several streams that
    overlap count as one busy stretch), naming the kernel after the largest gap. `kernels`: (start,
    end, name), microseconds on the profiler's clock. The profiler's own cost per operator on the host
    can widen the gaps a little against an unprofiled call."""
    if not kernels:
        return "GPU idle: no kernel ran"
    ordered = sorted(kernels)
    gaps: list[tuple[float, str]] = []
    busy_until = ordered[0][1]
    for start, end, name in ordered[1:]:
        if start - busy_until >= IDLE_GAP_US:
            gaps.append((start - busy_until, name))
        busy_until = max(busy_until, end)
    lead_ms = max(0.0, ordered[0][0] - started_us) / 1e3
    line = (
        f"GPU idle: {lead_ms:.2f} ms before the first kernel, {sum(gap for gap, _ in gaps) / 1e3:.2f} ms "
        f"in {len(gaps)} gaps of {IDLE_GAP_US:g} us or more between kernels"
    )
    if gaps:
        largest, before = max(gaps)
        line += f" (largest {largest / 1e3:.2f} ms, before {before[:60]})"
    return line


def _span(event) -> tuple[float, float, str]:
    return event.time_range.start, event.time_range.end, event.name
