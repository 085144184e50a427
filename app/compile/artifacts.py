"""One baked compile cache on disk: `compile_cache/<key>/` with the Mega-Cache artifacts and a manifest.

    compile_cache/<key>/
        manifest.json    key, key fields, artifact checksum, build counters, measured step time
        artifacts.bin    torch.compiler.save_cache_artifacts() output (inductor, autograd, autotune)
        triton/          Triton cache files a start would otherwise rebuild: kernels that libraries
                         JIT-compile (flash-linear-attention), Triton's compiled host module

An entry is written into a hidden staging directory and renamed into place, so a reader sees a
complete entry or none; the manifest's checksum catches an entry damaged afterwards.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.atomic import fsync_tree, replace_directory, write_bytes_atomic, write_text_atomic
from app.compile.key import KeyFields
from app.errors import UserError

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
ARTIFACTS = "artifacts.bin"
TRITON_DIR = "triton"


class CacheEntryError(UserError):
    """A compile-cache entry that cannot be used: missing or corrupt manifest or artifacts."""


@dataclass(frozen=True)
class CacheEntry:
    """A complete entry under `path` (its manifest already parsed)."""

    path: Path
    manifest: dict[str, Any]

    @property
    def key(self) -> str:
        return self.manifest["key"]

    @property
    def fields(self) -> KeyFields:
        return self.manifest["fields"]

    @property
    def measured(self) -> dict[str, Any]:
        return self.manifest.get("measured") or {}

    @property
    def triton_path(self) -> Path | None:
        path = self.path / TRITON_DIR
        return path if path.is_dir() else None

    def built_elsewhere(self, inductor_dir: Path) -> Path | None:
        """The inductor dir the build compiled in, when it is not `inductor_dir` (None for entries built
        before it was recorded). Starts find the kernels' tuned launch configs only there (see
        `key_inductor_dir`): elsewhere they are re-tuned on every start."""
        recorded = (self.manifest.get("build") or {}).get("inductor_dir")
        return Path(recorded) if recorded and Path(recorded) != inductor_dir else None

    def check_artifacts(self) -> bytes:
        """The artifact bytes, after checking them against the manifest's size and checksum."""
        expected = self.manifest["artifacts"]
        file = self.path / ARTIFACTS
        try:
            data = file.read_bytes()
        except OSError as error:
            raise CacheEntryError(
                f"{file}: cannot read the compile-cache artifacts ({error.strerror})"
            ) from None
        if len(data) != expected["bytes"] or hashlib.sha256(data).hexdigest() != expected["sha256"]:
            raise CacheEntryError(
                f"{file}: does not match its manifest (size or sha256 differ): the entry is damaged; "
                "rebuild it with `dflash build-cache`"
            )
        return data

    def describe(self) -> str:
        built = self.manifest.get("created_at", "?")
        step = self.measured.get("step_time_s")
        timing = f", {step * 1e3:.0f} ms/step measured" if step else ""
        return f"{self.key} (built {built}{timing})"


def read_entry(path: Path) -> CacheEntry:
    """Parse `path/manifest.json`; a missing or malformed manifest is a CacheEntryError naming the file."""
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CacheEntryError(f"{file}: missing (not a compile-cache entry)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CacheEntryError(f"{file}: not a readable JSON manifest ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA_VERSION:
        raise CacheEntryError(f"{file}: not a compile-cache manifest of schema {SCHEMA_VERSION}")
    missing = [name for name in ("key", "fields", "artifacts") if name not in manifest]
    if missing:
        raise CacheEntryError(f"{file}: manifest lacks {', '.join(missing)}")
    if manifest["key"] != path.name:
        raise CacheEntryError(f"{file}: records key {manifest['key']} but lives in {path.name}/")
    return CacheEntry(path, manifest)


def find_entry(cache_dir: Path, key: str) -> CacheEntry | None:
    """The entry for `key`, None when there is none; a damaged one raises CacheEntryError."""
    path = cache_dir / key
    return read_entry(path) if path.is_dir() else None


def list_entries(cache_dir: Path) -> tuple[list[CacheEntry], list[str]]:
    """Every entry under `cache_dir` (by key), and one line per directory that is not a usable entry."""
    if not cache_dir.is_dir():
        return [], []
    entries, broken = [], []
    for path in sorted(cache_dir.iterdir()):
        if not path.is_dir() or path.name.startswith("."):
            continue  # README.md, staging directories of a build in progress
        try:
            entries.append(read_entry(path))
        except CacheEntryError as error:
            broken.append(str(error))
    return entries, broken


def write_entry(
    cache_dir: Path,
    key: str,
    fields: KeyFields,
    artifacts: bytes,
    artifact_counts: dict[str, int],
    triton_source: Path | None,
    measured: dict[str, Any],
    build: dict[str, Any],
) -> CacheEntry:
    """Write a complete entry for `key` (replacing an older one) and return it."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = cache_dir / f".{key}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        (staging / ARTIFACTS).write_bytes(artifacts)
        triton = None
        if triton_source is not None and any(triton_source.rglob("*")):
            shutil.copytree(triton_source, staging / TRITON_DIR)
            files = [file for file in (staging / TRITON_DIR).rglob("*") if file.is_file()]
            triton = {
                "dir": TRITON_DIR,
                "files": len(files),
                "bytes": sum(file.stat().st_size for file in files),
            }
        manifest = {
            "schema": SCHEMA_VERSION,
            "key": key,
            "created_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "fields": fields,
            "artifacts": {
                "file": ARTIFACTS,
                "bytes": len(artifacts),
                "sha256": hashlib.sha256(artifacts).hexdigest(),
                "entries": artifact_counts,
            },
            "triton": triton,
            "measured": measured,
            "build": build,
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str) + "\n")
        fsync_tree(staging)
        replace_directory(staging, cache_dir / key)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return read_entry(cache_dir / key)


def load_entry(entry: CacheEntry, triton_dir: Path) -> dict[str, int]:
    """Hot-load the entry into the current inductor cache dir and its Triton files into `triton_dir`.

    Must run before the first compiled call. Returns how many artifacts of each kind were loaded.
    """
    import torch

    data = entry.check_artifacts()
    info = torch.compiler.load_cache_artifacts(data)
    if info is None:
        raise CacheEntryError(
            f"{entry.path / ARTIFACTS}: torch could not deserialize the artifacts (built by another torch?)"
        )
    copy_triton_files(entry, triton_dir)
    return {kind: len(keys) for kind, keys in info.artifacts.items()}


def copy_triton_host_modules(triton_dir: Path, destination: Path) -> None:
    """Copy Triton's compiled host modules (`cuda_utils*.so`) from `triton_dir` to `destination`.

    Triton builds them with the system C compiler into every empty Triton cache (0.35 s of a warm start
    on an H200 host); each lives in a directory named by the hash of its source and platform, so a copy
    is found by another process on the same image and rebuilt where anything differs.
    """
    for module in triton_dir.glob("*/*.so"):
        shutil.copytree(module.parent, destination / module.parent.name, dirs_exist_ok=True)


def copy_triton_files(entry: CacheEntry, triton_dir: Path) -> None:
    """Copy the entry's Triton files into `triton_dir`, keeping files already there (Triton names
    them by content hash), and each kernel's group file pointed at the copies
    (`_write_relocated_group`). Every file lands through a rename: the ranks of a node load the
    entry into one dir at once, and one must not read a kernel another is still writing."""
    if entry.triton_path is None:
        return

    def copy(source: str, destination: str) -> None:
        if os.path.basename(source).startswith(TRITON_GROUP_PREFIX):
            _write_relocated_group(Path(source), Path(destination))
        elif not os.path.exists(destination):
            write_bytes_atomic(destination, Path(source).read_bytes(), durable=False)

    shutil.copytree(entry.triton_path, triton_dir, copy_function=copy, dirs_exist_ok=True)


TRITON_GROUP_PREFIX = "__grp__"
"""Triton's group file of a compiled kernel (`__grp__<kernel>.json`): the kernel's files by path."""


def _write_relocated_group(source: Path, destination: Path) -> None:
    """Write the group file `source` to `destination` with its paths in `destination`'s directory.

    Triton finds a compiled kernel through its group file, which names the kernel's files by absolute
    path: as baked, the build's Triton dir, gone after the build. A group whose files are missing is a
    cache miss, so a copy left as it was compiles every baked kernel again (12 kernels, 6 s of the
    16-layer hybrid target's warm-up on an H200). A stale copy already at `destination` is replaced."""
    try:
        group = json.loads(source.read_text())
        children = group["child_paths"]
        relocated = {name: str(destination.parent / Path(path).name) for name, path in children.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise CacheEntryError(
            f'{source}: not a Triton group file (expected {{"child_paths": {{...}}}})'
        ) from None
    text = json.dumps({**group, "child_paths": relocated})
    if destination.exists() and destination.read_text() == text:
        return
    write_text_atomic(destination, text, durable=False)  # a crash loses it: a cache miss, not damage
