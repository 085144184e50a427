"""What is wrong with one environment on its own, before any comparison with a recorded run.

A **problem** means this is not the locked training stack (exit 1 from `dflash doctor`; `dflash train`
refuses to start); a **warning** is a risk to a run's speed or its caches; **info** is worth knowing
(no GPU, absent optional kernels). Every problem and warning says the command that fixes it.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any, Literal

from app.env.compiler_flags import degrading_flags
from app.env.fingerprint import FAST_KERNELS
from app.env.origins import in_site, removal_fix
from app.env.packages import is_core_stack
from app.env.project import LOCK_FILE

Level = Literal["problem", "warning", "info"]
SYNC = "./uvw sync (in the image: rebuild it from uv.lock)"
"""The fix for a venv that is not uv.lock: uv sync installs exactly the lock and removes the rest."""
REINSTALL = (
    "./uvw cache clean {name}, then ./uvw sync --reinstall-package {name} (uv hardlinks its cache into "
    "the venv, so the edit is in the cache too and a reinstall alone brings it back)"
)
"""The fix for an edited installed file (`./uvw sync --locked` sees the version installed and does nothing)."""
EDITED_FILES_SHOWN = 5
KERNEL_GROUPS = {"fla": "gpu", "causal_conv1d": "gpu --group causal-conv1d"}
"""The uv groups that install each fast kernel (causal-conv1d is its own, optional group: it compiles)."""


@dataclass(frozen=True)
class Finding:
    level: Level
    message: str
    fix: str | None = None
    """The command or change that removes the finding."""

    def line(self) -> str:
        return f"{self.message}; fix: {self.fix}" if self.fix else self.message


def assess(fingerprint: dict[str, Any]) -> list[Finding]:
    """Findings for one fingerprint, problems first."""
    found = [
        *_torch_findings(fingerprint),
        *lock_edit_findings(fingerprint),
        *package_findings(fingerprint),
        *shadow_findings(fingerprint),
        *edited_file_findings(fingerprint),
        *startup_file_findings(fingerprint),
        *compiler_findings(fingerprint),
        *_cache_findings(fingerprint),
        *_bytecode_findings(fingerprint),
        *_gpu_findings(fingerprint),
        *_kernel_findings(fingerprint),
    ]
    order = {"problem": 0, "warning": 1, "info": 2}
    return sorted(found, key=lambda finding: order[finding.level])


def has_problems(fingerprint: dict[str, Any]) -> bool:
    return any(finding.level == "problem" for finding in assess(fingerprint))


def _torch_findings(fingerprint: dict[str, Any]) -> list[Finding]:
    error = fingerprint["torch"].get("import_error")
    fix = "./uvw sync --reinstall-package torch (in the image: rebuild it)"
    return [Finding("problem", f"torch does not import: {error}", fix)] if error else []


def lock_edit_findings(fingerprint: dict[str, Any]) -> list[Finding]:
    """uv.lock edited against the checkout's commit: `./uvw sync --locked` would install the edit (a
    broken one does not even parse), so the fix is to restore the file first."""
    project = fingerprint.get("project") or {}
    if LOCK_FILE not in (project.get("changed") or []):
        return []
    commit = (project.get("revision") or "?")[:12]
    return [
        Finding(
            "problem",
            f"{LOCK_FILE} differs from commit {commit} (edited): the lock no longer pins what the commit pins",
            f"git checkout {LOCK_FILE}, then ./uvw sync --locked (or commit the edit, if it is meant)",
        )
    ]


def package_findings(fingerprint: dict[str, Any]) -> list[Finding]:
    packages = fingerprint["packages"]
    if not packages.get("checked"):
        return [
            Finding(
                "problem",
                packages.get("error") or "installed packages were not checked against uv.lock",
                "run from the project checkout (pyproject.toml and uv.lock) or the image",
            )
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
                SYNC,
            )
        )
    if other:
        found.append(
            Finding("problem", f"{len(other)} packages not in uv.lock: {_listed(other, 'version')}", SYNC)
        )
    missing = packages.get("missing") or []
    if missing:
        found.append(
            Finding(
                "problem",
                f"uv.lock differs from what is installed: {len(missing)} packages it installs here are absent: "
                + _listed([{**entry, "locked": " or ".join(entry["locked"])} for entry in missing], "locked"),
                SYNC,
            )
        )
    # The packages that decide kernels get a line each; a long tail of off-lock utilities gets one line.
    core = [entry for entry in packages["mismatched"] if is_core_stack(entry["name"])]
    rest = [entry for entry in packages["mismatched"] if not is_core_stack(entry["name"])]
    imports = fingerprint.get("imports") or {}
    for entry in core:
        locked = " or ".join(entry["locked"])
        message = f"{entry['name']} {entry['installed']} installed, uv.lock pins {locked}"
        found.append(Finding("problem", message, _version_fix([entry], imports)))
    if rest:
        found.append(
            Finding(
                "problem",
                f"{len(rest)} more packages at other versions than uv.lock: {_listed(rest, 'installed')}",
                _version_fix(rest, imports),
            )
        )
    found += [_duplicate_finding(entry, imports) for entry in packages["duplicates"]]
    return found


def _version_fix(entries: list[dict[str, Any]], imports: dict[str, Any]) -> str:
    """./uvw sync for the venv's own copies; a copy outside the venv (PYTHONPATH) no sync touches."""
    site = imports.get("site_packages") or []
    outside = sorted(
        {e["location"] for e in entries if site and e.get("location") and not in_site(e["location"], site)}
    )
    if not outside:
        return SYNC
    names = ", ".join(sorted({e["name"] for e in entries if e.get("location") in outside}))
    return removal_fix(f"the copies of {names} in {', '.join(outside)}", outside, imports.get("pythonpath"))


def _duplicate_finding(entry: dict[str, Any], imports: dict[str, Any]) -> Finding:
    """Two copies of one package: the fix names those outside the venv's site-packages (a PYTHONPATH
    copy comes first on sys.path, so the venv's is not the one to remove)."""
    site = imports.get("site_packages") or []
    outside = [location for location in entry["locations"] if site and not in_site(location, site)]
    copies = f"{entry['name']} installed {len(entry['versions'])} times: {', '.join(entry['versions'])}"
    if outside:
        message = f"{copies} (in {', '.join(entry['locations'])})"
        what = f"the {entry['name']} copies in {', '.join(outside)}"
        return Finding("problem", message, removal_fix(what, outside, imports.get("pythonpath")))
    return Finding("problem", copies, f"./uvw sync --reinstall-package {entry['name']}")


def shadow_findings(fingerprint: dict[str, Any]) -> list[Finding]:
    """A key package that imports from outside the venv: what runs is not what uv.lock installed."""
    imports = fingerprint.get("imports") or {}
    site = ", ".join(imports.get("site_packages") or [])
    return [
        Finding(
            "problem",
            f"{module} imports from {imports['origins'][module]}, not the venv's site-packages ({site}): "
            "that copy shadows the locked one",
            removal_fix(imports["origins"][module], [imports["origins"][module]], imports.get("pythonpath")),
        )
        for module in imports.get("shadowed") or []
    ]


def edited_file_findings(fingerprint: dict[str, Any]) -> list[Finding]:
    """A package copy whose files differ from its wheel's RECORD: edited after install."""
    imports = fingerprint.get("imports") or {}
    copies: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for entry in (fingerprint.get("installed_files") or {}).get("edited") or []:
        copies.setdefault((entry["package"], entry["location"]), []).append(entry)
    found = []
    for (name, location), entries in copies.items():
        files = ", ".join(f"{e['file']} ({e['why']})" for e in entries[:EDITED_FILES_SHOWN])
        more = f" and {len(entries) - EDITED_FILES_SHOWN} more" if len(entries) > EDITED_FILES_SHOWN else ""
        message = (
            f"{name} {entries[0]['version']} in {location}: {_files(len(entries))} from its wheel's RECORD "
            f"(edited after install): {files}{more}"
        )
        site = imports.get("site_packages") or []
        if site and not in_site(location, site):
            fix = removal_fix(f"that {name} copy", [location], imports.get("pythonpath"))
        else:
            fix = REINSTALL.format(name=name)
        found.append(Finding("problem", message, fix))
    return found


def startup_file_findings(fingerprint: dict[str, Any]) -> list[Finding]:
    """A `.pth` or `sitecustomize.py` in site-packages that no package installed, or edited since: code
    that runs at every interpreter start, before any check."""
    found = []
    for entry in (fingerprint.get("installed_files") or {}).get("startup") or []:
        if entry["package"] is None:
            message = f"{entry['file']}: a startup file no installed package put there runs code at every interpreter start"
            fix = f"remove it (rm {shlex.quote(entry['file'])})"
        else:
            message = f"{entry['file']}: a startup file of {entry['package']} differs from its wheel's RECORD ({entry['why']})"
            fix = REINSTALL.format(name=entry["package"])
        found.append(Finding("problem", message, fix))
    return found


def _files(count: int) -> str:
    return "1 file differs" if count == 1 else f"{count} files differ"


def compiler_findings(fingerprint: dict[str, Any]) -> list[Finding]:
    return [
        Finding("problem", f"{flag.name}={value}: {flag.why}", f"unset {flag.name}")
        for flag, value in degrading_flags(fingerprint.get("compiler_env") or {})
    ]


def _cache_findings(fingerprint: dict[str, Any]) -> list[Finding]:
    """A cache dir under /tmp that a variable sets. Torch's and Triton's own defaults are no finding:
    training and build-cache never use them (they pick a per-key dir under the dflash cache root,
    app.compile.environment), so on a clean machine the warning was about nothing that runs."""
    cache = fingerprint.get("compile_cache") or {}
    found = []
    for kind, variable, effect in (
        ("inductor", "TORCHINDUCTOR_CACHE_DIR", "training refuses it unless compile.inductor_dir is set"),
        ("triton", "TRITON_CACHE_DIR", "cleanups delete compiled kernels"),
    ):
        if cache.get(f"{kind}_under_tmp") and cache.get(f"{kind}_dir_from") == variable:
            found.append(
                Finding(
                    "warning",
                    f"{variable}={cache[f'{kind}_dir']} is under /tmp: {effect}",
                    f"export {variable}=~/.cache/dflash/{kind} (or another persistent directory), or unset it",
                )
            )
    return found


def _bytecode_findings(fingerprint: dict[str, Any]) -> list[Finding]:
    bytecode = fingerprint["python"].get("torch_bytecode") or {}
    if bytecode.get("cached", True) or bytecode.get("writes", True):
        return []
    message = (
        "torch has no Python bytecode for this interpreter and none is written (PYTHONDONTWRITEBYTECODE, "
        "or a read-only site-packages): every process compiles its source again at import, seconds of each start"
    )
    fix = (
        "./uvw sync --compile-bytecode (once; the image build does it), or unset PYTHONDONTWRITEBYTECODE "
        "(for a read-only venv also export PYTHONPYCACHEPREFIX=~/.cache/dflash/pycache)"
    )
    return [Finding("warning", message, fix)]


def _gpu_findings(fingerprint: dict[str, Any]) -> list[Finding]:
    gpus = fingerprint["gpus"]
    if gpus.get("count"):
        return []
    checked = "; ".join(gpus.get("notes") or []) or "nothing probed"
    fix = "on a GPU machine: check `nvidia-smi`, and give the container its GPUs (`--gpus all`)"
    return [Finding("info", f"no GPU visible, CPU only ({checked})", fix)]


CONV_KERNELS = {"causal_conv1d": "causal-conv1d (CUDA)", "fla": "flash-linear-attention (Triton)"}
"""What a hybrid target's causal conv runs on when each kernel imports, preferred first: the choice of
app.model.causal_conv.fast_causal_conv on CUDA, restated here because importing app.model brings in
transformers, and the doctor must report a stack too broken to import it (tests keep the two in step)."""


def _kernel_findings(fingerprint: dict[str, Any]) -> list[Finding]:
    kernels = fingerprint.get("fast_kernels") or {}
    present = {module for module, status in kernels.items() if status.get("present")}
    # Asked of a run on CUDA: the image is checked on machines without a GPU, and the answer is what
    # its hybrid targets will run on the GPU host (causal-conv1d is optional where fla stands in).
    conv = next((name for module, name in CONV_KERNELS.items() if module in present), None)
    found = []
    for module, status in kernels.items():
        if status.get("error"):
            found.append(
                Finding(
                    "warning",
                    f"{module} is installed but does not import: {status['error']}",
                    f"./uvw sync --group {KERNEL_GROUPS.get(module, 'gpu')} "
                    f"--reinstall-package {FAST_KERNELS.get(module, module)}",
                )
            )
        elif not status.get("present") and not (module == "causal_conv1d" and conv is not None):
            found.append(
                Finding(
                    "info",
                    f"{module} absent: Qwen3.5/3.6 hybrid targets would run the slow reference path",
                    "./uvw sync --group gpu (on a CUDA machine; the GPU image has them)",
                )
            )
    if conv is not None:
        found.append(Finding("info", f"hybrid targets' causal conv on CUDA: {conv}"))
    return found


def _listed(entries: list[dict[str, Any]], version_key: str, limit: int = 12) -> str:
    shown = ", ".join(f"{entry['name']} {entry[version_key]}" for entry in entries[:limit])
    return shown if len(entries) <= limit else f"{shown}, ... and {len(entries) - limit} more (see --json)"
