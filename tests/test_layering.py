"""The layering of docs/architecture.md (Layering): a folder of `app/` imports only from lower layers."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "app"


def layers() -> dict[str, int]:
    """Each unit (a folder of app/, or a top-level module) and its layer, from the document's line."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Layering", 1)[1]
    line = re.search(r"^```\n(.+ < .+)\n```", section, flags=re.MULTILINE).group(1)  # type: ignore[union-attr]
    return {unit.strip(): rank for rank, layer in enumerate(line.split("<")) for unit in layer.split(",")}


def imports(unit: str) -> set[str]:
    """The other units that `unit` imports anywhere, also inside functions and under TYPE_CHECKING."""
    paths = sorted((APP / unit).rglob("*.py")) if (APP / unit).is_dir() else [APP / f"{unit}.py"]
    found: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            found |= {module.split(".")[1] for module in modules if module.startswith("app.")}
    return found - {unit}


def test_every_unit_of_app_has_a_layer() -> None:
    units = {path.stem for path in APP.glob("*.py") if path.stem != "__init__"}
    units |= {path.name for path in APP.iterdir() if (path / "__init__.py").is_file()}
    assert units == set(layers())


def test_no_unit_imports_from_its_own_layer_or_above() -> None:
    rank = layers()
    upward = [
        f"app.{unit} (layer {rank[unit]}) imports app.{other} (layer {rank[other]})"
        for unit in rank
        for other in sorted(imports(unit))
        if rank[other] >= rank[unit]
    ]
    assert upward == []
