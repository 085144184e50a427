"""`dflash bench target`: the frozen target's forward (what feeds the drafter) at the run's batch shapes.

The target is the slowest stage on the production class, so its forward is measured alone, per
(rows, length) shape of the run's set (`TargetShapes`), three ways:

- `eager`: `TargetModel.features` with nothing compiled;
- `compiled`: as training runs it: the norms, MLPs and RoPE compiled over a dynamic token dim
  (`app.compile.apply.compile_target`; projections, attention and library kernels such as
  flash-linear-attention's stay as they are);
- `cudagraph`: the eager forward captured once per shape in a CUDA graph and replayed (launch
  overhead removed; the input is copied into the captured buffer first, as a run would).

Each shape's first call (library JIT, compile or capture) is reported apart from the timed repeats.
Throughput counts every token of the padded batch; matmul FLOPs are 2 x tokens x the weights of the
layers that run plus causal attention's score and value products, against a given peak.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from app.bench.profile import profile_table
from app.compile.apply import compile_target
from app.compile.warmup import random_target_batch, synchronize
from app.config import RunConfig
from app.data.shapes import TargetShapes
from app.errors import UserError
from app.model.target import TargetModel, load_target

MODES = ("eager", "compiled", "cudagraph")
Forward = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class ShapeTiming:
    """One shape in one mode."""

    rows: int
    length: int
    first_call_s: float
    """The first call: library JIT (a cold Triton cache), compile or graph capture included."""
    ms: list[float] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return self.rows * self.length

    @property
    def median_ms(self) -> float:
        return statistics.median(self.ms)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / (self.median_ms / 1e3)


@dataclass
class TargetBenchResult:
    device: str
    layers_run: int
    layers_total: int
    peak_tflops: float
    flops_per_token: dict[tuple[int, int], float]
    """Matmul FLOPs per token of each shape (attention's share grows with the length)."""
    modes: dict[str, list[ShapeTiming] | str]
    """Per mode its timings, or why it could not run (its first error line)."""
    profiles: dict[str, str] = field(default_factory=dict)
    """Per mode, its forward's GPU kernels by time at the longest shape (`app.bench.profile`)."""


def bench_shapes(config: RunConfig, count: int | None) -> list[tuple[int, int]]:
    """`count` shapes of the run's set spread from shortest to longest (the longest always in), or all."""
    shapes = TargetShapes.from_config(config.data).all
    if count is None or count >= len(shapes):
        return shapes
    if count < 1:
        raise UserError("bench target: --shapes must be >= 1")
    picks = {round(i * (len(shapes) - 1) / max(1, count - 1)) for i in range(count)} if count > 1 else {-1}
    return [shapes[i] for i in sorted(picks)]


def run_target_bench(
    config: RunConfig,
    shapes: list[tuple[int, int]],
    modes: list[str],
    repeats: int,
    peak_tflops: float,
    log: Callable[[str], None],
    profile_rows: int = 0,
) -> TargetBenchResult:
    """Load the configured target on CUDA and time its forward at `shapes` in each of `modes`; each
    shape's line is logged as it is measured (a long run cut short keeps what it measured). With
    `profile_rows`, each mode's forward at the longest shape is profiled after its timings."""
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise UserError(f"bench target: --modes: unknown {unknown}; expected some of {list(MODES)}")
    if not torch.cuda.is_available():
        raise UserError("bench target: needs a CUDA GPU (the target forward is measured where it trains)")
    device = torch.device("cuda")
    target = load_target(config, device)
    result = TargetBenchResult(
        device=torch.cuda.get_device_name(device),
        layers_run=len(target.layers_run),
        layers_total=target.num_layers,
        peak_tflops=peak_tflops,
        flops_per_token={shape: _matmul_flops_per_token(target, shape[1]) for shape in shapes},
        modes={},
    )
    log(f"device: {result.device}; target: {result.layers_run} of {result.layers_total} layers run")
    # eager and cudagraph first: compiling patches the target's modules for the rest of the process
    for mode in sorted(modes, key=MODES.index):
        if mode == "compiled":
            compile_target(target)
        timings: list[ShapeTiming] = []
        try:
            for rows, length in shapes:
                timings.append(_time_shape(target, mode, rows, length, repeats))
                log(f"{mode:<9} {format_timing(result, timings[-1])}")
            result.modes[mode] = timings
        except Exception as error:  # a mode that cannot run is a finding of the benchmark
            result.modes[mode] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"
            log(f"{mode:<9} could not run: {result.modes[mode]}")
            continue
        if profile_rows and mode != "cudagraph":  # a replayed graph is one launch: nothing to rank
            result.profiles[mode] = _profile(
                target, mode, max(shapes, key=lambda shape: shape[1]), profile_rows
            )
            log(result.profiles[mode])
    return result


def _profile(target: TargetModel, mode: str, shape: tuple[int, int], rows: int) -> str:
    """The forward's kernels at `shape` (already run once: no first-call work inside the profile)."""
    input_ids = random_target_batch(target, *shape)
    what = f"the {mode} forward at {shape[0]} x {shape[1]}"
    return profile_table(lambda: target.features(input_ids), target.device, rows, what)


def _time_shape(target: TargetModel, mode: str, rows: int, length: int, repeats: int) -> ShapeTiming:
    input_ids = random_target_batch(target, rows, length)
    started = time.perf_counter()
    forward = _graphed(target, input_ids) if mode == "cudagraph" else target.features
    forward(input_ids)
    synchronize(target.device)
    timing = ShapeTiming(rows, length, first_call_s=time.perf_counter() - started)
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        forward(input_ids)
        end.record()
        end.synchronize()
        timing.ms.append(begin.elapsed_time(end))
    return timing


def _graphed(target: TargetModel, example: torch.Tensor) -> Forward:
    """The eager forward captured in a CUDA graph for `example`'s shape (after one eager call, which
    runs any library JIT and autotuning outside the capture)."""
    static_input = example.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        target.features(static_input)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_output = target.features(static_input)

    def replay(input_ids: torch.Tensor) -> torch.Tensor:
        static_input.copy_(input_ids)
        graph.replay()
        return static_output

    return replay


def _matmul_flops_per_token(target: TargetModel, length: int) -> float:
    """2 x the matrix weights of the layers that run, plus causal attention (scores and values: on
    average `length / 2` keys per query) in its full-attention layers."""
    weights = sum(
        module.weight.numel()
        for layer in target.layers_run
        for module in layer.modules()
        if isinstance(module, nn.Linear)
    )
    config = target.text_config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    full_attention = sum(1 for layer in target.layers_run if _is_full_attention(layer))
    attention = full_attention * 2 * 2 * config.num_attention_heads * head_dim * (length / 2)
    return 2 * weights + attention


def _is_full_attention(layer: nn.Module) -> bool:
    return getattr(layer, "layer_type", "full_attention") == "full_attention" and hasattr(layer, "self_attn")


def format_timing(result: TargetBenchResult, timing: ShapeTiming) -> str:
    """One shape in one mode: tok/s, ms, first call, matmul TFLOP/s and its share of the peak."""
    flops = result.flops_per_token[(timing.rows, timing.length)] * timing.tokens_per_s / 1e12
    return (
        f"{timing.rows:>3} x {timing.length:<6} {timing.tokens_per_s / 1e3:6.2f}K tok/s  "
        f"{timing.median_ms:8.1f} ms (min {min(timing.ms):.1f}, max {max(timing.ms):.1f})  "
        f"first call {timing.first_call_s:6.2f} s  {flops:5.0f} TFLOP/s ({100 * flops / result.peak_tflops:4.1f}%)"
    )


def format_report(result: TargetBenchResult) -> str:
    """Each mode's token-weighted throughput over the shapes, and its ratio to eager."""
    lines = []
    overall: dict[str, float] = {}
    for mode, timings in result.modes.items():
        if isinstance(timings, str):
            lines.append(f"{mode}: could not run: {timings}")
            continue
        tokens = sum(timing.tokens for timing in timings)
        overall[mode] = tokens / sum(timing.median_ms / 1e3 for timing in timings)
        lines.append(f"{mode}: {overall[mode] / 1e3:.2f}K tok/s over its shapes ({tokens} tokens per pass)")
    if "eager" in overall:
        for mode, tokens_per_s in overall.items():
            if mode != "eager":
                lines.append(f"{mode} / eager: {tokens_per_s / overall['eager']:.3f}x")
    return "\n".join(lines)
