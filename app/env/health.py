"""What is wrong with one environment on its own, before any comparison with a recorded run.

A **problem** means this is not the locked training stack (exit 1 from `dflash doctor`); a **warning**
is a risk to a run's speed or its caches; **info** is worth knowing (no GPU, absent optional kernels).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from app.env.packages import is_core_stack

Level = Literal["problem", "warning", "info"]


@dataclass(frozen=True)
class Finding:
    level: Level
    message: str


def assess(fingerprint: dict[str, Any]) -> list[Finding]:
    """Findings for one fingerprint, problems first."""
    found = [
        *_torch_findings(fingerprint),
        *_package_findings(fingerprint),
        *_cache_findings(fingerprint),
        *_gpu_findings(fingerprint),
        *_kernel_findings(fingerprint),
    ]
    order = {"problem": 0, "warning": 1, "info": 2}
    return sorted(found, key=lambda finding: order[finding.level])


def has_problems(fingerprint: dict[str, Any]) -> bool:
    return any(finding.level == "problem" for finding in assess(fingerprint))


def _torch_findings(fingerprint: dict[str, Any]) -> list[Finding]:
    error = fingerprint["torch"].get("import_error")
    return [Finding("problem", f"torch does not import: {error}")] if error else []


def _package_findings(fingerprint: dict[str, Any]) -> list[Finding]:
    packages = fingerprint["packages"]
    if not packages.get("checked"):
        return [
            Finding("problem", packages.get("error") or "installed packages were not checked against uv.lock")
        ]
    found = []
    inference = [entry for entry in packages["stray"] if entry["inference_stack"]]
    other = [entry for entry in packages["stray"] if not entry["inference_stack"]]
    if inference:
        found.append(
            Finding(
                "problem",
                f"inference-stack packages in the training environment: {_listed(inference, 'version', len(inference))}"
                " (they bring their own torch/CUDA builds; run them in the datagen container)",
            )
        )
    if other:
        found.append(Finding("problem", f"{len(other)} packages not in uv.lock: {_listed(other, 'version')}"))
    # The packages that decide kernels get a line each; a long tail of off-lock utilities gets one line.
    core = [entry for entry in packages["mismatched"] if is_core_stack(entry["name"])]
    rest = [entry for entry in packages["mismatched"] if not is_core_stack(entry["name"])]
    for entry in core:
        locked = " or ".join(entry["locked"])
        found.append(
            Finding("problem", f"{entry['name']} {entry['installed']} installed, uv.lock pins {locked}")
        )
    if rest:
        found.append(
            Finding(
                "problem",
                f"{len(rest)} more packages at other versions than uv.lock: {_listed(rest, 'installed')}",
            )
        )
    for entry in packages["duplicates"]:
        versions = ", ".join(entry["versions"])
        found.append(
            Finding("problem", f"{entry['name']} installed {len(entry['versions'])} times: {versions}")
        )
    return found


def _cache_findings(fingerprint: dict[str, Any]) -> list[Finding]:
    cache = fingerprint.get("compile_cache") or {}
    found = []
    for kind, variable in (("inductor", "TORCHINDUCTOR_CACHE_DIR"), ("triton", "TRITON_CACHE_DIR")):
        if cache.get(f"{kind}_under_tmp"):
            found.append(
                Finding(
                    "warning",
                    f"{kind} cache {cache[f'{kind}_dir']} is under /tmp, where cleanups delete compiled kernels; "
                    f"set {variable} to a persistent directory",
                )
            )
    return found


def _gpu_findings(fingerprint: dict[str, Any]) -> list[Finding]:
    gpus = fingerprint["gpus"]
    if gpus.get("count"):
        return []
    checked = "; ".join(gpus.get("notes") or []) or "nothing probed"
    return [Finding("info", f"no GPU visible, CPU only ({checked})")]


def _kernel_findings(fingerprint: dict[str, Any]) -> list[Finding]:
    kernels = fingerprint.get("fast_kernels") or {}
    found = []
    for module, status in kernels.items():
        if status.get("error"):
            found.append(Finding("warning", f"{module} is installed but does not import: {status['error']}"))
        elif not status.get("present"):
            found.append(
                Finding(
                    "info", f"{module} absent: Qwen3.5/3.6 hybrid targets would run the slow reference path"
                )
            )
    return found


def _listed(entries: list[dict[str, Any]], version_key: str, limit: int = 12) -> str:
    shown = ", ".join(f"{entry['name']} {entry[version_key]}" for entry in entries[:limit])
    return shown if len(entries) <= limit else f"{shown}, ... and {len(entries) - limit} more (see --json)"
