"""Triton's on-disk cache as the compile cache carries it: the kernels a library JIT-compiles, baked
with an entry and found again in a fresh process's dir, and the library-JIT watch that counts what
Triton writes there after warm-up. Real Triton compiles, for an sm90 target (no GPU needed).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
from pathlib import Path

import pytest

from app.compile.artifacts import (
    CacheEntryError,
    copy_triton_files,
    copy_triton_host_modules,
    read_entry,
    write_entry,
)
from app.compile.library_jit import LibraryJitCounter, counting_triton_compiles
from app.telemetry.compile_watches import LibraryJitAbort, LibraryJitWatch
from app.telemetry.guard import GuardedWatch


def compile_for_sm90() -> None:
    """`triton.compile` of one small kernel for an H100/H200 (sm90) into this process's Triton dir."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def scale(x, out, n, BLOCK: tl.constexpr):
        index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out + index, 2 * tl.load(x + index, mask=index < n), mask=index < n)

    signature = {"x": "*fp32", "out": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    triton.compile(
        ASTSource(scale, signature=signature, constexprs={"BLOCK": 64}), target=GPUTarget("cuda", 90, 32)
    )


def test_a_baked_kernel_is_found_in_a_fresh_process_s_triton_dir(monkeypatch, tmp_path: Path) -> None:
    """build-cache bakes the kernels from its own Triton dir, which is gone afterwards; a start copies
    them into its own. Triton finds a kernel through a group file that names its files by path, so
    the copy must point there: otherwise every baked kernel compiles again at the first forward."""
    build_dir, start_dir = tmp_path / "build" / "triton", tmp_path / "start" / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(build_dir))
    compile_for_sm90()
    entry = write_entry(tmp_path / "compile_cache", "key", {}, b"x", {}, build_dir, {}, {})
    shutil.rmtree(tmp_path / "build")
    (group,) = entry.triton_path.glob("*/__grp__*.json")
    stale = start_dir / group.parent.name / group.name  # a copy an earlier start left as it was baked
    stale.parent.mkdir(parents=True)
    shutil.copy2(group, stale)

    copy_triton_files(entry, start_dir)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(start_dir))
    with counting_triton_compiles() as counts:
        compile_for_sm90()
    assert (counts.compiled, counts.loaded) == (0, 1)
    paths = list(json.loads(stale.read_text())["child_paths"].values())
    assert paths and all(Path(path).parent == stale.parent and Path(path).is_file() for path in paths)
    assert not [file for file in start_dir.rglob("*.tmp")]
    written = stale.stat().st_mtime_ns
    copy_triton_files(read_entry(entry.path), start_dir)  # again, into the same dir: nothing to write
    assert stale.stat().st_mtime_ns == written


def test_a_rank_loading_the_entry_never_sees_a_kernel_file_half_written(tmp_path: Path) -> None:
    """The ranks of a node copy the entry into one Triton dir at once: a rank past its own copy may
    read a file another is still writing. Each lands by a rename, so a reader sees it whole or not
    at all (a reader here watches the size of a 32 MiB file while it is copied)."""
    baked = tmp_path / "baked" / "KERNELHASH"
    baked.mkdir(parents=True)
    size = 32 << 20
    (baked / "k.cubin").write_bytes(os.urandom(1 << 20) * 32)
    entry = write_entry(tmp_path / "compile_cache", "key", {}, b"x", {}, baked.parent, {}, {})
    copied = tmp_path / "start" / "KERNELHASH" / "k.cubin"
    sizes_seen: set[int] = set()
    copying = threading.Event()
    copying.set()

    def watch() -> None:
        while copying.is_set():
            with contextlib.suppress(FileNotFoundError):
                sizes_seen.add(copied.stat().st_size)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        copy_triton_files(entry, tmp_path / "start")
    finally:
        copying.clear()
        watcher.join()
    assert copied.stat().st_size == size and sizes_seen <= {size}
    assert [path.name for path in copied.parent.iterdir()] == ["k.cubin"]


def test_a_damaged_group_file_is_a_damaged_entry(tmp_path: Path) -> None:
    baked = tmp_path / "baked" / "KERNELHASH"
    baked.mkdir(parents=True)
    (baked / "__grp__k.json").write_text('{"child_paths": ["k.cubin"]}')
    entry = write_entry(tmp_path / "compile_cache", "key", {}, b"x", {}, baked.parent, {}, {})
    with pytest.raises(CacheEntryError, match=r"__grp__k\.json: not a Triton group file"):
        copy_triton_files(entry, tmp_path / "start")


def test_the_build_bakes_tritons_host_module_not_its_kernels(tmp_path):
    triton = tmp_path / "triton"
    for directory, name in (
        ("HOSTHASH", "cuda_utils.cpython-312-x86_64-linux-gnu.so"),
        ("KERNELHASH", "k.cubin"),
    ):
        (triton / directory).mkdir(parents=True)
        (triton / directory / name).write_bytes(b"built")
    (triton / "KERNELHASH" / "k.json").write_text("{}")
    baked = tmp_path / "baked"
    copy_triton_host_modules(triton, baked)
    assert sorted(str(file.relative_to(baked)) for file in baked.rglob("*") if file.is_file()) == [
        "HOSTHASH/cuda_utils.cpython-312-x86_64-linux-gnu.so"
    ]
    copy_triton_host_modules(triton, baked)  # into files already there (a hybrid target's snapshot)


def test_the_library_jit_watch_counts_new_triton_cache_entries_after_warm_up(tmp_path: Path) -> None:
    """Each kernel Triton compiles (or autotuning result it keeps) is a directory of its cache: what
    appears after warm-up, here or on a target rank, is library JIT; with abort it ends the run."""
    triton = tmp_path / "triton"
    (triton / "baked-kernel").mkdir(parents=True)
    (triton / "not-an-entry.tmp").write_text("")
    watch = LibraryJitWatch(LibraryJitCounter(triton).new, abort=False, source="nvidia-h200-sm90-abc")
    assert watch.check({"step": 5}) == [] and watch.active is None
    (triton / "compiled-after-warm-up").mkdir()
    (event,) = watch.check({"step": 10, "target_library_jit": [0, 2]})
    assert event.startswith(
        "library JIT: 3 Triton kernel compiles or autotunings after warm-up (3 new in this window)"
    )
    assert "nvidia-h200-sm90-abc was loaded" in event
    assert watch.check({"step": 15, "target_library_jit": [0, 2]}) == []  # nothing new, no second event
    assert watch.check({"step": 20, "target_library_jit": [1, 2]})[0].startswith("library JIT: 4 ")

    aborting = GuardedWatch(LibraryJitWatch(LibraryJitCounter(triton).new, abort=True, source="x"))
    (triton / "another").mkdir()
    with pytest.raises(LibraryJitAbort, match=r"compile\.on_cache_miss = abort"):
        aborting.check({"step": 25})


def test_a_kernel_compiled_again_into_a_baked_entry_is_library_jit(monkeypatch, tmp_path: Path) -> None:
    """A baked entry Triton cannot use (its group file names files that are gone) is compiled again
    into its own directory: no new entry, but a write after warm-up all the same."""
    triton = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(triton))
    compile_for_sm90()
    (group,) = triton.glob("*/__grp__*.json")
    group.write_text(json.dumps({"child_paths": {"scale.json": str(tmp_path / "gone" / "scale.json")}}))
    os.utime(group.parent, ns=(0, 0))  # baked long before this start
    counter = LibraryJitCounter()
    compile_for_sm90()
    assert [path.name for path in triton.iterdir()] == [group.parent.name]
    assert counter.new() == 1


def test_triton_compiles_are_counted_apart_from_cache_loads(monkeypatch, tmp_path: Path) -> None:
    """Through Triton's compilation listener, with a real compile (Triton builds for an sm90 target
    without a GPU): the first call compiles, the same kernel twice more loads from the cache; a listener
    set before still hears both, and is back in place afterwards."""
    from triton import knobs

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    heard = []
    earlier = lambda **event: heard.append(event["cache_hit"])  # noqa: E731
    monkeypatch.setattr(knobs.compilation, "listener", earlier)
    with counting_triton_compiles() as counts:
        for _ in range(3):
            compile_for_sm90()
    assert (counts.compiled, counts.loaded) == (1, 2) and counts.seconds > 0
    assert counts.describe().startswith("Triton: 1 compiled (scale), 2 loaded from its cache in ")
    assert heard == [False, True, True] and knobs.compilation.listener is earlier
