"""Compare two fingerprints and say which differences can change what a run computes or how fast.

The rule: a difference is **breaking** when it can change the kernels, numerics or model code a run
gets, or invalidate its compile cache or throughput baseline -- the torch build (version, CUDA/HIP
build, cuDNN, NCCL), triton, transformers, the Python minor version, the CPU architecture, the GPU
model or compute capability, the lock hash, any stray / off-lock / duplicated package, and whether the
hybrid-target fast kernels are importable (and their versions).
It is **cosmetic** when it names the same stack on another box or at another time: hostname, OS
kernel, timestamps, the Python patch release, the driver version (a driver too old for the CUDA build
fails loudly at start, it does not degrade silently), how many GPUs are visible (the run config decides
how many a run uses; the compile cache is per GPU model, not per count), GPU memory (set by the model),
the git revision (the per-file code hashes say what changed), and cache paths (`dflash doctor`
warns about /tmp on its own).
Also breaking: any changed, added or removed file of the appliance's code (named), and a compiler
variable that disables or degrades compilation (`app.env.compiler_flags`); other compiler variables
are cosmetic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from app.env.compiler_flags import DEGRADING, NUMERICS, NUMERICS_WHY, DegradingFlag
from app.env.packages import core_stack_rank

Fingerprint = dict[str, Any]


@dataclass(frozen=True)
class Difference:
    field: str
    old: Any
    new: Any
    breaking: bool
    why: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class _Rule:
    field: str
    read: Callable[[Fingerprint], Any]
    breaking: bool | Callable[[Any, Any], bool]
    why: str


def _at(dotted: str) -> Callable[[Fingerprint], Any]:
    """Reader for a nested key; a section missing from an older recording reads as None."""

    def read(fingerprint: Fingerprint) -> Any:
        value: Any = fingerprint
        for key in dotted.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        return value

    return read


def _listed_at(dotted: str) -> Callable[[Fingerprint], Any]:
    """Reader for a list that recordings from before it lack: absent and empty both read as None, so
    a resume of such a run is no difference."""
    return lambda fingerprint: _at(dotted)(fingerprint) or None


def _startup_files(fingerprint: Fingerprint) -> list[str] | None:
    startup = _at("installed_files.startup")(fingerprint) or []
    return (
        sorted(f"{entry.get('file')} ({entry.get('why')})" for entry in startup if isinstance(entry, dict))
        or None
    )


def _edited_files(fingerprint: Fingerprint) -> list[str] | None:
    edited = _at("installed_files.edited")(fingerprint) or []
    return (
        sorted(f"{entry.get('package')}: {entry.get('file')}" for entry in edited if isinstance(entry, dict))
        or None
    )


def _python_minor_changed(old: Any, new: Any) -> bool:
    return str(old).split(".")[:2] != str(new).split(".")[:2]


def _gpu_models(fingerprint: Fingerprint) -> list[str]:
    devices = _at("gpus.devices")(fingerprint) or []
    return sorted({f"{device.get('name')} (sm {device.get('compute_capability')})" for device in devices})


def _gpu_values(key: str) -> Callable[[Fingerprint], list[Any]]:
    return lambda fingerprint: sorted(
        {str(device.get(key)) for device in _at("gpus.devices")(fingerprint) or []}
    )


RULES: tuple[_Rule, ...] = (
    _Rule("python.version", _at("python.version"), _python_minor_changed,
          "a Python minor version means other wheels and bytecode; a patch release does not"),
    _Rule("host.machine", _at("host.machine"), True, "another CPU architecture runs other wheels"),
    _Rule("torch.version", _at("torch.version"), True, "another torch build: other kernels, compile cache invalid"),
    _Rule("torch.cuda", _at("torch.cuda"), True, "CUDA build of torch (e.g. cu128 vs cu130)"),
    _Rule("torch.hip", _at("torch.hip"), True, "ROCm build of torch"),
    _Rule("torch.cudnn", _at("torch.cudnn"), True, "cuDNN ships with the torch build and picks kernels"),
    _Rule("torch.nccl", _at("torch.nccl"), True, "NCCL ships with the torch build and runs the collectives"),
    _Rule("torch.import_error", _at("torch.import_error"), True, "torch does not import"),
    _Rule("triton", _at("triton"), True, "triton generates the compiled kernels; compile cache invalid"),
    _Rule("transformers", _at("transformers"), True, "model code of the target (attention paths, hidden states)"),
    _Rule("gpus.models", _gpu_models, True, "compile cache and autotuning are per GPU model"),
    _Rule("lock.sha256", _at("lock.sha256"), True, "another locked package set"),
    _Rule("fast_kernels.fla.present", _at("fast_kernels.fla.present"), True,
          "hybrid targets switch between fast Triton kernels and the slow reference path"),
    _Rule("fast_kernels.fla.version", _at("fast_kernels.fla.version"), True, "other linear-attention kernels"),
    _Rule("fast_kernels.causal_conv1d.present", _at("fast_kernels.causal_conv1d.present"), True,
          "hybrid targets switch between causal-conv1d's fused conv and flash-linear-attention's Triton one"),
    _Rule("fast_kernels.causal_conv1d.version", _at("fast_kernels.causal_conv1d.version"), True,
          "another causal-conv1d build"),
    _Rule("installed_files.edited", _edited_files, True,
          "a file of an installed package differs from its wheel (edited in site-packages)"),
    _Rule("installed_files.startup", _startup_files, True,
          "a startup file in site-packages (.pth, sitecustomize) runs code at every interpreter start"),
    _Rule("imports.shadowed", _listed_at("imports.shadowed"), True,
          "a copy outside the venv (PYTHONPATH) imports instead of the locked one"),
    _Rule("imports.pythonpath", _at("imports.pythonpath"), False,
          "what it puts ahead of the venv is compared above (imports.shadowed, duplicated packages)"),
    _Rule("host.hostname", _at("host.hostname"), False, "same stack, another box"),
    _Rule("host.platform", _at("host.platform"), False, "OS kernel release"),
    _Rule("created_at", _at("created_at"), False, "when the fingerprint was taken"),
    _Rule("python.executable", _at("python.executable"), False, "where the interpreter lives"),
    _Rule("gpus.count", _at("gpus.count"), False, "the run config decides how many GPUs a run uses"),
    _Rule("gpus.driver_version", _gpu_values("driver_version"), False, "driver too old for the build fails loudly"),
    _Rule("gpus.memory_mib", _gpu_values("memory_mib"), False, "set by the GPU model (compared above)"),
    _Rule("project.revision", _at("project.revision"), False, "code version; the compile cache keys its own code hash"),
    _Rule("project.dirty", _at("project.dirty"), False, "uncommitted changes in tracked files"),
    _Rule("compile_cache.inductor_dir", _at("compile_cache.inductor_dir"), False, "where inductor caches kernels"),
    _Rule("compile_cache.triton_dir", _at("compile_cache.triton_dir"), False, "where triton caches kernels"),
)  # fmt: skip


def diff_fingerprints(old: Fingerprint, new: Fingerprint) -> list[Difference]:
    """Every difference from `old` (the recorded run) to `new` (now): rule order, then packages."""
    differences = []
    for rule in RULES:
        before, after = rule.read(old), rule.read(new)
        if before != after:
            breaking = rule.breaking(before, after) if callable(rule.breaking) else rule.breaking
            differences.append(Difference(rule.field, before, after, breaking, rule.why))
    differences += _package_differences(old, new)
    differences += _code_differences(old, new)
    differences += _compiler_env_differences(old, new)
    return differences


def _code_differences(old: Fingerprint, new: Fingerprint) -> list[Difference]:
    """Each changed, added or removed file of the running package (recordings before per-file hashes
    have no `code` section: nothing to compare)."""
    before, after = old.get("code"), new.get("code")
    if not isinstance(before, dict) or not isinstance(after, dict):
        return []
    return [
        Difference(f"code.{path}", before.get(path), after.get(path), True,
                   "the appliance's own code: model, objective or loop may compute differently")
        for path in sorted(before.keys() | after.keys())
        if before.get(path) != after.get(path)
    ]  # fmt: skip


def _compiler_env_differences(old: Fingerprint, new: Fingerprint) -> list[Difference]:
    before, after = old.get("compiler_env"), new.get("compiler_env")
    if not isinstance(before, dict) or not isinstance(after, dict):
        return []
    differences = []
    for name in sorted(before.keys() | after.keys()):
        if before.get(name) != after.get(name):
            flag = DEGRADING.get(name)
            why = flag.why if flag else "a compiler or launch setting that does not degrade compilation"
            breaking = flag is not None and _degrades(flag, before.get(name)) != _degrades(
                flag, after.get(name)
            )
            if name in NUMERICS:
                why, breaking = NUMERICS_WHY, True
            differences.append(
                Difference(f"compiler_env.{name}", before.get(name), after.get(name), breaking, why)
            )
    return differences


def _package_differences(old: Fingerprint, new: Fingerprint) -> list[Difference]:
    """Stray, off-lock and duplicated packages compared by name; any change is a change of the stack."""
    kinds = {
        "stray": ("version", "installed but not in uv.lock"),
        "mismatched": ("installed", "installed at another version than uv.lock pins"),
        "duplicates": ("versions", "installed twice; path order decides which one imports"),
    }
    differences = []
    for kind, (value_key, why) in kinds.items():
        before = _by_name(_at(f"packages.{kind}")(old), value_key)
        after = _by_name(_at(f"packages.{kind}")(new), value_key)
        # The kernel-deciding packages first: in a polluted venv, torch must not hide behind 100 utilities.
        for name in sorted(before.keys() | after.keys(), key=lambda name: (core_stack_rank(name), name)):
            if before.get(name) != after.get(name):
                differences.append(
                    Difference(f"packages.{kind}.{name}", before.get(name), after.get(name), True, why)
                )
    return differences


def _degrades(flag: DegradingFlag, value: str | None) -> bool:
    return value is not None and flag.degrades(value)


def _by_name(entries: Any, value_key: str) -> dict[str, Any]:
    return {entry["name"]: entry.get(value_key) for entry in entries or [] if isinstance(entry, dict)}
