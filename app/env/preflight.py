"""The stack check every command that imports the stack runs before anything imports transformers or torch.

transformers compares the versions of its own dependencies when it is imported (safetensors,
tokenizers, huggingface-hub, ...) and raises a 50-line ImportError advising `pip install transformers
-U`: a locked package at another version crashed `dflash train` before the guard (app.env.guard),
which runs once the trainer is built, could name it. This check reads only installed metadata and
uv.lock (a fraction of a second, no package imported), so the guard's own finding comes first, for
every locked package, whatever would import it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement

from app.env.compiler_flags import recorded_compiler_env
from app.env.guard import ALLOW_SETTING
from app.env.health import (
    SYNC,
    compiler_findings,
    edited_file_findings,
    lock_edit_findings,
    package_findings,
    shadow_findings,
    startup_file_findings,
)
from app.env.integrity import edited_files, startup_files
from app.env.origins import import_origins, in_site, removal_fix, site_packages
from app.env.packages import installed_distributions, normalize_name, package_drift, read_lock, versions_in
from app.env.project import LOCK_FILE, find_project_root, git_revision
from app.errors import UserError


def require_locked_stack(
    *,
    allow_drift: bool,
    search_path: Sequence[str] | None = None,
    project_root: Path | None = None,
    site: Sequence[str] | None = None,
) -> None:
    """Refuse, in one line naming each finding and its fix, what would crash or silently change a
    command that imports the stack, before anything imports it: an edited uv.lock (alone: the rest is
    compared with it), a locked package at another version, a package the lock does not name (an
    inference stack), a compiler variable that disables or degrades compilation, a key package imported
    from a copy outside the venv, a file edited inside an installed package, and a startup file in
    site-packages that no package installed. Every command
    that imports torch or transformers calls it first.

    `allow_drift` (train.allow_environment_drift) lets a start run with all of these but an off-lock
    version that another installed package rejects: that start would only crash at import.
    `search_path` overrides sys.path; `project_root` the search for pyproject.toml and uv.lock; `site`
    the venv's site-packages (what a copy outside of is no sync's to fix).
    """
    root = project_root if project_root is not None else find_project_root()
    if root is None or not (root / LOCK_FILE).is_file():
        return  # no lock to compare with: the guard reports that, with its fix
    if not allow_drift:
        edited_lock = lock_edit_findings({"project": git_revision(root)})
        if edited_lock:  # its versions are no reference, and a broken edit does not even parse
            raise UserError(edited_lock[0].line())
    try:
        lock = read_lock(root / LOCK_FILE)
    except UserError:
        return  # an unreadable lock is the guard's finding too
    installed = installed_distributions(search_path)
    drift = package_drift(versions_in(lock), installed)
    mismatched = drift["mismatched"]
    if allow_drift:
        rejected = _rejections(mismatched, set(versions_in(lock)), search_path)
        mismatched = [
            {**entry, "rejected_by": rejected[entry["name"]]}
            for entry in mismatched
            if entry["name"] in rejected
        ]
    lines = [_described(entry, site_packages() if site is None else site) for entry in mismatched]
    if not allow_drift:  # the guard names these too, but only after torch and transformers imported
        site_dirs = site_packages() if site is None else site
        found = {
            # packages the lock does not name (an inference stack); off-lock versions are described above
            "packages": {"checked": True, "stray": drift["stray"], "mismatched": [], "duplicates": []},
            "imports": import_origins(),
            "installed_files": {
                "edited": edited_files(search_path),
                "startup": startup_files(site_dirs, search_path),
            },
            "compiler_env": recorded_compiler_env(),
        }
        checks = (
            package_findings,
            compiler_findings,
            shadow_findings,
            edited_file_findings,
            startup_file_findings,
        )
        lines += [finding.line() for check in checks for finding in check(found)]
    if lines:
        raise UserError("; ".join(lines))


def _described(entry: dict[str, Any], site: Sequence[str]) -> str:
    """`NAME VERSION installed, uv.lock pins V; fix: ...`: ./uvw sync for the venv's own copy, removal
    (or PYTHONPATH) for a copy outside it, which no sync touches."""
    outside = not in_site(entry["location"], site)
    where = f" in {entry['location']}" if outside else ""
    line = (
        f"{entry['name']} {entry['installed']} installed{where}, uv.lock pins {' or '.join(entry['locked'])}"
    )
    if "rejected_by" in entry:
        line += f" ({entry['rejected_by']}: not even {ALLOW_SETTING} can run it)"
    if outside:
        what = f"that {entry['name']} copy"
        return f"{line}; fix: {removal_fix(what, [entry['location']], os.environ.get('PYTHONPATH'))}"
    return f"{line}; fix: {SYNC}"


def _rejections(
    mismatched: list[dict[str, Any]], locked: set[str], search_path: Sequence[str] | None
) -> dict[str, str]:
    """Name -> `DIST requires REQUIREMENT` for each off-lock version a locked distribution's
    requirements exclude (the check transformers makes at import). Only the locked stack decides: it is
    what a run imports, while a machine's other packages (an inference server's pins, say) are never
    imported and must not refuse a start that allowed drift."""
    off_lock = {entry["name"]: entry["installed"] for entry in mismatched}
    rejected: dict[str, str] = {}
    for dist in metadata.distributions(path=list(sys.path if search_path is None else search_path)):
        if normalize_name(dist.metadata["Name"] or "") not in locked:
            continue
        for text in dist.requires or []:
            try:
                requirement = Requirement(text)
            except InvalidRequirement:
                continue  # a requirement this packaging cannot read decides nothing here
            name = normalize_name(requirement.name)
            if name not in off_lock or name in rejected:
                continue
            applies = requirement.marker is None or requirement.marker.evaluate({"extra": ""})
            if applies and not requirement.specifier.contains(off_lock[name], prereleases=True):
                rejected[name] = f"{dist.metadata['Name']} requires {requirement}"
    return rejected
