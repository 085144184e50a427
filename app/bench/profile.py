"""Where a benchmarked call spends its time: the torch profiler over one call, and its GPU kernels
(on CUDA) or host operators (on a CPU) ranked by time, for a benchmark's report. On CUDA also where
the GPU waited: a step's time minus its kernels' is time the host did not keep the GPU fed."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity, profile

from app.compile.warmup import synchronize


def profile_table(
    call: Callable[[], object], device: torch.device, rows: int, what: str, matmuls: bool = False
) -> str:
    """Run `call` once under the profiler; the `rows` entries with the most time, each with its
    milliseconds, share of the total and call count (`what` names the call in the header). On CUDA
    the entries are GPU kernels, each counted once (an operator's device time is its kernels' time, so
    ranking both would count it twice), and a line says where the GPU sat idle (`device_idle`);
    on a CPU, operators by self time on the host. `matmuls` adds the call's matmuls by shape
    (`matmul_table`): kernel names say nothing of which product is slow."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    # one call: nothing to drop
    with profile(activities=activities, acc_events=True, record_shapes=matmuls) as profiler:
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
    if matmuls:
        lines += matmul_table(profiler.events(), cuda, rows)
    return "\n".join(lines)


MATMUL_OPERATORS = ("aten::mm", "aten::addmm", "aten::bmm")
"""The operators every matmul reaches (linear, matmul and inductor's extern kernels call these)."""


def matmul_table(events: Iterable[FunctionEvent], cuda: bool, rows: int) -> list[str]:
    """The profiled call's matmuls grouped by operator and shape, the `rows` costliest: calls, time
    (their kernels' on CUDA, self time on a CPU) and TFLOP/s, under a header with the totals."""
    groups: dict[tuple[str, str], list[float]] = {}
    for event in events:
        if event.name not in MATMUL_OPERATORS or event.device_type != DeviceType.CPU:
            continue
        shape, flop = _matmul_shape(event.name, event.input_shapes)
        time_us = sum(kernel.duration for kernel in event.kernels) if cuda else event.self_cpu_time_total
        group = groups.setdefault((event.name, shape), [0, 0.0, 0.0])
        group[0] += 1
        group[1] += time_us
        group[2] += flop
    ranked = sorted(groups.items(), key=lambda item: item[1][1], reverse=True)
    total_us, total_flop = sum(g[1] for _, g in ranked), sum(g[2] for _, g in ranked)
    lines = [
        f"matmuls by shape (top {min(rows, len(ranked))} of {len(ranked)}, {total_us / 1e3:.1f} ms for "
        f"{total_flop / 1e9:,.3f} GFLOP, {_tflops(total_flop, total_us):.1f} TFLOP/s):"
    ]
    for (name, shape), (calls, time_us, flop) in ranked[:rows]:
        lines.append(
            f"  {time_us / 1e3:9.2f} ms x{calls:<5} {_tflops(flop, time_us):7.1f} TFLOP/s  {name} {shape}"
        )
    return lines


def _matmul_shape(name: str, shapes: list[list[int]]) -> tuple[str, float]:
    """`"M x K @ K x N"` (with a leading batch for bmm) and the product's FLOPs, from the recorded
    input shapes (addmm's first input is the added term)."""
    left, right = shapes[1:3] if name == "aten::addmm" else shapes[:2]
    batch = left[0] if name == "aten::bmm" else 1
    (m, k), n = left[-2:], right[-1]
    prefix = f"{batch} x " if name == "aten::bmm" else ""
    return f"{prefix}{m} x {k} @ {k} x {n}", 2.0 * batch * m * k * n


def _tflops(flop: float, time_us: float) -> float:
    return flop / time_us / 1e6 if time_us else 0.0


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
