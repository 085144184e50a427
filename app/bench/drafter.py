"""`dflash bench drafter`: one drafter training step (forward + backward + chunked loss) at a config's shapes.

Only the drafter and random-weight stand-ins of the target's embedding and LM head are built (the
step's cost does not depend on weight values); rows are synthetic but laid out like real ones
(documents of `data.max_length` packed into `token_budget`, anchors sampled among supervised
positions). Reports the median step time, query/context tokens per second, useful FLOPs term by
term (averaged over the timed steps' rows), the fraction of a given peak, peak memory, the first
call's (compile) time, on CUDA whether the step synchronises with the host or recompiles after
warm-up (both would mean a degraded run), and what a log step's tree-streak proxy
(`telemetry.tree_streak_blocks`) adds to the step. A step whose loss or gradients are not finite is
refused, not timed (`require_finite_steps`).
"""

from __future__ import annotations

import contextlib
import resource
import statistics
import sys
import time
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from app.bench.profile import profile_table
from app.compile.apply import compile_drafter
from app.compile.guard import steady_state
from app.compile.warmup import synchronize, synthetic_batches
from app.config import RunConfig
from app.data.batch import DrafterRow, FeatureBatch
from app.errors import UserError
from app.model.attention import FLEX_TILE, training_block_mask
from app.model.drafter import DFlashDrafter, DrafterArch
from app.model.flops import forward_flops, multiplier, step_flops, visible_pairs
from app.model.objective import TreeSample
from app.model.target import target_dtype
from app.train.step import BorrowedHeads, DrafterStep

ROWS = 3
"""Distinct synthetic rows cycled through: each step rebuilds its block mask, as in training."""


@dataclass
class DrafterBenchResult:
    """What one benchmark run measured."""

    device: str
    shapes: dict[str, int]
    step_ms: list[float]
    first_call_s: float
    forward_flops: dict[str, float]
    """Useful forward FLOPs per term (`app.model.flops`)."""
    attention_tiles: dict[int | None, AttentionTiles]
    """Per context window of the drafter's layers (None = full), flex's work on the timed rows."""
    step_flops: float
    peak_tflops: float
    peak_memory_bytes: int
    host_syncs: list[str] | None
    """Where one step synchronised with the host (CUDA only; None elsewhere). Should be empty."""
    real_context_tokens: int
    query_tokens: int
    tree_sample: TreeSample | None = None
    """The log steps' tree-streak proxy; None when the config turns it off."""
    tree_step_ms: list[float] | None = None
    """Milliseconds of the same steps with the proxy measured, as on a log step."""
    log_every: int = 1
    profile: str | None = None
    """One step's GPU kernels (host operators on a CPU) by time (`app.bench.profile`), when asked for."""

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_ms)

    @property
    def achieved_tflops(self) -> float:
        return self.step_flops / (self.median_ms / 1e3) / 1e12


def run_drafter_bench(
    config: RunConfig,
    *,
    steps: int = 10,
    warmup: int = 3,
    peak_tflops: float = 790.0,
    device: str | None = None,
    profile_rows: int = 0,
) -> DrafterBenchResult:
    """Build the drafter at the config's shapes and time `steps` training steps after `warmup` ones
    (and with `profile_rows`, list one more step's most expensive operators)."""
    if steps < 1 or warmup < 1:
        raise ValueError("bench drafter: --steps and --warmup must be >= 1")
    device = torch.device(device or _default_device(config))
    cuda = device.type == "cuda"
    arch = DrafterArch.from_config(config)
    drafter = DFlashDrafter(arch, seed=config.train.seed, device=device)
    if cuda and config.compile.mode != "off":
        compile_drafter(drafter)
    heads = BorrowedHeads(*_frozen_head_stand_ins(arch, device, target_dtype(config.target, device)))
    drafter_step = DrafterStep(config, drafter, heads, device)
    # cycled, so the mask is rebuilt every step; the run's seed draws the rows the entries in
    # BENCHMARKS.md were measured on (the useful FLOPs depend on a row's layout)
    batches = synthetic_batches(config, drafter, device, ROWS, seed=config.train.seed)

    def step(batch: FeatureBatch, tree_sample: TreeSample | None = None) -> None:
        """Forward, loss and backward; no optimizer step (what peers' step benchmarks time too)."""
        drafter_step.backward(batch, tree_sample=tree_sample)
        drafter.zero_grad(set_to_none=True)

    first_call_s, step_ms, host_syncs = _time_steps(step, batches, warmup, steps, device)
    peak_memory = torch.cuda.max_memory_allocated(device) if cuda else _peak_rss_bytes()
    with _no_recompiles(device):
        require_finite_steps(drafter_step, batches)
    tree_sample = TreeSample.from_config(config.train, config.telemetry.tree_streak_blocks)
    tree_step_ms = None
    if tree_sample is not None:
        with _no_recompiles(device):
            tree_step_ms = [
                _timed(lambda batch: step(batch, tree_sample), batches[index % len(batches)], device)
                for index in range(steps)
            ]
    profile = None
    if profile_rows:
        with _no_recompiles(device):
            profile = profile_table(lambda: step(batches[0]), device, profile_rows, "one step", matmuls=True)
    row = batches[0].row.to("cpu")
    timed_rows = [batches[index % len(batches)].row for index in range(steps)]
    terms = _mean_forward_flops(arch, timed_rows)
    return DrafterBenchResult(
        device=torch.cuda.get_device_name(device) if cuda else "cpu",
        shapes=_shapes(config, arch, row),
        step_ms=step_ms,
        first_call_s=first_call_s,
        forward_flops=terms,
        attention_tiles=_attention_tiles(arch, timed_rows),
        step_flops=step_flops(terms),
        peak_tflops=peak_tflops,
        peak_memory_bytes=peak_memory,
        host_syncs=host_syncs,
        real_context_tokens=int((row.document_ids >= 0).sum()),
        query_tokens=config.train.anchors * arch.block_size,
        tree_sample=tree_sample,
        tree_step_ms=tree_step_ms,
        log_every=config.telemetry.log_every,
        profile=profile,
    )


class NonFiniteBenchStep(UserError):
    """A benchmarked step's loss or gradients were not finite: its time measures nothing (one line,
    exit 2, like a recompile in the timed steps). NaN data can even run faster, so a kernel option that
    left rows NaN once looked like a faster step (BENCHMARKS.md, 2026-12-02, seventh session)."""


def require_finite_steps(drafter_step: DrafterStep, batches: list[FeatureBatch]) -> None:
    """One more step per benchmarked row, untimed: its loss and every gradient finite, or
    `NonFiniteBenchStep` naming the rows. The flags stay on the device until one read at the end."""
    finite = []
    for batch in batches:
        loss = drafter_step.backward(batch).loss
        gradients = [
            parameter.grad for parameter in drafter_step.drafter.parameters() if parameter.grad is not None
        ]
        finite.append(torch.isfinite(loss) & torch.isfinite(torch.nn.utils.get_total_norm(gradients)))
        drafter_step.drafter.zero_grad(set_to_none=True)
    bad = [index for index, flag in enumerate(torch.stack(finite).tolist()) if not flag]
    if bad:
        raise NonFiniteBenchStep(
            f"bench drafter: the step on synthetic row(s) {bad} of {len(batches)} gave a non-finite loss "
            "or gradient, so its time measures nothing (look at what changed in the drafter's kernels)"
        )


def _mean_forward_flops(arch: DrafterArch, rows: list[DrafterRow]) -> dict[str, float]:
    """Useful forward FLOPs per term over the timed steps' rows, averaged: each row's anchors set
    its attention and LM-head work, so one row's count would misstate the others'."""
    counts = [forward_flops(arch, row) for row in rows]
    return {name: sum(float(count[name]) for count in counts) / len(counts) for name in counts[0]}


@dataclass(frozen=True)
class AttentionTiles:
    """What flex_attention computes in one layer, per row (the mean over the timed rows): the
    128 x 128 tiles of its BlockMask, partial (mask_mod evaluated) and full, against the pairs the
    rule lets through. The gap between the two is masking's share of the attention kernels' time."""

    partial: float
    full: float
    useful_pairs: float

    @property
    def computed_pairs(self) -> float:
        return (self.partial + self.full) * FLEX_TILE**2

    def describe(self) -> str:
        return (
            f"{self.partial:,.0f} partial + {self.full:,.0f} full tiles, {self.useful_pairs / 1e6:,.1f}M useful "
            f"pairs of {self.computed_pairs / 1e6:,.1f}M computed ({100 * self.useful_pairs / self.computed_pairs:.0f}%)"
        )


def _attention_tiles(arch: DrafterArch, rows: list[DrafterRow]) -> dict[int | None, AttentionTiles]:
    """`AttentionTiles` per distinct layer window, from the BlockMasks training builds for `rows`."""
    tiles = {}
    for window in dict.fromkeys(arch.layer_window(layer) for layer in range(arch.num_layers)):
        masks = [training_block_mask(row, arch.block_size, window) for row in rows]
        counts = [
            (
                float(mask.kv_num_blocks.sum()),
                float(mask.full_kv_num_blocks.sum()),
                float(visible_pairs(row, arch.block_size, window)),
            )
            for mask, row in zip(masks, rows, strict=True)
        ]
        tiles[window] = AttentionTiles(*(sum(column) / len(rows) for column in zip(*counts, strict=True)))
    return tiles


def _shapes(config: RunConfig, arch: DrafterArch, row: DrafterRow) -> dict[str, int]:
    """What the report's `shapes:` line names: the step's sizes and the benchmarked row's documents."""
    return {
        "token_budget": config.data.token_budget,
        "anchors": config.train.anchors,
        "block_size": arch.block_size,
        "documents": len(torch.unique(row.document_ids[row.document_ids >= 0])),
        "layers": arch.num_layers,
        "hidden": arch.hidden_size,
        "vocab": arch.vocab_size,
    }


def format_report(result: DrafterBenchResult) -> str:
    """The benchmark's printout: shapes, timings, throughput, FLOPs term by term, memory."""
    seconds = result.median_ms / 1e3
    shapes = ", ".join(f"{name}={value}" for name, value in result.shapes.items())
    lines = [
        f"device: {result.device}",
        f"shapes: {shapes}",
        f"first call (compile + step): {result.first_call_s:.2f} s",
        f"step time (median of {len(result.step_ms)}): {result.median_ms:.2f} ms "
        f"(min {min(result.step_ms):.2f}, max {max(result.step_ms):.2f})",
        f"query tokens/s: {result.query_tokens / seconds:,.0f} (A x B = {result.query_tokens} per step)",
        f"context tokens/s: {result.real_context_tokens / seconds:,.0f} (real tokens, {result.real_context_tokens} per step)",
        "useful FLOPs per step (forward GFLOP x multiplier):",
    ]
    for name, value in result.forward_flops.items():
        lines.append(f"  {name:<32} {value / 1e9:>12,.1f} x{multiplier(name)}")
    lines += [
        f"  {'total (fwd + bwd)':<32} {result.step_flops / 1e9:>12,.1f}",
        f"achieved TFLOP/s: {result.achieved_tflops:.1f} "
        f"({100 * result.achieved_tflops / result.peak_tflops:.1f}% of {result.peak_tflops:g} peak)",
        f"peak memory: {result.peak_memory_bytes / 2**30:.2f} GiB"
        + (" (max allocated)" if result.host_syncs is not None else " (process peak RSS)"),
    ]
    lines.append("attention per layer and row (flex's 128 x 128 tiles):")
    for window, tiles in result.attention_tiles.items():
        lines.append(f"  {'full context' if window is None else f'window {window}'}: {tiles.describe()}")
    if result.tree_step_ms is not None:
        lines.append(_tree_proxy_line(result))
    if result.host_syncs is not None:
        where = f" at {', '.join(result.host_syncs)}" if result.host_syncs else ""
        lines.append(f"host syncs per step: {len(result.host_syncs)}{where}")
    if result.profile is not None:
        lines.append(result.profile)
    return "\n".join(lines)


def _tree_proxy_line(result: DrafterBenchResult) -> str:
    """What the tree-streak proxy adds to a log step, and to the run's mean step (one log step in
    `log_every`)."""
    sample = result.tree_sample
    extra_ms = statistics.median(result.tree_step_ms) - result.median_ms
    share = 100 * extra_ms / result.median_ms
    return (
        f"log step with tree_streak ({sample.blocks} blocks, budget {sample.budget}, top-{sample.top_k}): "
        f"{statistics.median(result.tree_step_ms):.2f} ms median, {extra_ms:+.2f} ms ({share:+.1f}%); "
        f"one step in {result.log_every} (telemetry.log_every): {share / result.log_every:+.2f}% of the step time"
    )


def _frozen_head_stand_ins(
    arch: DrafterArch, device: torch.device, dtype: torch.dtype
) -> tuple[nn.Embedding, nn.Linear]:
    with torch.device(device):
        embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size, dtype=dtype)
        lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False, dtype=dtype)
    for module in (embed_tokens, lm_head):
        nn.init.normal_(module.weight, std=0.02)
        module.requires_grad_(False)
    return embed_tokens, lm_head


def _default_device(config: RunConfig) -> str:
    if config.train.device != "auto":
        return config.train.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def _time_steps(
    step, batches: list[FeatureBatch], warmup: int, steps: int, device: torch.device
) -> tuple[float, list[float], list[str] | None]:
    """The first call's seconds (compile included), then after `warmup` calls the milliseconds of
    `steps` timed ones (a recompile among them raises), and where a step synchronises with the host."""
    cuda = device.type == "cuda"
    started = time.perf_counter()
    step(batches[0])
    synchronize(device)
    first_call_s = time.perf_counter() - started
    for index in range(1, warmup):
        step(batches[index % len(batches)])
    synchronize(device)
    host_syncs = _host_syncs(step, batches[1]) if cuda else None
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    with _no_recompiles(device):
        step_ms = [_timed(step, batches[index % len(batches)], device) for index in range(steps)]
    return first_call_s, step_ms, host_syncs


@contextlib.contextmanager
def _no_recompiles(device: torch.device):
    """On CUDA a recompile inside is a bug: it raises instead of being timed."""
    if device.type != "cuda":
        yield
        return
    with steady_state():
        yield


def _timed(step, batch: FeatureBatch, device: torch.device) -> float:
    if device.type != "cuda":
        started = time.perf_counter()
        step(batch)
        return (time.perf_counter() - started) * 1e3
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    step(batch)
    end.record()
    end.synchronize()
    return begin.elapsed_time(end)


def _host_syncs(step, batch: FeatureBatch) -> list[str]:
    """Run one step with CUDA's sync debug mode on; where each synchronisation it reports happened."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    # the mode's own "prototype feature" notice is not a synchronisation
    return [f"{w.filename}:{w.lineno}" for w in caught if "called a synchronizing" in str(w.message)]


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes
