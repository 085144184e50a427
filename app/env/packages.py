"""Installed distributions versus uv.lock: stray packages and off-lock versions.

The incident's venv held SGLang, flashinfer, tilelang and a second torch build on top of the training
stack. Nothing imported them on purpose, yet they changed what ran. So every installed distribution
must be one the lock names, at a version the lock names.
"""

from __future__ import annotations

import re
import sys
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.version import InvalidVersion, Version

from app.errors import UserError

# Serving engines and their kernel libraries: they pull their own torch/CUDA builds and belong in the
# datagen container, never in the training environment. Matched on the normalized name's prefix.
INFERENCE_STACK_PREFIXES = (
    "sglang",
    "sgl-kernel",
    "flashinfer",
    "vllm",
    "tilelang",
    "tensorrt-llm",
    "lmdeploy",
    "xgrammar",
)

# Packages whose version decides which kernels and model code run, plus the CUDA libraries under torch.
CORE_STACK = frozenset({"torch", "triton", "transformers", "tokenizers", "safetensors", "numpy"})
CORE_STACK_PREFIXES = ("nvidia-", "cuda-")


def normalize_name(name: str) -> str:
    """PEP 503 name normalization: `Flash_Infer.Python` and `flash-infer-python` are one project."""
    return re.sub(r"[-_.]+", "-", name).lower()


def is_inference_stack(name: str) -> bool:
    return normalize_name(name).startswith(INFERENCE_STACK_PREFIXES)


def core_stack_rank(name: str) -> int:
    """0: decides kernels and model code (torch, triton, ...); 1: a CUDA library; 2: anything else."""
    normalized = normalize_name(name)
    if normalized in CORE_STACK:
        return 0
    return 1 if normalized.startswith(CORE_STACK_PREFIXES) else 2


def is_core_stack(name: str) -> bool:
    return core_stack_rank(name) < 2


@dataclass(frozen=True)
class InstalledDistribution:
    name: str
    version: str
    location: str


def read_lock(lock_path: Path) -> dict:
    """uv.lock parsed, or a one-line UserError naming the file."""
    try:
        lock = tomllib.loads(lock_path.read_text(encoding="utf-8"))
    except OSError as error:
        raise UserError(f"{lock_path}: cannot read the lock file ({error.strerror})") from error
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise UserError(f"{lock_path}: not a valid TOML lock file ({error})") from error
    packages = lock.get("package")
    if not isinstance(packages, list):
        raise UserError(f"{lock_path}: no [[package]] entries; expected a uv.lock")
    for index, package in enumerate(packages):
        if not isinstance(package, dict) or not isinstance(package.get("name"), str):
            raise UserError(f"{lock_path}: [[package]] entry {index} has no name")
    return lock


def locked_versions(lock_path: Path) -> dict[str, set[str]]:
    """Normalized package name -> every version uv.lock pins for it (one per platform/Python fork).

    An empty set means the lock names the package without a version (a virtual or path source).
    """
    return versions_in(read_lock(lock_path))


def versions_in(lock: dict) -> dict[str, set[str]]:
    versions: dict[str, set[str]] = {}
    for package in lock["package"]:
        pinned = versions.setdefault(normalize_name(package["name"]), set())
        if isinstance(package.get("version"), str):
            pinned.add(package["version"])
    return versions


def installed_distributions(search_path: Sequence[str] | None = None) -> list[InstalledDistribution]:
    """Every distribution importlib can see on `search_path` (default: sys.path), in path order."""
    found = []
    for dist in metadata.distributions(path=list(sys.path if search_path is None else search_path)):
        name = dist.metadata["Name"] if dist.metadata is not None else None
        if not name:
            continue  # a half-removed install leaves a dist-info without METADATA; nothing to compare
        location = dist.locate_file("")
        found.append(InstalledDistribution(name=name, version=dist.version, location=str(location)))
    return found


def _same_version(installed: str, locked: Iterable[str]) -> bool:
    """Exact match including the local label: `2.10.0+cu130` is not the locked `2.10.0` build."""
    for candidate in locked:
        try:
            if Version(installed) == Version(candidate):
                return True
        except InvalidVersion:
            if installed == candidate:
                return True
    return False


def package_drift(locked: dict[str, set[str]], installed: Sequence[InstalledDistribution]) -> dict:
    """Stray (not in the lock), mismatched (locked at another version) and duplicated distributions."""
    stray, mismatched, seen = [], [], {}
    for dist in installed:
        key = normalize_name(dist.name)
        seen.setdefault(key, []).append(dist)
        if key not in locked:
            stray.append(
                {
                    "name": key,
                    "version": dist.version,
                    "inference_stack": is_inference_stack(key),
                    "location": dist.location,
                }
            )
        elif locked[key] and not _same_version(dist.version, locked[key]):
            mismatched.append(
                {
                    "name": key,
                    "installed": dist.version,
                    "locked": sorted(locked[key]),
                    "location": dist.location,
                }
            )
    # Two copies of one project on the path: only the first imports, and which one wins depends on
    # path order -- the "second torch build swapped in" case.
    duplicates = [
        {"name": key, "versions": [dist.version for dist in dists], "locations": [d.location for d in dists]}
        for key, dists in seen.items()
        if len(dists) > 1
    ]
    return {
        "installed_count": len(installed),
        "stray": sorted(stray, key=lambda entry: entry["name"]),
        "mismatched": sorted(mismatched, key=lambda entry: entry["name"]),
        "duplicates": sorted(duplicates, key=lambda entry: entry["name"]),
    }
