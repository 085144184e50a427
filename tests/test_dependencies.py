"""Every third-party module `app/` imports is a declared dependency of the project (what deptry
checks): one that arrives only through another package (click through typer, yaml through
transformers) leaves the lock the day that package drops it. Found by reading the imports (AST), so
also those inside functions."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib import metadata

from tests.helpers import ROOT

PROVIDED = {
    "triton": "torch's own build of it (torch depends on the triton it was built with; a pin of ours could pull another)",
    "fla": "flash-linear-attention, the gpu group's (imported only where installed)",
}
"""Modules `app/` imports that are not a dependency of the main group, and why that is right."""


def imported_modules() -> dict[str, str]:
    """Top-level module -> the first file of app/ importing it, for every import outside the
    standard library and app itself."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "app").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top != "app" and top not in sys.stdlib_module_names:
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def declared() -> set[str]:
    """The main group's distributions, by normalized name."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {normalize(re.split(r"[<>=!~ ;\[]", spec, maxsplit=1)[0]) for spec in project["dependencies"]}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_module_app_imports_is_a_declared_dependency() -> None:
    distributions = metadata.packages_distributions()
    undeclared = {
        module: (where, distributions.get(module))
        for module, where in imported_modules().items()
        if module not in PROVIDED
        and not any(normalize(dist) in declared() for dist in distributions.get(module, []))
    }
    assert undeclared == {}, "declare these in pyproject.toml (./uvw add NAME) or stop importing them"


def test_every_declared_exception_is_still_imported() -> None:
    assert set(PROVIDED) <= set(imported_modules())
