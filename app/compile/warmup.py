"""Warm-up at the run's exact shapes: what compiles every kernel before the first real step.

A synthetic FeatureBatch has the shapes and dtypes of every real one (rows are fixed-shape:
`token_budget` context tokens, `anchors` blocks), so one forward + backward through the drafter and
the chunked loss compiles (or loads) everything training will call. Gradients are dropped
afterwards and no optimizer step runs, so warm-up leaves training state untouched.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from app.compile.library_jit import counting_triton_compiles
from app.config import RunConfig
from app.data.batch import FeatureBatch
from app.data.shapes import TargetShapes
from app.data.synthetic import synthetic_row
from app.model.drafter import DFlashDrafter
from app.model.objective import training_autocast
from app.model.target import TargetModel, is_hybrid, target_dtype

Log = Callable[[str], None]
WARMUP_SEED = 1234
"""Seed of the synthetic rows (independent of the run's seed: warm-up must not touch its RNG streams)."""


class TrainingStep(Protocol):
    """The training step warm-up and timing run: `app.train.step.DrafterStep` (compile/ sits below
    train/ and does not import it)."""

    drafter: DFlashDrafter
    device: torch.device

    def backward(self, batch: FeatureBatch) -> object: ...

    def apply(self, lr: float) -> torch.Tensor: ...


StepFactory = Callable[[RunConfig, DFlashDrafter, TargetModel, torch.device], TrainingStep]
"""Builds the training step over a drafter and the target whose heads it borrows."""


def synthetic_batches(
    config: RunConfig, drafter: DFlashDrafter, device: torch.device, count: int, seed: int = WARMUP_SEED
) -> list[FeatureBatch]:
    """`count` fixed-shape feature batches laid out like real rows: packed with documents of the
    run's `data.max_length` (the heaviest rows its data can make), anchors among supervised tokens;
    `seed` draws the anchors."""
    arch = drafter.arch
    token_budget = config.data.token_budget
    generator = torch.Generator().manual_seed(seed)
    # One features tensor shared by all rows: at production shapes each one is gigabytes.
    width = arch.feature_size + (arch.hidden_size if config.train.soft_targets > 0 else 0)
    features = torch.randn(
        token_budget,
        width,
        device=device,
        dtype=target_dtype(config.target, device),
        generator=torch.Generator(device).manual_seed(WARMUP_SEED),
    )
    rows = [
        synthetic_row(
            token_budget,
            config.train.anchors,
            arch.vocab_size,
            document_length=config.data.max_length,
            generator=generator,
        ).to(device)
        for _ in range(count)
    ]
    return [FeatureBatch.split(row, features, arch.feature_size) for row in rows]


def warm_up_drafter(config: RunConfig, step: TrainingStep) -> float:
    """Compile (or load) everything one training step compiles; returns the seconds it took. The
    gradients are dropped and no optimizer step runs: the training state is left as it was."""
    (batch,) = synthetic_batches(config, step.drafter, step.device, 1)
    started = time.perf_counter()
    step.backward(batch)
    step.drafter.zero_grad(set_to_none=True)
    synchronize(step.device)
    return time.perf_counter() - started


@dataclass(frozen=True)
class StepTiming:
    """Steady-state seconds per step, measured after warm-up."""

    drafter_step_s: float
    """Drafter forward + backward + clip + optimizer step."""
    target_forward_s: float | None
    """One target forward over `token_budget` tokens (what a colocated step adds); None if not measured."""
    steps: int


def time_training_steps(
    config: RunConfig, step: TrainingStep, target: TargetModel, *, steps: int, warmup_steps: int = 2
) -> StepTiming:
    """Time full optimizer steps at the run's shapes (and one target forward). The step's drafter and
    optimizer change: give it a step built for measuring only."""
    batches = synthetic_batches(config, step.drafter, step.device, 3)

    def one(index: int) -> None:
        step.backward(batches[index % len(batches)])
        step.apply(config.train.lr)

    for index in range(warmup_steps):
        one(index)
    synchronize(step.device)
    started = time.perf_counter()
    for index in range(steps):
        one(index)
    synchronize(step.device)
    drafter_step_s = (time.perf_counter() - started) / steps
    return StepTiming(drafter_step_s, time_target_forward(config, target, step.device), steps)


def time_target_forward(
    config: RunConfig, target: TargetModel, device: torch.device, repeats: int = 3
) -> float:
    """Seconds per target forward over a full batch (`token_budget // max_length` rows of `max_length`)."""
    rows = max(1, config.data.token_budget // config.data.max_length)
    batch = random_target_batch(target, rows, config.data.max_length)
    return time_target_forwards(target, [batch] * repeats, device)


def time_target_forwards(target: TargetModel, batches: list[torch.Tensor], device: torch.device) -> float:
    """Mean seconds of the target forward over `batches` (`[b, L]` token ids on `device`), after one
    untimed forward of the first."""
    target.features(batches[0])
    synchronize(device)
    started = time.perf_counter()
    for input_ids in batches:
        target.features(input_ids)
    synchronize(device)
    return (time.perf_counter() - started) / len(batches)


def uses_library_triton_kernels(target: TargetModel) -> bool:
    """A hybrid (linear-attention) target with flash-linear-attention installed JIT-compiles and
    autotunes Triton kernels for each new input shape (about 40 s on its first forward on an H200,
    up to 10 s per new shape): those belong in the baked cache."""
    return is_hybrid(target.text_config) and importlib.util.find_spec("fla") is not None


def warm_up_own_triton_kernels(config: RunConfig, lm_head: torch.nn.Linear) -> None:
    """Compile the drafter's own Triton kernel, the loss's cross-entropy chunk, for the logits the
    run's loss makes (`warm_up_logits`; the chunk's row count is only its launch grid): build-cache
    bakes it beside the library kernels, so a warm start loads it rather than compiling it."""
    from app.model.ce_kernel import triton_ce_chunk  # Triton: see app.compile.apply.compile_drafter

    device = lm_head.weight.device
    first = torch.zeros(1, device=device, dtype=torch.long)
    triton_ce_chunk(warm_up_logits(config, lm_head), first, torch.zeros(1, device=device))
    synchronize(device)


def warm_up_logits(config: RunConfig, lm_head: torch.nn.Linear) -> torch.Tensor:
    """One row of logits as the loss makes them: through the LM head under the step's autocast, so in
    its dtype (bf16 from an fp32 head under bf16 autocast). Triton compiles a kernel per logits dtype."""
    weight = lm_head.weight
    with torch.no_grad(), training_autocast(config.train, weight.device):
        return torch.zeros(1, weight.shape[1], device=weight.device, dtype=weight.dtype) @ weight.t()


def warm_target_shapes(config: RunConfig, target: TargetModel, device: torch.device, log: Log) -> float:
    """One target forward at every (rows, length) a batch of the run can have (`TargetShapes`), so
    that every library kernel and autotuning result the run needs is in the Triton cache; returns
    the seconds it took."""
    shapes = TargetShapes.from_config(config.data).all
    started = time.perf_counter()
    for number, (rows, length) in enumerate(shapes, start=1):
        target.features(random_target_batch(target, rows, length))
        synchronize(device)
        if number % 10 == 0 or number == len(shapes):
            log(f"  target shapes warmed: {number}/{len(shapes)} ({time.perf_counter() - started:.0f}s)")
    return time.perf_counter() - started


def warm_up_target(config: RunConfig, target: TargetModel, device: torch.device) -> str:
    """One target forward at the run's longest and one at its shortest batch shape, on the main thread
    before any data thread exists: the process's first use of each target kernel (loading the baked
    library ones and the compiled norms, MLPs and RoPE, cuBLAS, the allocator's growth) happens here, not in
    the first steps. Both ends, so that whatever the compiled modules' token dim splits on (int32
    indexing at large sizes) is loaded now, not compiled later. Returns the log line: the seconds of
    each end's forward, how much of them torch.compile and inductor's autotuning took, and what Triton
    compiled and loaded (from a matching baked cache nothing is compiled or autotuned)."""
    shapes = TargetShapes.from_config(config.data).all
    ends = [shapes[-1]] if len(shapes) == 1 else [shapes[-1], shapes[0]]
    before = compile_seconds()
    seconds = []
    with counting_triton_compiles() as triton:
        for rows, length in ends:
            started = time.perf_counter()
            target.features(random_target_batch(target, rows, length))
            synchronize(device)
            seconds.append(time.perf_counter() - started)
    compiled, autotuned = (now - then for now, then in zip(compile_seconds(), before, strict=True))
    conv = f"; linear-attention conv on {target.conv_kernel}" if target.conv_kernel else ""
    done = " and ".join(f"{rows}x{length}" for rows, length in ends)
    each = " + ".join(f"{part:.1f}s" for part in seconds)
    return (
        f"target warm-up: {sum(seconds):.1f}s (a forward at {done}: {each}, of which torch.compile "
        f"{compiled:.1f}s, inductor's autotuning {autotuned:.1f}s; {triton.describe()}{conv})"
    )


AUTOTUNE_EVENT = "CachingAutotuner.benchmark_all_configs"
"""torch's timer around an inductor kernel benchmarking its configs at its first launch."""


def compile_seconds() -> tuple[float, float]:
    """Seconds this process has spent so far in torch.compile (Dynamo's tracing, AOTAutograd and
    inductor, a load from the cache included, forward and backward graphs) and in inductor's runtime
    autotuning, which torch.compile's total leaves out (none when the results came with the cache).
    A warm start still traces every compiled function: this says how much of a warm-up that is,
    against the kernels' first launches and the work itself."""
    from torch._dynamo.utils import calculate_time_spent

    spent = calculate_time_spent()
    return spent["total_wall_time"], spent.get(AUTOTUNE_EVENT, 0.0)


def random_target_batch(target: TargetModel, rows: int, length: int, seed: int = WARMUP_SEED) -> torch.Tensor:
    """`[rows, length]` random token ids on the target's device, drawn from `seed`: a target batch
    of that shape for warm-ups and benchmarks (the forward's cost does not depend on the tokens)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, target.vocab_size, (rows, length), generator=generator).to(target.device)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a timing boundary); a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
