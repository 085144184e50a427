"""What the log line reads of the device: its memory, and the peak its MFU divides by.

MFU (model FLOPs utilization) is the drafter step's useful FLOPs per second (`app.model.flops`, the
count `dflash bench drafter` reports) over the GPU's peak. The peak is `telemetry.peak_tflops`, else
the datasheet's dense bf16 rate of a known GPU when the run trains in bf16 (as torchtitan reports it).
A CPU has no such reference (its rate depends on the cores, the vector units and the BLAS), so there
MFU is left out unless a peak is configured, and the run's first lines say why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads where a device is read, not with `dflash status` (which imports the log line)
    import torch

PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    # (part of torch.cuda.get_device_name, dense bf16 TFLOP/s); the first match wins, so a name that
    # contains another (H200 contains H20, L40S contains L4) comes before it
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H200 NVL", 835.0),
    ("H200", 989.0),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H20", 148.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("MI325X", 1307.0),
    ("MI300X", 1307.0),
)
"""Datasheet peaks of one GPU, without sparsity."""


@dataclass(frozen=True)
class Peak:
    """The rate MFU is measured against, and where it comes from."""

    tflops: float
    source: str


def reference_peak(configured: float | None, device: torch.device, precision: str) -> Peak | None:
    """`telemetry.peak_tflops`, else the datasheet bf16 peak of this GPU in a bf16 run; None otherwise."""
    if configured is not None:
        return Peak(configured, "telemetry.peak_tflops")
    if device.type != "cuda" or precision != "bf16":
        return None
    name = _device_name(device)
    tflops = datasheet_peak(name)
    return Peak(tflops, f"{name}, datasheet dense bf16") if tflops is not None else None


def datasheet_peak(device_name: str) -> float | None:
    """The dense bf16 TFLOP/s of the GPU that `device_name` (torch's) names, if it is a known one."""
    return next((tflops for part, tflops in PEAK_BF16_TFLOPS if part in device_name), None)


def describe_peak(peak: Peak | None, device: torch.device, precision: str) -> str:
    """What the log line's mfu means on this run, or why it has none."""
    if peak is not None:
        return f"mfu = drafter FLOP/s over {peak.tflops:g} TFLOP/s ({peak.source})"
    if device.type != "cuda":
        where = f"a {device.type.upper()} has no reference peak"
    elif precision != "bf16":
        where = f"no datasheet peak for {precision} training"
    else:
        where = f"no datasheet peak known for {_device_name(device)}"
    return f"mfu not shown: {where} (set telemetry.peak_tflops to compare with one)"


def utilization(flops: float, seconds: float, peak: Peak | None) -> float | None:
    """Fraction of the peak that `flops` over `seconds` achieved; None without a peak."""
    if peak is None or seconds <= 0:
        return None
    return flops / seconds / (peak.tflops * 1e12)


def device_memory_gb(device: torch.device) -> tuple[float, float] | None:
    """(allocated, reserved) GPU memory of this process, GB; None on CPU."""
    if device.type != "cuda":
        return None
    import torch

    return torch.cuda.memory_allocated(device) / 1e9, torch.cuda.memory_reserved(device) / 1e9


def _device_name(device: torch.device) -> str:
    import torch

    return torch.cuda.get_device_name(device)
