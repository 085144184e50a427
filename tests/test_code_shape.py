"""The training loop stays readable (issue 42): `app/train/trainer.py` under 480 lines and no function of
`app/train/` over 60, so a reader follows one step through a handful of named parts."""

from __future__ import annotations

import ast
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[1] / "app" / "train"


def test_the_trainer_module_stays_under_480_lines() -> None:
    assert len((TRAIN / "trainer.py").read_text().splitlines()) < 480


def test_no_function_of_the_training_package_is_over_60_lines() -> None:
    long = [
        f"{path.name}: {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in sorted(TRAIN.glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 60
    ]
    assert long == []
