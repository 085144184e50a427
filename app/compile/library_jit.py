"""Library JIT: Triton kernels compiled or autotuned after warm-up, by any library, counted.

`fail_on_recompile` covers what torch.compile compiles; a hybrid target's flash-linear-attention
kernels are Triton JIT outside it, and they compile and autotune once per new input shape (0.6 to
10 s each). With the run's target shapes baked (`dflash build-cache`), a steady-state run adds
nothing to its Triton cache: every entry written there (a compiled kernel, new or compiled again
into a baked entry, or an autotuning result, which `TRITON_CACHE_AUTOTUNING` keeps on disk) is a
compile after warm-up, counted like an inductor cache miss: a health event, or with
`compile.on_cache_miss = abort` the end of the run (the watch: `app.telemetry.compile_watches`).
Target ranks count their own cache and report the count with their stats; the logging drafter rank
adds them up.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path


def triton_cache_entries(directory: str | Path | None = None) -> dict[str, int]:
    """The entries of a Triton cache dir (default: this process's TRITON_CACHE_DIR), each with its
    directory's mtime in ns: one directory per compiled kernel or kept autotuning result, whose mtime
    moves when Triton writes into it (a kernel compiled again into its entry, as when its group file
    names files that are gone); empty when there is none."""
    directory = directory if directory is not None else os.environ.get("TRITON_CACHE_DIR")
    if not directory:
        return {}
    try:
        with os.scandir(directory) as entries:
            return {entry.name: entry.stat().st_mtime_ns for entry in entries if entry.is_dir()}
    except FileNotFoundError:
        return {}


@dataclass
class TritonCompiles:
    """What `triton.compile` did in this process while counting (`counting_triton_compiles`): kernels
    compiled (by name), kernels found in the Triton cache, and the seconds inside it for both. It sees
    the main process's calls (a library's JIT kernels, inductor's kernels loaded there), not
    inductor's compile workers: what they compile is an inductor cache miss, counted apart."""

    compiled_kernels: Counter[str] = field(default_factory=Counter)
    loaded: int = 0
    seconds: float = 0.0

    @property
    def compiled(self) -> int:
        return self.compiled_kernels.total()

    def describe(self) -> str:
        return (
            f"Triton: {self.compiled} compiled{self._which()}, {self.loaded} loaded from its cache in "
            f"{self.seconds:.1f}s"
        )

    def _which(self, shown: int = 3) -> str:
        """The compiled kernels' names, the most compiled first: what a cache that should have held
        them lacks."""
        names = [
            f"{name} x{count}" if count > 1 else name for name, count in self.compiled_kernels.most_common()
        ]
        if not names:
            return ""
        more = f" and {len(names) - shown} more" if len(names) > shown else ""
        return f" ({', '.join(names[:shown])}{more})"


@contextlib.contextmanager
def counting_triton_compiles() -> Iterator[TritonCompiles]:
    """Count `triton.compile` calls through Triton's compilation listener (a listener already set
    still gets every call)."""
    from triton import knobs

    counts = TritonCompiles()
    previous = knobs.compilation.listener

    def listener(*, src, metadata, metadata_group, times, cache_hit) -> None:
        if cache_hit:
            counts.loaded += 1
        else:
            counts.compiled_kernels[metadata.get("name") or getattr(src, "name", "?")] += 1
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
    """Entries of one process's Triton cache written since it was created (after warm-up): new ones
    and baked ones written again."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self.directory = directory
        self.baseline = triton_cache_entries(directory)

    def new(self) -> int:
        now = triton_cache_entries(self.directory)
        return sum(1 for name, mtime in now.items() if self.baseline.get(name) != mtime)
