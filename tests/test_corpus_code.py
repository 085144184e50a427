"""The code corpus's scan of an installed package (`app.datagen.corpus.code`), on a small package
written here: which documented items and module docstrings it takes, in which order, and the stubs
and prompts it makes of them. The corpus tests (tests/test_prompt_corpus.py) build from what is
installed, where HumanEval alone can fill the code quota."""

from __future__ import annotations

import random
from pathlib import Path

from app.datagen.corpus.code import CodeItem, ModuleDoc, humaneval_group, package_entries

LONG = ", ".join(f"argument_number_{index}: int = {index}" for index in range(6))
LINES = [f"Line {index:02d} of a long docstring, that runs on and on." for index in range(20)]
"""49 characters each: with its newline a line takes 50, so 600 characters hold exactly 12 lines."""

PACKAGE = {
    "__init__.py": '''"""Widgets for the tests of the code corpus: this first paragraph is long enough to be prose
that a prompt can quote, and it says nothing of legal terms.

A second paragraph is not taken."""


def greet(name, *args, greeting="hi", **options):
    """Say hello to someone by name, politely. More sentences follow here."""


def _hidden():
    """A private function that is documented all the same."""


def bare():
    pass


def deprecated_thing():
    """Deprecated: use greet instead, which does the same thing."""
'''
    + '\n\ndef long_documented():\n    """'
    + "\n    ".join(LINES)
    + '"""\n',
    "core.py": f'''"""Copyright 2026 the widget authors, under the Apache licence: its terms are in the licence file."""
from typing import overload


class Widget(Base):
    """A widget that spins when asked, and stops when told."""

    def spin(self, times):
        """Spin the widget a number of times, then stop."""

    def _wobble(self):
        """Wobble the widget, which is private to it."""


class _Private:
    """A private class whose methods are never taken."""

    def visible(self):
        """A method of a private class, so left out too."""


@overload
def shape(value: int) -> int:
    """An overload stub that only declares a signature."""


def configure({LONG}, *rest, flag=True, **extra):
    """Configure everything with a great many arguments at once."""
''',
    "tests/test_widget.py": '''def test_spin():
    """A test function, in a folder the scan leaves out."""
''',
    ".hidden/secret.py": '''def secret():
    """A function in a hidden folder, which the scan leaves out."""
''',
    "sparse.py": '"""A sparse module whose one docstring is lost in a lot of code, so it is not parsed."""\n'
    + "value = 1\n" * 2000,
}


def write_package(root: Path) -> Path:
    for relative, source in PACKAGE.items():
        path = root / "widgets" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return root / "widgets"


def test_the_scan_takes_public_documented_items_and_prose_module_docs(tmp_path: Path) -> None:
    entries = list(package_entries([("widgets", write_package(tmp_path))]))
    docs = [entry for entry in entries if isinstance(entry, ModuleDoc)]
    items = {entry.name: entry for entry in entries if isinstance(entry, CodeItem)}
    assert docs == [
        ModuleDoc(
            "widgets",
            "widgets",
            "Widgets for the tests of the code corpus: this first paragraph is long enough to be prose "
            "that a prompt can quote, and it says nothing of legal terms.",
        )
    ]  # not core.py's licence line; sparse.py is never parsed
    assert sorted(items) == ["Widget", "Widget.spin", "configure", "greet", "long_documented"]
    assert all(len(line) == 49 for line in LINES)
    assert items["long_documented"].docstring == "\n".join(LINES[:12])  # cut at the last line within 600
    assert items["greet"] == CodeItem(
        "widgets",
        "widgets",
        "function",
        "greet",
        "name, *args, greeting='hi', **options",
        "Say hello to someone by name, politely. More sentences follow here.",
        "Say hello to someone by name, politely.",
    )
    assert (items["Widget"].kind, items["Widget"].module, items["Widget"].parameters) == (
        "class",
        "widgets.core",
        "Base",
    )
    assert (items["Widget.spin"].kind, items["Widget.spin"].parameters) == ("method", "self, times")
    # over 120 characters written out: only the names, with the stars of the variadic ones
    assert items["configure"].parameters == ", ".join(
        [*(f"argument_number_{index}" for index in range(6)), "*rest", "flag", "**extra"]
    )


def test_two_packages_take_turns(tmp_path: Path) -> None:
    first, second = write_package(tmp_path / "a"), write_package(tmp_path / "b")
    entries = list(package_entries([("first", first), ("second", second)]))
    packages = [entry.package for entry in entries]
    assert packages == ["first", "second"] * (len(entries) // 2)
    assert [entry.module for entry in entries[::2]] == [
        module.replace("second", "first", 1) for module in (entry.module for entry in entries[1::2])
    ]


def test_a_stub_is_the_definition_s_header_and_its_docstring_and_prompts_fill_the_templates() -> None:
    method = CodeItem(
        "widgets", "widgets.core", "method", "Widget.spin", "self, times", "Spin it.\n\nTwice.", "Spin it."
    )
    assert method._stub() == 'def spin(self, times):\n    """Spin it.\n\n    Twice."""'
    based = CodeItem("widgets", "widgets.core", "class", "Widget", "Base", "A widget.", "A widget.")
    assert based._stub() == 'class Widget(Base):\n    """A widget."""'
    plain = CodeItem("widgets", "widgets.core", "class", "Plain", "", "A plain one.", "A plain one.")
    assert plain._stub() == 'class Plain:\n    """A plain one."""'
    prompts = plain.prompts(random.Random(0), 8)  # every template once
    assert "Write a Python class `Plain` for this description: A plain one." in prompts
    assert (
        'Explain what this Python class from `widgets.core` does:\n\n```python\nclass Plain:\n    """A plain one."""\n```'
        in prompts
    )
    assert (
        "Give an example of using `widgets.core.Plain` and explain the result. Its documentation says: A plain one."
        in prompts
    )
    assert (
        "What mistakes might someone make when using the method `Widget.spin(self, times)`? It is documented as: Spin it."
        in [prompt for prompt in method.prompts(random.Random(0), 8)]
    )


def test_humaneval_s_164_problems_form_eight_groups_of_consecutive_tasks() -> None:
    groups = [humaneval_group(task) for task in range(164)]
    assert groups[0] == "code/humaneval:g0" and groups[-1] == "code/humaneval:g7"
    assert [groups.count(f"code/humaneval:g{group}") for group in range(8)] == [
        21,
        20,
        21,
        20,
        21,
        20,
        21,
        20,
    ]
    assert groups == sorted(groups)
