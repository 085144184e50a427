"""Train start: load the matching baked cache, warm up on the main thread, verify, lock the kernels.

The order is the point (docs/architecture.md, Compile cache): directories before anything compiles,
artifacts before the first compiled call, warm-up on the main thread before any data thread or worker
exists, counters right after warm-up, and only then the `fail_on_recompile` stance for the rest of the run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from app.compile.apply import compile_drafter, compile_target
from app.compile.artifacts import CacheEntry, CacheEntryError, find_entry, load_entry
from app.compile.catalog import nearest_mismatch
from app.compile.environment import ensure_user_and_home, key_inductor_dir, use_compile_dirs
from app.compile.guard import (
    CompileCacheMiss,
    CompileCounters,
    baseline_step_time,
    cache_use_problems,
    compiles_on,
    enter_steady_state,
    read_counters,
    verify_fx_trace_flags,
)
from app.compile.key import cache_key, key_fields
from app.compile.library_jit import LibraryJitCounter, counting_triton_compiles
from app.compile.target_graphs import GraphedTargetFeatures
from app.compile.warmup import TrainingStep, compile_seconds, warm_up_drafter, warm_up_target
from app.config.schema import RunConfig
from app.data.shapes import TargetShapes
from app.model.target import TargetModel

Log = Callable[[str], None]


@dataclass
class CompileReport:
    """What train start did about compilation, as plain data: for the log, status.json and the health
    watches `app.telemetry.compile_watches` builds from it."""

    compiled: bool
    device: str
    key: str | None = None
    cache_path: Path | None = None
    """The matching entry's directory, when one was found."""
    cache_loaded: bool = False
    loaded_artifacts: dict[str, int] = field(default_factory=dict)
    counters_before: CompileCounters = field(default_factory=CompileCounters)
    counters_after: CompileCounters = field(default_factory=CompileCounters)
    warmup_s: float = 0.0
    warmup_compile_s: float = 0.0
    """Of `warmup_s`, the seconds in torch.compile (tracing, and loading or compiling graphs); the rest
    is the step's own work and its kernels' first launches."""
    baseline_step_s: float | None = None
    """Expected seconds per optimizer step for this run's topology (from the manifest)."""
    baseline_source: str = ""
    """Where the baseline was measured (the loaded cache entry)."""
    problems: list[str] = field(default_factory=list)
    """What went wrong at start (a cache miss, a damaged entry), one line each."""
    library_jit: Callable[[], int] | None = None
    """Triton compiles and autotunings of this process since warm-up, counted when called; None when
    no baked Triton cache was loaded (then nothing says what is new)."""
    library_jit_source: str = ""
    """The loaded entry whose kernels a later compile lacked."""
    target_forward: GraphedTargetFeatures | None = None
    """The target's CUDA graphs (`compile.target_cuda_graphs`), captured after its warm-up."""

    @property
    def warmup_counters(self) -> CompileCounters:
        return self.counters_after - self.counters_before

    def to_dict(self) -> dict[str, Any]:
        return {
            "compiled": self.compiled,
            "device": self.device,
            "key": self.key,
            "cache_path": str(self.cache_path) if self.cache_path else None,
            "cache_loaded": self.cache_loaded,
            "loaded_artifacts": self.loaded_artifacts,
            "warmup_counters": self.warmup_counters.to_dict(),
            "warmup_s": round(self.warmup_s, 3),
            "warmup_compile_s": round(self.warmup_compile_s, 3),
            "baseline_step_s": self.baseline_step_s,
            "problems": self.problems,
        }


def prepare_compiled_training(
    config: RunConfig, step: TrainingStep, log: Log, target: TargetModel | None = None
) -> CompileReport:
    """Call once, on the main thread, after building the training step and before the first one.

    `step` is the run's DrafterStep over the bare drafter, before any DDP wrapping; `target` the
    target this process runs (colocated), if any.

    On CPU (eager) this only checks the mode and returns. On CUDA: set up the cache directories,
    load the cache whose key matches, compile the drafter's layers (and the target's norms, MLPs and RoPE),
    warm up at the run's exact shapes (the target at both ends of its shape set), check the cache
    counters (the target's compiled modules included), then set the fail_on_recompile
    stance (wrap steps in `app.compile.recompile_errors()`).
    """
    drafter, device = step.drafter, step.device
    compile_config = config.compile
    if not compiles_on(compile_config.mode, device, drafter.attention_backend):
        return CompileReport(compiled=False, device=str(device))

    ensure_user_and_home()
    fields = key_fields(config, drafter.arch, device)
    key = cache_key(fields)
    report = CompileReport(compiled=True, device=str(device), key=key)
    dirs = use_compile_dirs(key_inductor_dir(compile_config, key))
    cache_dir = Path(compile_config.cache_dir).expanduser()
    entry = _load_matching_entry(cache_dir, dirs.triton, report, on_miss=compile_config.on_cache_miss)
    if entry is not None:
        log(f"compile cache: loaded {entry.describe()} into {dirs.inductor}")
        _warn_if_built_elsewhere(entry, dirs.inductor, log)
    elif report.problems:
        log(f"error: {report.problems[-1]}")
    else:
        log(no_cache_message(cache_dir, report.key, fields, compile_config.cold_start))

    compile_drafter(drafter)
    if target is not None:
        compile_target(target)
    report.counters_before = read_counters()
    compiling_before, _ = compile_seconds()
    with counting_triton_compiles() as own_kernels:  # the loss's Triton kernel: baked, it only loads
        report.warmup_s = warm_up_drafter(config, step)
    report.warmup_compile_s = compile_seconds()[0] - compiling_before
    target_line = warm_up_target(config, target, device) if target is not None else None
    report.counters_after = read_counters()
    verify_fx_trace_flags()
    log(
        f"compile warm-up: {report.warmup_s:.1f}s (of which torch.compile {report.warmup_compile_s:.1f}s; "
        f"{report.warmup_counters.describe()}; {own_kernels.describe()})"
    )
    if target_line:
        log(target_line)
    if target is not None and config.compile.target_cuda_graphs:
        report.target_forward = capture_target_graphs(config, target, log)

    report.problems += _reported_cache_use(report.warmup_counters, report.cache_loaded, config, log)

    if entry is not None and entry.triton_path is not None:
        # From here on (warm-up done, baked kernels in place) a new Triton cache entry is library JIT.
        report.library_jit = LibraryJitCounter(dirs.triton).new
        report.library_jit_source = entry.key
    if entry is not None:
        report.baseline_step_s = baseline_step_time(entry.measured, config)
        report.baseline_source = f"compile cache {entry.path}"
    if compile_config.fail_on_recompile:
        enter_steady_state()
    return report


def capture_target_graphs(config: RunConfig, target: TargetModel, log: Log) -> GraphedTargetFeatures:
    """The target's forward captured at every batch shape of the run (after its warm-up, on the main
    thread, before the fail_on_recompile stance: a shape that compiled anything would say so now)."""
    graphs = GraphedTargetFeatures(
        target,
        TargetShapes.from_config(config.data).all,
        config.data.token_budget,
        final_hidden=config.train.soft_targets > 0,
    )
    log(graphs.describe())
    return graphs


def _load_matching_entry(
    cache_dir: Path, triton_dir: Path, report: CompileReport, on_miss: str
) -> CacheEntry | None:
    """Find and hot-load the entry of `report.key`; a damaged one is a problem (or, with abort, fatal)."""
    assert report.key is not None
    try:
        entry = find_entry(cache_dir, report.key)
        if entry is None:
            return None
        report.loaded_artifacts = load_entry(entry, triton_dir)
    except CacheEntryError as error:
        if on_miss == "abort":
            raise
        report.problems.append(f"compile cache unusable, compiling from scratch: {error}")
        return None
    report.cache_path, report.cache_loaded = entry.path, True
    return entry


def _warn_if_built_elsewhere(entry: CacheEntry, inductor_dir: Path, log: Log) -> None:
    built_in = entry.built_elsewhere(inductor_dir)
    if built_in is not None:
        log(
            f"WARNING: compile cache {entry.key} was built in the inductor dir {built_in}, this run uses "
            f"{inductor_dir}: every start re-tunes the kernels' launch configs (seconds) and inductor writes "
            f"them under {built_in}. Build and train with the same compile.inductor_dir"
        )


def no_cache_message(cache_dir: Path, key: str | None, fields: dict[str, Any], cold_start: str) -> str:
    """What a start with no baked entry for its key says (`compile.cold_start`)."""
    if cold_start == "expected":
        return (
            f"compile cache: none for key {key} in {cache_dir} (a cold start, expected here): compiling now"
        )
    nearest = nearest_mismatch(cache_dir, fields)
    differs = (
        f"; nearest cache {nearest.entry.key} differs in {', '.join(nearest.differences)}" if nearest else ""
    )
    return (
        f"WARNING: no compile cache for key {key} in {cache_dir}/{differs}. Compiling from scratch "
        "(minutes at production shapes, and every restart pays it again): build the cache for this "
        "machine and config with `dflash build-cache CONFIG [overrides]` (or `just build-cache CONFIG`)"
    )


def prepare_target_rank(config: RunConfig, device: torch.device | str, log: Log) -> Path | None:
    """A target-only rank compiles the target's norms, MLPs and RoPE (`compile_target`, in `TargetWorker`)
    and runs a hybrid target's library Triton kernels (40 s of JIT per process): both come from the
    baked entry. Point the caches at the persistent dirs and hot-load the entry of the run's key.

    Returns the entry used, or None (eager device, or no entry: the target compiles from scratch).
    """
    from app.model.drafter import DrafterArch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    ensure_user_and_home()
    key = cache_key(key_fields(config, DrafterArch.from_config(config), device))
    dirs = use_compile_dirs(key_inductor_dir(config.compile, key))
    entry = find_entry(Path(config.compile.cache_dir).expanduser(), key)
    if entry is None:
        log(
            f"WARNING: no compile cache for key {key}: this target rank compiles its norms, MLPs and RoPE cold"
        )
        return None
    load_entry(entry, dirs.triton)
    log(f"compile cache: loaded {entry.describe()} into {dirs.inductor}")
    return entry.path


def start_target_rank(
    config: RunConfig, target: TargetModel, cache_loaded: bool, log: Log
) -> GraphedTargetFeatures | None:
    """A target rank's compile and warm-up, on its main thread before its preparer thread exists:
    compile the target's norms, MLPs and RoPE, warm up at both ends of the shape set, check the cache
    counters like a drafter rank (`cache_loaded`: `prepare_target_rank` found the entry), then take the
    fail_on_recompile stance (wrap forwards in `app.compile.recompile_errors()`). CUDA only. Returns the
    target's CUDA graphs with `compile.target_cuda_graphs`, else None."""
    compile_target(target)
    before = read_counters()
    log(warm_up_target(config, target, target.device))
    graphs = capture_target_graphs(config, target, log) if config.compile.target_cuda_graphs else None
    _reported_cache_use(read_counters() - before, cache_loaded, config, log)
    if config.compile.fail_on_recompile:
        enter_steady_state()
    return graphs


def _reported_cache_use(
    warmup: CompileCounters, cache_loaded: bool, config: RunConfig, log: Log
) -> list[str]:
    """The warm-up's cache misses and bypasses after a loaded entry (`cache_use_problems`), each logged
    as an error line; the first ends the run with `compile.on_cache_miss = abort`."""
    problems = cache_use_problems(warmup, cache_loaded)
    for problem in problems:
        log(f"error: {problem}")
    if problems and config.compile.on_cache_miss == "abort":
        raise CompileCacheMiss(f"{problems[0]} (compile.on_cache_miss = abort)")
    return problems
