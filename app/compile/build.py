"""`dflash build-cache`: compile everything a training step compiles, at the run's shapes, and bake it.

One process, main thread only (the incident's threads racing to compile flex_attention cannot happen
here). It compiles into the key's inductor dir, emptied first (the path training starts will load the
cache into: see `key_inductor_dir`), and a fresh Triton staging dir, so the measured compile time is
a cold one and the baked Triton files are exactly those this build produced. The entry is written
atomically under `compile.cache_dir/<key>/`; rerunning with a matching, intact entry is a no-op.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from app.compile.apply import compile_drafter, compile_target, reset_compiled_state
from app.compile.artifacts import (
    CacheEntry,
    CacheEntryError,
    copy_triton_host_modules,
    find_entry,
    write_entry,
)
from app.compile.environment import CompileDirs, ensure_user_and_home, key_inductor_dir, use_compile_dirs
from app.compile.guard import (
    baseline_step_time,
    compiles_on,
    read_counters,
    steady_state,
    verify_fx_trace_flags,
)
from app.compile.key import cache_key, key_fields
from app.compile.warmup import (
    StepFactory,
    StepTiming,
    time_training_steps,
    uses_library_triton_kernels,
    warm_target_shapes,
    warm_up_drafter,
    warm_up_own_triton_kernels,
    warm_up_target,
)
from app.config.schema import RunConfig
from app.data.shapes import TargetShapes
from app.errors import UserError
from app.model.drafter import DFlashDrafter, DrafterArch
from app.model.target import load_target

Log = Callable[[str], None]

TIMED_STEPS = 10
"""Optimizer steps timed for the baseline (after 2 untimed ones)."""


@dataclass(frozen=True)
class BuildResult:
    entry: CacheEntry
    built: bool
    """False when a matching, intact entry already existed (nothing was compiled)."""


def build_cache(
    config: RunConfig, new_step: StepFactory, *, force: bool = False, log: Log = print
) -> BuildResult:
    """Build (or confirm) the compile cache of `config` on this machine's current CUDA device.

    `new_step` builds the training step (`app.train.step.DrafterStep`): the cache holds what that
    step compiles, and its measured time is the run's throughput baseline."""
    if not torch.cuda.is_available():
        raise UserError(
            "build-cache: no CUDA device visible; a compile cache is built on the GPU model it is for "
            "(on CPU nothing is compiled: compile.mode auto runs eager there)"
        )
    device = torch.device("cuda", torch.cuda.current_device())
    compiles_on(config.compile.mode, device)  # refuses compile.mode = "off" on CUDA
    fields = key_fields(config, DrafterArch.from_config(config), device)
    key = cache_key(fields)
    cache_dir = Path(config.compile.cache_dir).expanduser()
    existing = _intact_entry(cache_dir, key, log)
    if existing is not None and not force:
        log(f"compile cache {existing.describe()} is up to date for this machine and config: nothing to do")
        return BuildResult(existing, built=False)

    ensure_user_and_home()
    staging = cache_dir / f".build-{key}-{os.getpid()}"
    dirs = use_compile_dirs(_emptied(key_inductor_dir(config.compile, key)), staging / "triton")
    try:
        with _phases(log) as phase:
            entry = _compile_and_save(config, new_step, device, key, fields, cache_dir, dirs, staging, phase)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(f"compile cache written: {entry.path} ({entry.manifest['artifacts']['bytes'] / 1e6:.1f} MB)")
    return BuildResult(entry, built=True)


def _compile_and_save(
    config: RunConfig,
    new_step: StepFactory,
    device: torch.device,
    key: str,
    fields: dict,
    cache_dir: Path,
    dirs: CompileDirs,
    staging: Path,
    phase: Log,
) -> CacheEntry:
    phase("loading the target")
    target = load_target(config, device)
    baked_triton = staging / "triton-baked"
    target_warm_s = None
    reset_compiled_state()
    # Before anything inductor compiles: the Triton dir then holds the library's kernels and the
    # drafter's own only (inductor's come back with its cache artifacts).
    if uses_library_triton_kernels(target):
        shapes = TargetShapes.from_config(config.data)
        phase(f"target forward at each of the run's {shapes.describe()} (library Triton JIT and autotuning)")
        target_warm_s = warm_target_shapes(config, target, device, phase)
    phase("the drafter's own Triton kernel (the loss's cross-entropy chunk)")
    warm_up_own_triton_kernels(config, target.lm_head)
    shutil.copytree(dirs.triton, baked_triton)

    phase(
        "compiling drafter forward + backward + chunked loss at the run's shapes, and the target's norms, MLPs and RoPE (cold)"
    )
    drafter = DFlashDrafter(DrafterArch.from_config(config, target), seed=config.train.seed, device=device)
    compile_drafter(drafter)
    compile_target(target)
    step = new_step(config, drafter, target, device)
    before = read_counters()
    compile_s = warm_up_drafter(config, step)
    phase(warm_up_target(config, target, device))  # its compiled norms, MLPs and RoPE, at both shape ends

    phase(f"timing {TIMED_STEPS} optimizer steps (a recompile here fails the build)")
    with steady_state():
        timing = time_training_steps(config, step, target, steps=TIMED_STEPS)
    counters = read_counters() - before
    verify_fx_trace_flags()

    phase("saving the cache artifacts")
    copy_triton_host_modules(dirs.triton, baked_triton)
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        raise RuntimeError(
            "torch recorded no compile-cache artifacts: is the inductor cache disabled "
            "(TORCHINDUCTOR_FORCE_DISABLE_CACHES / fx_graph_cache off)?"
        )
    artifacts, info = saved
    measured = _measured(config, timing, compile_s)
    build = {
        "device": torch.cuda.get_device_name(device),
        "counters": counters.to_dict(),
        "target_warm_s": target_warm_s,
        "inductor_dir": str(dirs.inductor),
        "command": " ".join(sys.argv),
    }
    counts = {kind: len(keys) for kind, keys in info.artifacts.items()}
    return write_entry(cache_dir, key, fields, artifacts, counts, baked_triton, measured, build)


def _measured(config: RunConfig, timing: StepTiming, compile_s: float) -> dict:
    """The manifest's `measured`: the timed step, the run's throughput baseline and what it covers."""
    times = {"drafter_step_s": timing.drafter_step_s, "target_forward_s": timing.target_forward_s}
    return {
        **times,
        "step_time_s": baseline_step_time(times, config),
        "topology": "colocated" if config.topology.target_ranks == 0 else "split",
        "timed_steps": timing.steps,
        "context_tokens_per_step": config.data.token_budget,
        "query_tokens_per_step": config.train.anchors * config.drafter.block_size,
        "cold_compile_s": compile_s,
    }


def _emptied(directory: Path) -> Path:
    """`directory`, removed if it exists: a build into kernels already there would not compile cold."""
    try:
        shutil.rmtree(directory)
    except FileNotFoundError:
        pass
    except OSError as error:
        raise UserError(
            f"build-cache: cannot empty the inductor dir {directory} ({error.strerror})"
        ) from None
    return directory


def _intact_entry(cache_dir: Path, key: str, log: Log) -> CacheEntry | None:
    try:
        entry = find_entry(cache_dir, key)
        if entry is not None:
            entry.check_artifacts()
        return entry
    except CacheEntryError as error:
        log(f"rebuilding: {error}")
        return None


@contextlib.contextmanager
def _phases(log: Log) -> Iterator[Log]:
    """`phase(text)` logs each step with the elapsed time; on a terminal a spinner shows it is alive."""
    from rich.console import Console

    console = Console(stderr=True)
    started = time.monotonic()
    status = console.status("build-cache") if console.is_terminal else contextlib.nullcontext()
    with status as spinner:

        def phase(text: str) -> None:
            log(f"[{time.monotonic() - started:6.1f}s] {text}")
            if spinner is not None:
                spinner.update(f"build-cache: {text}")

        yield phase
    log(f"[{time.monotonic() - started:6.1f}s] done")
