"""The training log line shows the fields that apply to the run, and the peak its mfu divides by."""

from __future__ import annotations

import pytest
import torch

from app.config import load_config
from app.telemetry.hardware import Peak, datasheet_peak, describe_peak, reference_peak, utilization
from app.telemetry.logline import LogLine, legend
from tests.helpers import ROOT


def line(**fields) -> LogLine:
    base = dict(
        elapsed_s=1380.0, step=120, total_steps=3000, loss=2.5, acc=0.4, streak=1.5, lr=1e-4, noise=0.0006,
        target_batches_per_s=4.0, drafter_batches_per_s=4.0, tokens_per_s=46_000.0, q_pre=[50, 46],
        q_hs=[0, 3, 1], epoch_progress=0.01, eta_s=3600.0,
    )  # fmt: skip
    return LogLine(**{**base, **fields})


def test_a_split_gpu_line_shows_progress_rates_mfu_queues_and_memory() -> None:
    text = line(memory_gb=(61.2, 70.0), mfu=0.612).render()
    assert text == (
        "[23m] step=120/3000 loss=2.5000 acc=0.400 streak=1.50 lr=0.0001 noise=0.0006 | "
        "tgt=4.00b/s dft=4.00b/s (46.0Ktok/s) mfu=61.2% | q_pre=[50, 46] q_hs=[0, 3, 1] | "
        "epoch~0.01 ETA=60m | mem=61.2/70.0GB"
    )


def test_a_colocated_cpu_line_has_one_rate_and_no_queues_memory_mfu_or_noise() -> None:
    """One CPU process: its target and drafter are one loop (equal rates, no queues), no GPU memory,
    no peak to measure mfu against, and no feature noise configured."""
    text = line(colocated=True, noise=None, q_pre=[0], q_hs=[0]).render()
    assert (
        text
        == "[23m] step=120/3000 loss=2.5000 acc=0.400 streak=1.50 lr=0.0001 | 4.00b/s (46.0Ktok/s) | epoch~0.01 ETA=60m"
    )


def test_a_pause_of_a_second_or_more_is_shown_beside_the_rates_it_is_left_out_of() -> None:
    assert "paused" not in line(colocated=True, paused_s=0.4).render()  # a checkpoint's host copy
    assert "| 4.00b/s (46.0Ktok/s) paused=12s | epoch~" in line(colocated=True, paused_s=12.0).render()


def test_the_legend_explains_the_queues_of_a_split_run_and_why_a_cpu_has_no_mfu() -> None:
    config = load_config(ROOT / "configs" / "qwen3.6-27b.toml")
    split = legend(config, torch.device("cpu"), None, colocated=False)
    assert (
        f"q_pre = batches each target rank has prepared ahead (at most topology.prefetch_batches = {config.topology.prefetch_batches})"
        in split
    )
    assert (
        f"q_hs = feature batches waiting at each drafter rank (at most topology.feature_queue = {config.topology.feature_queue}"
        in split
    )
    colocated = legend(config, torch.device("cpu"), None, colocated=True)
    assert "q_pre" not in colocated and "b/s = batches trained per second" in colocated
    assert "paused = time in an eval or a checkpoint's copy, left out of the rates, mfu and ETA" in colocated
    assert colocated.endswith(
        "mfu not shown: a CPU has no reference peak (set telemetry.peak_tflops to compare with one)"
    )  # fmt: skip


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H200", 989.0),
        ("NVIDIA H20", 148.0),
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA B200", 2250.0),
        ("NVIDIA GeForce GTX 1080", None),
    ],
)
def test_datasheet_peaks_match_the_most_specific_gpu_name(name: str, tflops: float | None) -> None:
    assert datasheet_peak(name) == tflops


def test_the_peak_is_the_configured_one_else_none_on_a_cpu() -> None:
    cpu = torch.device("cpu")
    assert reference_peak(None, cpu, "bf16") is None
    configured = reference_peak(2.0, cpu, "fp32")
    assert configured == Peak(2.0, "telemetry.peak_tflops")
    assert (
        describe_peak(configured, cpu, "fp32")
        == "mfu = drafter FLOP/s over 2 TFLOP/s (telemetry.peak_tflops)"
    )
    assert utilization(3e12, 2.0, configured) == 0.75 and utilization(3e12, 2.0, None) is None
