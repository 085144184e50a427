"""Where the key packages import from, and whether a copy outside the venv shadows the locked one.

A copy of torch (or transformers, or a dist-info of safetensors) in a directory on PYTHONPATH comes
before the venv's site-packages on sys.path: it is what imports, whatever the venv holds, and
`./uvw sync` does not touch it. So the fingerprint records each key package's import path and
PYTHONPATH, and the fix for a shadowing copy names that copy (or PYTHONPATH), never the venv's.
"""

from __future__ import annotations

import importlib.util
import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

KEY_MODULES = ("torch", "transformers", "triton", "fla", "safetensors", "tokenizers")
"""Import names of the packages that decide kernels and model code (fla: flash-linear-attention)."""


def import_origins() -> dict[str, Any]:
    """The fingerprint's `imports` section: PYTHONPATH, the venv's site-packages, each key module's
    import path (None: not installed) and the modules that import from outside site-packages."""
    site = site_packages()
    origins = {module: _origin(module) for module in KEY_MODULES}
    shadowed = [module for module, path in origins.items() if path is not None and not in_site(path, site)]
    return {
        "pythonpath": os.environ.get("PYTHONPATH") or None,
        "site_packages": site,
        "origins": origins,
        "shadowed": shadowed,
    }


def site_packages() -> list[str]:
    """The running interpreter's own site-packages directories (the venv's, or the image's)."""
    paths = sysconfig.get_paths()
    return sorted({str(Path(paths[key]).resolve()) for key in ("purelib", "platlib")})


def in_site(location: str, site: Sequence[str]) -> bool:
    resolved = Path(location).resolve()
    return any(resolved == Path(root) or resolved.is_relative_to(root) for root in site)


def removal_fix(what: str, locations: Sequence[str], pythonpath: str | None) -> str:
    """The fix for `what` (copies at `locations`, outside the venv): remove it, or unset PYTHONPATH
    where PYTHONPATH is what puts it there."""
    entries = [Path(entry).resolve() for entry in (pythonpath or "").split(os.pathsep) if entry]
    on_pythonpath = any(
        Path(location).resolve().is_relative_to(entry) for location in locations for entry in entries
    )
    return (
        f"remove {what}, or unset PYTHONPATH (it comes before the venv on sys.path)"
        if on_pythonpath
        else f"remove {what}"
    )


def _origin(module: str) -> str | None:
    """The package directory (or module file) `import module` loads, found without importing it
    (an already imported module answers with the copy that did import)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return str(Path(next(iter(spec.submodule_search_locations))).resolve())
    return str(Path(spec.origin).resolve()) if spec.origin else None
