"""The environment fingerprint: everything that decides which kernels a run gets, as one JSON dict.

Recorded at every start of a run (`app.env.record`) and compared by `dflash doctor --against`, so
"what changed since the last good run" is one command instead of hours. Cheap enough to call at
every start: no network, and every subprocess has a timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import getpass
import importlib
import importlib.util
import json
import os
import platform
import re
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

from app.atomic import file_sha256, write_json_atomic
from app.env.compiler_flags import recorded_compiler_env
from app.env.gpus import probe_gpus
from app.env.integrity import CHECKED_PACKAGES, edited_files, startup_files
from app.env.lock_closure import required_packages
from app.env.origins import import_origins, site_packages
from app.env.packages import installed_distributions, normalize_name, package_drift, read_lock, versions_in
from app.env.project import code_hashes, find_project_root, git_revision
from app.errors import UserError

SCHEMA_VERSION = 1
FINGERPRINT_FILENAME = "fingerprint.json"
REQUIRED_SECTIONS = ("python", "torch", "gpus", "lock", "packages")

# Import name -> distribution name of the kernels Qwen3.5/3.6 hybrid targets run fast with: without
# flash-linear-attention transformers falls back to slow reference PyTorch code with a single warning;
# without causal-conv1d only the conv changes, to flash-linear-attention's Triton one.
FAST_KERNELS = {"fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d"}


def collect_fingerprint(
    search_path: list[str] | None = None, project_root: Path | None = None
) -> dict[str, Any]:
    """Fingerprint this process's environment.

    `search_path` overrides sys.path for the package scan; `project_root` overrides the search for the
    directory holding pyproject.toml and uv.lock.
    """
    root = project_root if project_root is not None else find_project_root()
    lock = _lock_section(root)
    return {
        "schema": SCHEMA_VERSION,
        "created_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": {
            "hostname": socket.gethostname(),
            "platform": platform.platform(),
            "machine": platform.machine(),
        },
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable": sys.executable,
            "torch_bytecode": _guarded(_torch_bytecode),
        },
        "torch": _torch_section(),
        "triton": _distribution_version("triton") or _distribution_version("pytorch-triton"),
        "transformers": _distribution_version("transformers"),
        "gpus": probe_gpus(),
        "project": {"root": str(root) if root else None, **git_revision(root)},
        "code": code_hashes(),
        "lock": lock,
        "packages": _packages_section(lock, search_path),
        "imports": import_origins(),
        "installed_files": {
            "checked": list(CHECKED_PACKAGES),
            "edited": edited_files(search_path),
            "startup": startup_files(site_packages(), search_path),
        },
        "fast_kernels": {module: _kernel_status(module, dist) for module, dist in FAST_KERNELS.items()},
        "compile_cache": _compile_cache_section(),
        "compiler_env": recorded_compiler_env(),
    }


def load_fingerprint(path: str | Path) -> dict[str, Any]:
    """A recorded fingerprint: a JSON file, or a run directory holding `fingerprint.json`."""
    path = Path(path)
    file = path / FINGERPRINT_FILENAME if path.is_dir() else path
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        where = (
            f"run directory {path} has no {FINGERPRINT_FILENAME}"
            if path.is_dir()
            else f"{file}: no such file"
        )
        raise UserError(f"{where}; expected a fingerprint saved by `dflash doctor --save` or a run") from None
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"{file}: cannot read the fingerprint ({error})") from None
    try:
        fingerprint = json.loads(text)
    except json.JSONDecodeError as error:
        raise UserError(f"{file}: not valid JSON (line {error.lineno}: {error.msg})") from None
    return checked_fingerprint(fingerprint, str(file))


def checked_fingerprint(fingerprint: Any, where: str) -> dict[str, Any]:
    """`fingerprint` if it is a dflash environment fingerprint of this schema, else a UserError naming `where`."""
    if not isinstance(fingerprint, dict):
        raise UserError(f"{where}: expected a JSON object (an environment fingerprint)")
    missing = [section for section in REQUIRED_SECTIONS if not isinstance(fingerprint.get(section), dict)]
    if missing:
        raise UserError(f"{where}: not a dflash environment fingerprint (missing {', '.join(missing)})")
    if fingerprint.get("schema") != SCHEMA_VERSION:
        raise UserError(
            f"{where}: fingerprint schema {fingerprint.get('schema')!r}, expected {SCHEMA_VERSION}"
        )
    return fingerprint


def save_fingerprint(fingerprint: dict[str, Any], path: str | Path) -> Path:
    """Write atomically (temp file, then rename); a directory gets `fingerprint.json` inside it."""
    path = Path(path)
    file = path / FINGERPRINT_FILENAME if path.is_dir() else path
    write_json_atomic(file, fingerprint)
    return file


def _torch_section() -> dict[str, Any]:
    try:
        import torch
    except Exception as error:  # a half-swapped CUDA build fails right here; the doctor must still report
        return {"version": _distribution_version("torch"), "import_error": _one_line(error)}
    return {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "git_version": torch.version.git_version,
        "cudnn": _guarded(
            lambda: str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else None
        ),
        "nccl": _guarded(
            lambda: ".".join(map(str, torch.cuda.nccl.version())) if torch.version.cuda else None
        ),
    }


def _torch_bytecode() -> dict[str, bool] | None:
    """`bytecode_status` of torch's package (found, not imported); None without torch."""
    spec = importlib.util.find_spec("torch")
    return bytecode_status(Path(spec.origin)) if spec is not None and spec.origin else None


def bytecode_status(source: Path) -> dict[str, bool]:
    """Whether a module's source has bytecode for this interpreter (`cached`), and whether importing
    it would write some (`writes`: not with PYTHONDONTWRITEBYTECODE, nor into a read-only package
    dir without a PYTHONPYCACHEPREFIX). Without either, every process compiles it again at import:
    13 s of a profiled start on the GPU machine, whose site-packages hold no bytecode."""
    cached = Path(importlib.util.cache_from_source(str(source))).exists()
    writable = sys.pycache_prefix is not None or os.access(source.parent, os.W_OK)
    return {"cached": cached, "writes": not sys.dont_write_bytecode and writable}


def _lock_section(root: Path | None) -> dict[str, Any]:
    if root is None:
        return {
            "path": None,
            "sha256": None,
            "error": "project root (pyproject.toml of dflash-appliance) not found",
        }
    lock_path = root / "uv.lock"
    if not lock_path.is_file():
        return {"path": str(lock_path), "sha256": None, "error": "uv.lock missing next to pyproject.toml"}
    return {"path": str(lock_path), "sha256": file_sha256(lock_path), "error": None}


def _packages_section(lock: dict[str, Any], search_path: list[str] | None) -> dict[str, Any]:
    if lock["sha256"] is None:
        return {"checked": False, "error": f"cannot compare installed packages: {lock['error']}"}
    try:
        parsed = read_lock(Path(lock["path"]))
    except UserError as error:
        return {"checked": False, "error": str(error)}
    installed = installed_distributions(search_path)
    names = {normalize_name(dist.name) for dist in installed}
    missing = [
        {"name": name, "locked": sorted(versions)}
        for name, versions in sorted(required_packages(parsed, names).items())
        if name not in names
    ]
    return {
        "checked": True,
        "error": None,
        **package_drift(versions_in(parsed), installed),
        "missing": missing,
    }


def _kernel_status(module: str, distribution: str) -> dict[str, Any]:
    status = {"present": False, "version": _distribution_version(distribution), "error": None}
    if importlib.util.find_spec(module) is None:
        return status
    # Import for real: a CUDA extension built against another torch is found but fails to load.
    try:
        with environment_kept():
            importlib.import_module(module)
    except Exception as error:
        status["error"] = _one_line(error)
        return status
    status["present"] = True
    return status


@contextlib.contextmanager
def environment_kept() -> Iterator[None]:
    """Undo what the block does to os.environ. A probe import must not change the environment it is
    probing: flash-linear-attention's import asks torch for its inductor cache dir, which writes
    torch's /tmp default into TORCHINDUCTOR_CACHE_DIR, and the fingerprint (and the run) then took
    that for the user's setting."""
    before = dict(os.environ)
    try:
        yield
    finally:
        for name in set(os.environ) - set(before):
            del os.environ[name]
        for name, value in before.items():
            if os.environ.get(name) != value:
                os.environ[name] = value


def _compile_cache_section() -> dict[str, Any]:
    inductor_env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    inductor_dir = inductor_env or default_inductor_dir()
    triton_env = os.environ.get("TRITON_CACHE_DIR")
    triton_dir = triton_env or str(Path(os.environ.get("TRITON_HOME") or Path.home()) / ".triton" / "cache")
    return {
        "inductor_dir": inductor_dir,
        "inductor_dir_from": "TORCHINDUCTOR_CACHE_DIR" if inductor_env else "torch default",
        "inductor_under_tmp": is_under_tmp(inductor_dir),
        "triton_dir": triton_dir,
        "triton_dir_from": "TRITON_CACHE_DIR" if triton_env else "triton default",
        "triton_under_tmp": is_under_tmp(triton_dir),
    }


def default_inductor_dir() -> str:
    """torch's default inductor cache dir, as `cache_dir_utils.default_cache_dir()` computes it.

    Importing `torch._inductor` takes seconds, so unless the caller already did, apply torch's rule
    here (the tests check the two agree).
    """
    loaded = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    return loaded.default_cache_dir() if loaded is not None else torch_rule_inductor_dir()


def torch_rule_inductor_dir() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry in a container: torch itself fails here; set USER
        user = "unknown"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def is_under_tmp(directory: str) -> bool:
    """Temp dirs get wiped (tmp cleaners, reboots, `rm -rf /tmp/torchinductor_root`): no place for caches."""
    resolved = Path(directory).expanduser().resolve()
    temp_roots = {Path("/tmp").resolve(), Path(tempfile.gettempdir()).resolve()}
    return any(resolved == root or resolved.is_relative_to(root) for root in temp_roots)


def _distribution_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _guarded(read: Callable[[], Any]) -> Any:
    try:
        return read()
    except Exception:  # a missing cuDNN/NCCL library is "not present", not a doctor crash
        return None


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
