"""The compile cache as a build artifact: key, entries, fresh-process hits, recompile and flex guards.

Compiles one tiny function on CPU (a matmul: inductor emits an extern call, no C++ build), once per
module, and hot-loads its artifacts in one fresh process; everything else reuses that compile.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console

from app.compile.apply import reset_compiled_state
from app.compile.artifacts import (
    ARTIFACTS,
    CacheEntryError,
    find_entry,
    list_entries,
    read_entry,
    write_entry,
)
from app.compile.build import _emptied
from app.compile.catalog import nearest_mismatch, survey_caches
from app.compile.environment import (
    ensure_user_and_home,
    key_inductor_dir,
    resolve_inductor_dir,
    use_compile_dirs,
)
from app.compile.guard import (
    FX_TRACE_FLAGS,
    CompileCounters,
    RecompileError,
    baseline_step_time,
    cache_use_problems,
    compiles_on,
    enter_steady_state,
    read_counters,
    recompile_errors,
    verify_fx_trace_flags,
)
from app.compile.key import COMPILED_SOURCES, MACHINE_GROUPS, cache_key, diff_fields, key_fields
from app.compile.prepare import (
    CompileReport,
    _warn_if_built_elsewhere,
    no_cache_message,
    prepare_compiled_training,
    prepare_target_rank,
)
from app.config import load_config, validate_config
from app.config.builtins import BUILTIN_TARGETS
from app.config.schema import CompileConfig
from app.errors import UserError
from app.model.ce_kernel import _weighted_ce_rows
from app.model.drafter import DFlashDrafter, DrafterArch
from app.model.target import load_target
from app.telemetry.compile_watches import compile_watches, throughput_watch
from app.train.step import DrafterStep

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"
H200 = {"machine.gpu": "NVIDIA H200", "machine.compute_capability": "9.0"}


def tiny_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w


def tiny_inputs(rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(rows, 16, generator=generator), torch.randn(16, 4, generator=generator)


def tiny_config(*overrides: str):
    return load_config(TINY, list(overrides))


def tiny_fields(*overrides: str) -> dict:
    config = tiny_config(*overrides)
    return key_fields(config, DrafterArch.from_config(config), "cpu")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One cold compile of `tiny_matmul` into an empty inductor dir, saved as a cache entry."""
    base = tmp_path_factory.mktemp("compile-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(base / "unused"))
        patch.setenv("TRITON_CACHE_DIR", str(base / "unused"))
        use_compile_dirs(base / "inductor-build", base / "triton-build")
        before = read_counters()
        compiled = torch.compile(tiny_matmul, dynamic=False)
        compiled(*tiny_inputs())
        counters = read_counters() - before
        artifacts, info = torch.compiler.save_cache_artifacts()
    fields = tiny_fields()
    library_triton = base / "library-triton"
    (library_triton / "abc123").mkdir(parents=True)
    (library_triton / "abc123" / "kernel.cubin").write_bytes(b"cubin bytes")
    entry = write_entry(
        base / "compile_cache",
        cache_key(fields),
        fields,
        artifacts,
        {kind: len(keys) for kind, keys in info.artifacts.items()},
        library_triton,
        {"drafter_step_s": 0.2, "target_forward_s": 0.3, "step_time_s": 0.5},
        {"counters": counters.to_dict()},
    )
    # The same entry as built on another GPU: the doctor and the survey must say it differs.
    other_fields = {**fields, **H200}
    other = write_entry(base / "compile_cache", cache_key(other_fields), other_fields, b"x", {}, None, {}, {})
    return SimpleNamespace(
        base=base, compiled=compiled, counters=counters, entry=entry, fields=fields, other=other
    )


# ---- key ------------------------------------------------------------------------------------------


def test_key_covers_machine_inductor_shapes_and_code_and_is_stable():
    fields = tiny_fields()
    for name in (
        "machine.gpu",
        "machine.compute_capability",
        "machine.torch",
        "machine.cuda",
        "machine.triton",
        "inductor.max_autotune",
        "inductor.triton.cudagraphs",
        "shape.token_budget",
        "shape.anchors",
        "shape.block_size",
        "shape.hidden_size",
        "shape.num_layers",
        "shape.precision",
        "code.model_sources",
        "code.uv_lock",
    ):
        assert name in fields, name
    assert fields["shape.token_budget"] == 1024 and fields["shape.anchors"] == 64
    assert fields["code.uv_lock"] is not None  # the checkout's uv.lock is found and hashed
    assert _weighted_ce_rows.fn.__module__ in COMPILED_SOURCES  # the loss's Triton kernel, baked in the entry
    assert cache_key(tiny_fields()) == cache_key(fields)
    assert cache_key(fields).startswith("cpu-")
    assert cache_key({**fields, **H200}).startswith("nvidia-h200-sm90-")


def test_key_changes_when_any_field_changes():
    fields = tiny_fields()
    keys = {cache_key(fields)}
    for name, value in fields.items():
        changed = {**fields, name: [value, "changed"]}
        keys.add(cache_key(changed))
    assert len(keys) == len(fields) + 1
    assert cache_key(tiny_fields("train.anchors=32")) != cache_key(fields)
    assert cache_key(tiny_fields("train.precision=bf16")) != cache_key(fields)
    assert cache_key(tiny_fields("train.lr=1e-4")) == cache_key(fields)  # not a shape: same kernels
    # the target batch shapes are what the baked library kernels cover
    assert cache_key(tiny_fields("data.lengths_per_octave=4")) != cache_key(fields)
    assert cache_key(tiny_fields("data.max_batch_size=8")) != cache_key(fields)


def test_diff_names_the_fields_that_differ():
    fields = tiny_fields()
    other = {**fields, **H200, "shape.anchors": 512}
    assert diff_fields(fields, other) == [
        "machine.compute_capability: 9.0 (this run: (absent))",
        "machine.gpu: NVIDIA H200 (this run: cpu)",
        "shape.anchors: 512 (this run: 64)",
    ]
    assert diff_fields(fields, other, MACHINE_GROUPS) == diff_fields(fields, other)[:2]
    assert diff_fields(fields, dict(fields)) == []


# ---- entries on disk ------------------------------------------------------------------------------


def test_entry_round_trip_listing_and_mismatch_survey(built):
    cache_dir = built.base / "compile_cache"
    entry = find_entry(cache_dir, built.entry.key)
    assert entry is not None and entry.fields == built.fields
    assert entry.check_artifacts() == (entry.path / ARTIFACTS).read_bytes()
    assert entry.manifest["artifacts"]["entries"]["inductor"] >= 1
    assert entry.manifest["triton"] == {"dir": "triton", "files": 1, "bytes": len(b"cubin bytes")}
    assert find_entry(cache_dir, "nvidia-h200-sm90-0000") is None

    (cache_dir / "README.md").write_text("not an entry")
    (cache_dir / "half-copied").mkdir()
    try:
        entries, broken = list_entries(cache_dir)
    finally:
        (cache_dir / "half-copied").rmdir()
    assert sorted(e.key for e in entries) == sorted([built.entry.key, built.other.key])
    assert len(broken) == 1 and "half-copied/manifest.json: missing" in broken[0]

    statuses, _ = survey_caches(cache_dir, built.fields)
    assert [status.matches for status in statuses] == [True, False]
    assert statuses[1].differences == [
        "machine.compute_capability: 9.0 (this run: (absent))",
        "machine.gpu: NVIDIA H200 (this run: cpu)",
    ]
    nearest = nearest_mismatch(cache_dir, tiny_fields("train.anchors=32"))
    assert nearest is not None and nearest.differences == ["shape.anchors: 64 (this run: 32)"]
    warning = no_cache_message(cache_dir, "k32", tiny_fields("train.anchors=32"), "warn")
    assert warning.startswith("WARNING: no compile cache for key k32")
    assert "differs in shape.anchors: 64 (this run: 32)" in warning and "dflash build-cache" in warning
    # a bench's arms each compile once, on purpose: one plain line, nothing that reads as a fault
    expected = no_cache_message(cache_dir, "k32", tiny_fields("train.anchors=32"), "expected")
    assert (
        expected
        == f"compile cache: none for key k32 in {cache_dir} (a cold start, expected here): compiling now"
    )


def test_damaged_entries_are_refused(built, tmp_path):
    copy = tmp_path / built.entry.key
    copy.mkdir()
    for name in ("manifest.json", ARTIFACTS):
        (copy / name).write_bytes((built.entry.path / name).read_bytes())
    data = bytearray((copy / ARTIFACTS).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (copy / ARTIFACTS).write_bytes(bytes(data))
    with pytest.raises(CacheEntryError, match="does not match its manifest"):
        read_entry(copy).check_artifacts()
    (copy / "manifest.json").write_text("{not json")
    with pytest.raises(CacheEntryError, match="not a readable JSON manifest"):
        read_entry(copy)
    renamed = tmp_path / "another-key"
    copy.rename(renamed)
    (renamed / "manifest.json").write_bytes((built.entry.path / "manifest.json").read_bytes())
    with pytest.raises(CacheEntryError, match="lives in another-key/"):
        read_entry(renamed)


@pytest.mark.slow  # a fresh Python process importing torch and dynamo: about a minute on 2 busy cores
def test_fresh_process_with_empty_inductor_dir_hits_the_loaded_cache(built, tmp_path):
    assert built.counters.fxgraph_cache_miss >= 1  # the build itself compiled cold
    script = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[4])
from app.compile.environment import use_compile_dirs
dirs = use_compile_dirs(Path(sys.argv[1]), Path(sys.argv[2]))
from app.compile.artifacts import load_entry, read_entry
loaded = load_entry(read_entry(Path(sys.argv[3])), dirs.triton)
import torch
from app.compile.guard import read_counters
from test_compile_cache import tiny_inputs, tiny_matmul
before = read_counters()
torch.compile(tiny_matmul, dynamic=False)(*tiny_inputs())
print(json.dumps({"loaded": loaded, "counters": (read_counters() - before).to_dict()}))
"""
    inductor, triton = tmp_path / "inductor", tmp_path / "triton"
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            str(inductor),
            str(triton),
            str(built.entry.path),
            str(ROOT / "tests"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    counters = result["counters"]
    assert result["loaded"]["inductor"] >= 1
    assert counters["fxgraph_cache_hit"] >= 1 and counters["autograd_cache_hit"] >= 1
    assert counters["fxgraph_cache_miss"] == counters["fxgraph_cache_bypass"] == 0
    assert counters["autograd_cache_miss"] == counters["autograd_cache_bypass"] == 0
    assert (triton / "abc123" / "kernel.cubin").read_bytes() == b"cubin bytes"


# ---- guards -----------------------------------------------------------------------------------------


def test_recompile_in_steady_state_is_a_one_line_error_naming_the_guard(built):
    enter_steady_state()
    try:
        with recompile_errors():
            built.compiled(*tiny_inputs())  # same shapes: no recompile
        with pytest.raises(RecompileError) as raised, recompile_errors():
            built.compiled(*tiny_inputs(rows=9))
    finally:
        torch.compiler.set_stance("default")
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("recompile after warm-up in tiny_matmul (")
    assert "size mismatch at index 0. expected 8, actual 9" in message
    with recompile_errors(), pytest.raises(RuntimeError, match="unrelated"):
        raise RuntimeError("unrelated")  # other errors pass through untouched


def test_compile_mode_refuses_eager_flex_on_cuda_and_compiling_on_cpu():
    with pytest.raises(UserError, match=re.escape('compile.mode: "off" is refused on CUDA')):
        compiles_on("off", "cuda")
    with pytest.raises(UserError, match=re.escape('compile.mode: "on" needs CUDA')):
        compiles_on("on", "cpu")
    with pytest.raises(UserError, match="dense"):
        compiles_on("auto", "cuda", attention_backend="dense")
    assert compiles_on("auto", "cuda") is True
    assert compiles_on("on", "cuda:0") is True
    assert compiles_on("auto", "cpu") is False
    assert compiles_on("off", "cpu") is False


def test_fx_trace_flags_are_never_set(built):
    names = "|".join(name for name, _ in FX_TRACE_FLAGS)
    writes = re.compile(
        rf"\b({names})\b\s*=(?!=)|setattr\([^)]*({names})|patch\([^)]*({names})|[\"']({names})[\"']\s*:"
    )
    this_test = Path(__file__).resolve()
    offenders = []
    for folder in ("app", "tests", "scripts"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix not in (".py", ".sh") or path.resolve() == this_test:
                continue
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if writes.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == []
    import torch._dynamo.config as dynamo_config

    assert getattr(dynamo_config, "force_compile_during_fx_trace", False) is False
    assert dynamo_config.error_on_nested_fx_trace is True
    verify_fx_trace_flags()  # after the module's compile


def test_cache_counters_after_warm_up():
    clean = CompileCounters(fxgraph_cache_hit=10, autograd_cache_hit=6)
    assert cache_use_problems(clean, cache_loaded=True) == []
    cold = CompileCounters(fxgraph_cache_miss=10, autograd_cache_miss=6)
    assert cache_use_problems(cold, cache_loaded=False) == []  # no cache: misses are expected
    problems = cache_use_problems(
        CompileCounters(fxgraph_cache_hit=9, fxgraph_cache_miss=1, autograd_cache_bypass=2), cache_loaded=True
    )
    assert len(problems) == 2
    assert problems[0].startswith("compile cache: 1 inductor and 0 autograd cache misses")
    assert "2 autograd cache bypasses" in problems[1]
    later = CompileCounters(fxgraph_cache_hit=12, unique_graphs=3) - CompileCounters(fxgraph_cache_hit=2)
    assert later.fxgraph_cache_hit == 10 and later.unique_graphs == 3


def test_prepare_on_cpu_is_eager_and_compiles_nothing(monkeypatch):
    raw = tomllib.loads(TINY.read_text())
    raw["target"] = {"architecture": BUILTIN_TARGETS["tiny-lm"]}  # random weights: no training needed
    raw["compile"] = {"inductor_dir": "/tmp/never-used"}  # would be refused, were it looked at
    config = validate_config(raw)
    target = load_target(config, "cpu")
    drafter = DFlashDrafter(DrafterArch.from_config(config, target))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/untouched")
    before = read_counters()
    lines: list[str] = []
    report = prepare_compiled_training(config, DrafterStep(config, drafter, target, "cpu"), lines.append)
    assert report.compiled is False and report.key is None and report.library_jit is None
    assert read_counters() == before and lines == []
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/untouched"
    assert torch._dynamo.eval_frame._stance.stance == "default"
    assert prepare_target_rank(config, "cpu", lines.append) is None and lines == []


def test_inductor_dir_is_persistent_and_writable(monkeypatch, tmp_path, persistent_tmp):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("DFLASH_CACHE", raising=False)
    monkeypatch.setenv("HOME", "/home/someone")  # resolving creates nothing
    assert resolve_inductor_dir(CompileConfig()) == Path("/home/someone/.cache/dflash/inductor")
    monkeypatch.setenv("DFLASH_CACHE", "/srv/dflash")  # the image's one cache root
    assert resolve_inductor_dir(CompileConfig()) == Path("/srv/dflash/inductor")
    with pytest.raises(UserError, match=re.escape("compile.inductor_dir: /tmp/x is under /tmp")):
        resolve_inductor_dir(CompileConfig(inductor_dir="/tmp/x"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_root")
    with pytest.raises(UserError, match="TORCHINDUCTOR_CACHE_DIR: /tmp/torchinductor_root is under /tmp"):
        resolve_inductor_dir(CompileConfig())
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o500)
    if not os.access(read_only, os.W_OK):  # root writes anyway
        with pytest.raises(UserError, match="not writable"):
            use_compile_dirs(read_only / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "before"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(persistent_tmp / "triton"))
    dirs = use_compile_dirs(tmp_path / "inductor")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    assert dirs.triton == persistent_tmp / "triton"  # an explicit, persistent TRITON_CACHE_DIR is kept


def test_compile_dirs_pin_triton_to_the_ptxas_inductor_compiles_with(monkeypatch, tmp_path, persistent_tmp):
    """Triton's cache key holds the ptxas version, and inductor exports torch's ptxas only when it
    compiles a kernel itself (a warm start never does): so the compile dirs pin it for the whole
    process, or build-cache and a warm start key one kernel two ways. Here on a torch tree that
    ships a ptxas, as the CUDA wheels do."""
    from torch._inductor.runtime import compile_tasks

    fake_torch = tmp_path / "torch"
    ptxas = fake_torch / "bin" / "ptxas"
    ptxas.parent.mkdir(parents=True)
    ptxas.write_text("#!/bin/sh\n")
    ptxas.chmod(0o755)
    monkeypatch.setattr(
        compile_tasks, "__file__", str(fake_torch / "_inductor" / "runtime" / "compile_tasks.py")
    )
    monkeypatch.setenv("TRITON_PTXAS_PATH", "")  # so that the test's own setting is undone
    monkeypatch.delenv("TRITON_PTXAS_PATH")
    compile_tasks._set_triton_ptxas_path.cache_clear()
    try:
        use_compile_dirs(persistent_tmp / "inductor", persistent_tmp / "triton")
        assert os.environ["TRITON_PTXAS_PATH"] == str(ptxas)
    finally:
        compile_tasks._set_triton_ptxas_path.cache_clear()


def test_pinning_ptxas_rekeys_triton_in_a_process_that_compiled_before(monkeypatch, tmp_path, persistent_tmp):
    """Triton keys a kernel by the ptxas version, which it memoizes per process from the first ptxas
    it asked: after the pin, the key must come from the pinned ptxas, or build-cache in a process that
    compiled before bakes the loss kernel under a key a fresh start never looks up."""
    get_ptxas_version = pytest.importorskip("triton.backends.nvidia.compiler").get_ptxas_version

    def ptxas_of_release(release: str) -> str:
        path = tmp_path / f"ptxas-{release}"
        path.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.0'\n")
        path.chmod(0o755)
        return str(path)

    monkeypatch.setenv("TRITON_PTXAS_PATH", ptxas_of_release("12.8"))
    get_ptxas_version.cache_clear()
    try:
        assert "release 12.8" in get_ptxas_version(90)  # a kernel compiled before the pin
        monkeypatch.setenv("TRITON_PTXAS_PATH", ptxas_of_release("13.0"))  # the ptxas the pin names
        use_compile_dirs(persistent_tmp / "inductor", persistent_tmp / "triton")
        assert "release 13.0" in get_ptxas_version(90)
    finally:
        get_ptxas_version.cache_clear()


def test_each_key_builds_and_starts_in_its_own_inductor_dir(built, tmp_path):
    """Inductor looks for a kernel's tuned launch config beside the source path pickled at build
    time, so build and start share one path per key, and the build starts from an empty one."""
    config = CompileConfig(inductor_dir="/srv/dflash/inductor")  # resolving creates nothing
    assert key_inductor_dir(config, built.entry.key) == Path("/srv/dflash/inductor") / built.entry.key
    key_dir = tmp_path / "inductor" / built.entry.key
    (key_dir / "ab").mkdir(parents=True)
    (key_dir / "ab" / "kernel.best_config").write_text("{}")  # a previous run's: not cold
    assert _emptied(key_dir) == key_dir and not key_dir.exists()
    assert _emptied(key_dir) == key_dir  # nothing there is fine too

    entry = write_entry(
        tmp_path / "compile_cache",
        built.entry.key,
        built.fields,
        b"x",
        {},
        None,
        {},
        {"inductor_dir": str(key_dir)},
    )
    lines: list[str] = []
    _warn_if_built_elsewhere(entry, key_dir, lines.append)
    _warn_if_built_elsewhere(built.entry, key_dir, lines.append)  # built before the path was recorded
    assert lines == []
    _warn_if_built_elsewhere(entry, tmp_path / "elsewhere" / built.entry.key, lines.append)
    assert len(lines) == 1 and f"built in the inductor dir {key_dir}, this run uses" in lines[0]
    assert "Build and train with the same compile.inductor_dir" in lines[0]


def test_user_is_filled_in_when_the_container_has_none(monkeypatch):
    import getpass

    for name in ("LOGNAME", "USER", "LNAME", "USERNAME"):
        monkeypatch.delenv(name, raising=False)
    ensure_user_and_home()
    assert getpass.getuser() == os.environ["USER"]


def test_baseline_follows_the_topology_and_feeds_the_throughput_watch():
    colocated = tiny_config()
    measured = {"drafter_step_s": 0.2, "target_forward_s": 0.3}
    assert baseline_step_time(measured, colocated) == pytest.approx(0.5)

    def split(targets: int, drafters: int) -> float | None:
        topology = [f"topology.target_ranks={targets}", f"topology.drafter_ranks={drafters}"]
        return baseline_step_time(
            measured, tiny_config(*topology, f"topology.nproc_per_node={targets + drafters}")
        )

    assert split(1, 1) == pytest.approx(0.3)  # target-bound: one target forward per step
    assert split(2, 1) == pytest.approx(0.2)  # drafter-bound
    assert split(5, 3) == pytest.approx(0.2)  # 3 batches per step from 5 targets: 0.18 s < 0.2 s
    assert split(1, 2) == pytest.approx(0.6)  # two batches per step from one target
    assert baseline_step_time({}, colocated) is None

    watch = throughput_watch(0.5, "compile_cache/key", colocated)
    warmup = colocated.telemetry.warmup_steps
    on_pace = {"drafter_batches_per_s": 2.0, "tokens_per_s": 1000.0}
    slow = {"drafter_batches_per_s": 1.0, "tokens_per_s": 500.0}
    events = [watch.check({"step": warmup + step, **on_pace}) for step in range(0, 30, 10)]
    events += [watch.check({"step": warmup + step, **slow}) for step in range(30, 60, 10)]
    assert events[:3] == [[], [], []]
    assert len(events[3]) == 1 and "compile_cache/key" in events[3][0]  # the first slow window
    assert events[4:] == [[], []]  # the same slow stretch: no second event


def test_telemetry_builds_the_compile_watches_from_the_report_s_plain_data():
    """A report with a JIT count, a baseline and a start problem gives the three watches: the problem
    on the first line, the library JIT once it grows, the throughput guard on a slow window."""
    config = tiny_config()
    compiles = [0]
    report = CompileReport(
        compiled=True, device="cuda", problems=["cache miss"], library_jit=lambda: compiles[0],
        library_jit_source="entry-key", baseline_step_s=0.5, baseline_source="compile cache /c/k",
    )  # fmt: skip
    watches = compile_watches(report, config)
    step = 0  # each watch's warm-up starts at the first record it sees
    first = [
        event for watch in watches for event in watch.check({"step": step, "drafter_batches_per_s": 2.0})
    ]
    assert first == ["compile: cache miss"]
    compiles[0] = 2
    slow = [
        event
        for watch in watches
        for event in watch.check({"step": config.telemetry.warmup_steps, "drafter_batches_per_s": 1.0})
    ]
    assert [event.split(":")[0] for event in slow] == ["library JIT", "throughput"]
    assert "entry-key" in slow[0] and "compile cache /c/k" in slow[1]
    assert compile_watches(CompileReport(compiled=False, device="cpu"), config) != []  # the problems' watch


def test_doctor_lists_caches_and_why_the_others_differ(built, monkeypatch, tmp_path):
    from app.cli.doctor_cmd import _print_compile_caches

    monkeypatch.chdir(tmp_path)
    console = Console(record=True, width=200)
    _print_compile_caches(console, None)
    assert "compile caches: none in compile_cache/" in console.export_text()

    (tmp_path / "compile_cache").symlink_to(built.base / "compile_cache")
    console = Console(record=True, width=200)
    _print_compile_caches(console, tiny_config("train.anchors=32"))
    shown = console.export_text()
    assert "compared with this machine and config" in shown
    assert f"this run's key: {cache_key(tiny_fields('train.anchors=32'))}" in shown
    assert f"differs: {built.entry.key}" in shown and "shape.anchors: 64 (this run: 32)" in shown
    assert "no cache matches" in shown

    console = Console(record=True, width=200)
    _print_compile_caches(console, None)
    shown = console.export_text()
    assert f"matches: {built.entry.key}" in shown  # without a config the shapes are not compared
    assert "machine.gpu: NVIDIA H200 (this run: cpu)" in shown


def test_doctor_says_when_the_matching_cache_was_built_in_another_inductor_dir(built, tmp_path):
    from app.cli.doctor_cmd import _print_compile_caches

    key = cache_key(tiny_fields())
    cache_dir = tmp_path / "compile_cache"
    config = tiny_config(f"compile.cache_dir={cache_dir}", "compile.inductor_dir=/srv/dflash/inductor")
    shown = {}
    for built_in in ("/srv/elsewhere", "/srv/dflash/inductor"):
        build = {"inductor_dir": f"{built_in}/{key}"}
        write_entry(cache_dir, key, built.fields, b"x", {}, None, {}, build)
        console = Console(record=True, width=300)
        _print_compile_caches(console, config)
        shown[built_in] = console.export_text()
    assert f"matches: {key}" in shown["/srv/elsewhere"]
    assert (
        f"built in /srv/elsewhere/{key}, this config starts in /srv/dflash/inductor/{key}: every start "
        "re-tunes its kernels" in shown["/srv/elsewhere"]
    )
    assert (
        f"matches: {key}" in shown["/srv/dflash/inductor"] and "built in" not in shown["/srv/dflash/inductor"]
    )


def test_build_cache_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from app.compile.build import build_cache
    from app.train.step import DrafterStep

    with pytest.raises(UserError, match="build-cache: no CUDA device visible"):
        build_cache(tiny_config(), DrafterStep)


def test_resetting_the_compiled_state_forgets_the_loss_s_triton_kernel():
    """build-cache starts from `reset_compiled_state`, then runs the loss's Triton kernel into the
    build's Triton dir to bake it. A copy compiled earlier in the process (a notebook, the test suite)
    stays in Triton's memory and that call would write nothing: the entry would lack the kernel and
    every warm start compile it (the GPU tier's fresh-process test saw "Triton: 1 compiled")."""
    _weighted_ce_rows.device_caches[0] = ("the kernel, compiled before the build",)
    reset_compiled_state()
    assert not _weighted_ce_rows.device_caches


def test_the_cpu_path_imports_without_triton():
    """Triton comes with torch's Linux x86-64 wheels only: on macOS or an Arm machine, where the CPU demo
    runs, the CLI, the trainer and the compile modules import without it (the CE kernel loads on CUDA)."""
    blocked = (
        "import builtins\n"
        "real = builtins.__import__\n"
        "def without_triton(name, *args, **kwargs):\n"
        "    if name.split('.')[0] == 'triton':\n"
        "        raise ImportError('No module named triton')\n"
        "    return real(name, *args, **kwargs)\n"
        "builtins.__import__ = without_triton\n"
        "import app.cli, app.compile.build, app.compile.prepare, app.demo.run, app.train.trainer\n"
        "print('imported')\n"
    )
    done = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "imported" in done.stdout, done.stderr[-2000:]
