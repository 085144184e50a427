"""Installed files against their wheel's RECORD: a file edited inside site-packages, and startup files.

The incident's "monkey-patch hacks", one level down: an edit to a file of an installed package keeps
every version number, so the lock comparison does not see it and `./uvw sync --locked` (the version
is installed: nothing to do) does not repair it. A wheel's RECORD lists each file's sha256 and size.
Hashing every file of the stack cost 8-19 s warm on the 2-core development machine (3.4 GiB, mostly
CUDA libraries), so the sources are hashed: Python, where an edit is a patch, and the C, C++ and CUDA
sources and headers that triton and inductor compile at run time (`triton/backends/nvidia/driver.c`,
torch's headers); every other file (native libraries, data) is checked by its size. What that costs
is in BENCHMARKS.md (2026-12-05, time to refusal).

A `.pth` file in site-packages (or a `sitecustomize.py`) runs code at every interpreter start, before
anything the appliance checks. The venv's own ones are known from the RECORDs of the packages that
installed them; any other, or one that differs from its RECORD, is a startup file to remove.
"""

from __future__ import annotations

import base64
import hashlib
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

CHECKED_PACKAGES = (
    "torch",
    "triton",
    "transformers",
    "tokenizers",
    "safetensors",
    "huggingface-hub",
    "flash-linear-attention",
    "fla-core",
    "causal-conv1d",
    "accelerate",
    "datasets",
    "numpy",
    "pydantic",
)
"""The packages whose code decides what a run computes: the kernels and model code, and the app's own
dependencies on the training path (tooling such as wandb or boto3 is left out to keep the start fast)."""
HASHED_SUFFIXES = (".py", ".pth", ".c", ".cc", ".cpp", ".h", ".hpp", ".cu", ".cuh", ".inc")
"""Files whose content is hashed (code, and the sources compiled at run time); the rest are compared
by size (hashing them is the 8-19 s)."""
STARTUP_MODULES = ("sitecustomize.py", "usercustomize.py")
"""Modules the interpreter imports at start from site-packages, beside the `.pth` files it runs."""


def edited_files(
    search_path: Sequence[str] | None = None, packages: Sequence[str] = CHECKED_PACKAGES
) -> list[dict[str, Any]]:
    """`{"package", "version", "location", "file", "why"}` for each file of every installed copy of
    `packages` that differs from its RECORD (`why`: "missing", "size" or "content"), in package order."""
    path = list(sys.path if search_path is None else search_path)
    found = []
    for name in packages:
        for dist in metadata.distributions(name=name, path=path):
            for file, why in _differing(dist):
                found.append(
                    {
                        "package": name,
                        "version": dist.version,
                        "location": str(dist.locate_file("")),
                        "file": file,
                        "why": why,
                    }
                )
    return found


def _differing(dist: metadata.Distribution) -> list[tuple[str, str]]:
    differing = []
    for record in dist.files or []:
        if record.hash is None or record.size is None:
            continue  # RECORD itself, and files written at install (INSTALLER, bytecode) carry no hash
        try:
            located = record.locate()
            size = located.stat().st_size
        except OSError:
            differing.append((str(record), "missing"))
            continue
        if size != record.size:
            differing.append((str(record), "size"))
        elif (
            record.name.endswith(HASHED_SUFFIXES) and _digest(located, record.hash.mode) != record.hash.value
        ):
            differing.append((str(record), "content"))
    return differing


def _digest(path: Any, mode: str) -> str:
    """RECORD's form of a digest: urlsafe base64 without padding."""
    digest = hashlib.new(mode, path.read_bytes()).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def startup_files(site: Sequence[str], search_path: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """`{"file", "package", "why"}` for each startup file in the `site` directories (`.pth`, `sitecustomize.py`,
    `usercustomize.py`) that no installed package's RECORD lists ("no package installed it"), or that
    differs from the RECORD that does ("size" or "content")."""
    found = {
        path: directory
        for directory in site
        for path in sorted(Path(directory).glob("*"))
        if path.is_file() and (path.suffix == ".pth" or path.name in STARTUP_MODULES)
    }
    if not found:
        return []
    names = {path.name for path in found}
    recorded: dict[Path, tuple[str, str, str]] = {}  # file -> (package, RECORD's hash field, size field)
    for dist in metadata.distributions(path=list(sys.path if search_path is None else search_path)):
        text = dist.read_text("RECORD") or ""
        if not any(name in text for name in names):  # a scan of the text, not a parse of every RECORD
            continue
        for line in text.splitlines():
            file, _, rest = line.partition(",")
            if Path(file).name in names:
                hash_field, _, size = rest.partition(",")
                where = Path(str(dist.locate_file(file))).resolve()
                recorded.setdefault(where, (dist.metadata["Name"] or "?", hash_field, size))
    differing = []
    for path in found:
        package, hash_field, size = recorded.get(path.resolve(), ("", "", ""))
        mode, _, value = hash_field.partition("=")
        if not value:
            differing.append({"file": str(path), "package": None, "why": "no package installed it"})
        elif str(path.stat().st_size) != size:
            differing.append({"file": str(path), "package": package, "why": "size"})
        elif _digest(path, mode) != value:
            differing.append({"file": str(path), "package": package, "why": "content"})
    return differing
