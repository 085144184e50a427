"""Which packages uv.lock installs on this machine: the project's dependency closure under the lock.

Comparing installed versions with the lock catches a swapped package, not one the lock adds: an
edited uv.lock that names a new dependency, or a venv synced from an older lock, has every installed
package at a locked version and still is not what the lock describes. The closure here is walked as
`uv sync` would: the project's dependencies, its extras, and every dependency group that was synced
(one with a package installed that nothing else requires), each edge kept only when its marker holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from packaging.markers import InvalidMarker, Marker, UndefinedComparison, UndefinedEnvironmentName

from app.env.packages import normalize_name
from app.env.project import PROJECT_NAME

Entry = dict[str, Any]


def required_packages(lock: dict[str, Any], installed: Iterable[str]) -> dict[str, set[str]]:
    """Normalized name -> locked versions of every package the lock installs here.

    `installed`: the normalized names present, to tell which dependency groups were synced.
    """
    entries: dict[str, list[Entry]] = {}
    for entry in lock.get("package", []):
        entries.setdefault(normalize_name(entry["name"]), []).append(entry)
    root = _root(entries)
    if root is None:
        return {}
    required: dict[str, set[str]] = {}
    _walk(entries, root.get("dependencies", []), required)
    present = set(installed)
    for members in (root.get("dev-dependencies") or {}).values():
        own = {normalize_name(dep["name"]) for dep in members if _holds(dep)} - required.keys()
        if own & present:  # the group was synced (its own packages are here): all of it must be
            _walk(entries, members, required)
    return required


def _root(entries: dict[str, list[Entry]]) -> Entry | None:
    candidates = entries.get(normalize_name(PROJECT_NAME), [])
    return candidates[0] if candidates else None


def _walk(entries: dict[str, list[Entry]], deps: list[Entry], required: dict[str, set[str]]) -> None:
    stack = list(deps)
    seen: set[tuple[str, str | None, tuple[str, ...]]] = set()
    while stack:
        dep = stack.pop()
        if not _holds(dep):
            continue
        name, extras = normalize_name(dep["name"]), tuple(dep.get("extra", ()))
        for entry in _matching(entries.get(name, []), dep.get("version")):
            key = (name, entry.get("version"), extras)
            if key in seen:
                continue
            seen.add(key)
            if isinstance(entry.get("version"), str):
                required.setdefault(name, set()).add(entry["version"])
            else:
                required.setdefault(name, set())
            stack += entry.get("dependencies", [])
            for extra in extras:
                stack += (entry.get("optional-dependencies") or {}).get(extra, [])


def _matching(candidates: list[Entry], version: str | None) -> list[Entry]:
    """The lock entries a dependency edge means: the named version, else the fork whose markers hold."""
    if version is not None:
        return [entry for entry in candidates if entry.get("version") == version]
    if len(candidates) <= 1:
        return candidates
    forks = [entry for entry in candidates if any(map(_marker_holds, entry.get("resolution-markers", [])))]
    return forks or candidates


def _holds(dep: Entry) -> bool:
    return _marker_holds(dep["marker"]) if "marker" in dep else True


def _marker_holds(marker: str) -> bool:
    try:
        return Marker(marker).evaluate({"extra": ""})
    except (InvalidMarker, UndefinedComparison, UndefinedEnvironmentName):
        return True  # a marker this packaging cannot read: count the package rather than miss drift
