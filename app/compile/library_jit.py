"""The library-JIT watch: Triton kernels compiled or autotuned after warm-up, by any library.

`fail_on_recompile` covers what torch.compile compiles; a hybrid target's flash-linear-attention
kernels are Triton JIT outside it, and they compile and autotune once per new input shape (0.6 to
10 s each). With the run's target shapes baked (`dflash build-cache`), a steady-state run adds
nothing to its Triton cache: every new entry there (a compiled kernel, or an autotuning result,
which `TRITON_CACHE_AUTOTUNING` keeps on disk) is a compile after warm-up, counted like an inductor
cache miss: a health event, or with `compile.on_cache_miss = abort` the end of the run.
Target ranks count their own cache and report the count with their stats; the logging drafter rank
adds them up.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.telemetry.health import HealthAbort


def triton_cache_entries(directory: str | Path | None = None) -> int:
    """Entries of a Triton cache dir (default: this process's TRITON_CACHE_DIR): one directory per
    compiled kernel or kept autotuning result; 0 when there is none."""
    directory = directory if directory is not None else os.environ.get("TRITON_CACHE_DIR")
    if not directory:
        return 0
    try:
        with os.scandir(directory) as entries:
            return sum(1 for entry in entries if entry.is_dir())
    except FileNotFoundError:
        return 0


@dataclass
class TritonCompiles:
    """What `triton.compile` did in this process while counting (`counting_triton_compiles`): kernels
    compiled, kernels found in the Triton cache, and the seconds inside it for both. It sees the main
    process's calls (a library's JIT kernels, inductor's kernels loaded there), not inductor's compile
    workers: what they compile is an inductor cache miss, counted apart."""

    compiled: int = 0
    loaded: int = 0
    seconds: float = 0.0

    def describe(self) -> str:
        return f"Triton: {self.compiled} compiled, {self.loaded} loaded from its cache in {self.seconds:.1f}s"


@contextlib.contextmanager
def counting_triton_compiles() -> Iterator[TritonCompiles]:
    """Count `triton.compile` calls through Triton's compilation listener (a listener already set
    still gets every call)."""
    from triton import knobs

    counts = TritonCompiles()
    previous = knobs.compilation.listener

    def listener(*, src, metadata, metadata_group, times, cache_hit) -> None:
        counts.loaded += cache_hit
        counts.compiled += not cache_hit
        counts.seconds += times.total / 1e6
        if previous is not None:
            previous(
                src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit
            )

    knobs.compilation.listener = listener
    try:
        yield counts
    finally:
        knobs.compilation.listener = previous


class LibraryJitCounter:
    """New entries of one process's Triton cache since it was created (after warm-up)."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self.directory = directory
        self.baseline = triton_cache_entries(directory)

    def new(self) -> int:
        return max(0, triton_cache_entries(self.directory) - self.baseline)


class LibraryJitAbort(HealthAbort):
    """A Triton compile after warm-up with `compile.on_cache_miss = abort`."""


class LibraryJitWatch:
    """A health watch: an event each time the job's count of library JIT after warm-up grows.

    Reads this process's counter and the target ranks' reported counts (`target_library_jit` of the
    record: one per target rank, split topologies)."""

    def __init__(self, counter: LibraryJitCounter, *, abort: bool, source: str) -> None:
        self.counter = counter
        self.abort = abort
        self.source = source
        self.reported = 0
        self.active: str | None = None

    def check(self, record: dict[str, Any]) -> list[str]:
        total = self.counter.new() + sum(record.get("target_library_jit") or [])
        if total <= self.reported:
            return []
        new, self.reported = total - self.reported, total
        self.active = (
            f"library JIT: {total} Triton kernel compiles or autotunings after warm-up ({new} new in this "
            f"window) although {self.source} was loaded: a target shape or library kernel the cache lacks "
            "costs seconds each; rebuild the cache with `dflash build-cache` for this config"
        )
        if self.abort:
            raise LibraryJitAbort(f"{self.active} (compile.on_cache_miss = abort)")
        return [self.active]
