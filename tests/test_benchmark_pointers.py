"""Measurements live in BENCHMARKS.md: a docstring or comment under app/ says what and why and may point
to an entry there, but does not carry the entry's numbers."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEASURED = re.compile(r"\d[\d.,]*\s?K?\s?(?:ms|tok/s|GB/s|GB|TFLOP/s)(?![\w/])")
POINTER = re.compile(r"BENCHMARKS\.md,\s+(\d{4}-\d{2}-\d{2})")
# its docstring shows a sample log line, whose fields are numbers with units
SAMPLE_LINE = ROOT / "app" / "telemetry" / "logline.py"


def prose(path: Path) -> list[tuple[int, str]]:
    """Each docstring and each block of consecutive comment lines, with its first line number."""
    text = path.read_text()
    found = [
        (node.lineno, node.value.value)
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    ]
    block: list[str] = []
    start = 0
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            start = start if block else token.start[0]
            block.append(token.string)
        elif token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT) and block:
            found.append((start, " ".join(block)))
            block = []
    return found


def test_no_docstring_or_comment_carries_a_benchmark_s_numbers() -> None:
    narrative = [
        f"{path.relative_to(ROOT)}:{line}: {MEASURED.findall(text)}"
        for path in sorted((ROOT / "app").rglob("*.py"))
        if path != SAMPLE_LINE
        for line, text in prose(path)
        if len(MEASURED.findall(text)) > 1
    ]
    assert narrative == []


def test_every_pointer_to_benchmarks_md_names_an_entry_of_that_date() -> None:
    dates = set(re.findall(r"^#+ (\d{4}-\d{2}-\d{2})", (ROOT / "BENCHMARKS.md").read_text(), re.MULTILINE))
    pointers = {
        f"{path.relative_to(ROOT)}: {date}"
        for path in sorted((ROOT / "app").rglob("*.py"))
        for date in POINTER.findall(" ".join(path.read_text().split()))
    }
    assert pointers and {pointer for pointer in pointers if pointer.rsplit(" ", 1)[1] not in dates} == set()
