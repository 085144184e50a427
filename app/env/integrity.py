"""Installed files against their wheel's RECORD: a file edited inside site-packages.

The incident's "monkey-patch hacks", one level down: an edit to a file of an installed package keeps
every version number, so the lock comparison does not see it and `./uvw sync --locked` (the version
is installed: nothing to do) does not repair it. A wheel's RECORD lists each file's sha256 and size.
Hashing every file of the stack cost 8-19 s warm on the 2-core development machine (3.4 GiB, mostly
CUDA libraries), so Python sources, where an edit is a patch, are hashed, and every other file
(native libraries, data) is checked by its size: 0.2-0.4 s warm for the packages below.
"""

from __future__ import annotations

import base64
import hashlib
import sys
from collections.abc import Sequence
from importlib import metadata
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
HASHED_SUFFIXES = (".py",)
"""Files whose content is hashed; the rest are compared by size (hashing them is the 8-19 s)."""


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
