"""The code corpus's scan of an installed package (`app.datagen.corpus.code`), on a small package
written here: which documented items and module docstrings it takes, in which order, and the stubs
and prompts it makes of them. The corpus tests (tests/test_prompt_corpus.py) build from what is
installed, where HumanEval alone can fill the code quota."""

from __future__ import annotations

import ast
import hashlib
import math
import random
from pathlib import Path

from app.datagen.corpus import code
from app.datagen.corpus.code import CodeItem, ModuleDoc, humaneval_group, package_entries

LONG = ", ".join(f"argument_number_{index}: int = {index}" for index in range(6))
LINES = [f"Line {index:02d} of a long docstring that runs on, on." for index in range(20)]
"""45 characters each: with its newline a line takes 46, so 600 characters hold 13 lines and two more
characters, which the cut leaves out."""

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
    assert all(len(line) == 45 for line in LINES)
    assert items["long_documented"].docstring == "\n".join(LINES[:13])  # cut at the last line within 600
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


def test_a_summary_is_a_first_sentence_of_words_between_20_and_300_characters() -> None:
    summary = code._summary
    assert summary("Twenty characters, ok. Then more.\n\nAnd a paragraph.") == "Twenty characters, ok."
    assert summary("x" * 19 + ".") == "x" * 19 + "."  # 20 characters
    assert summary("x" * 18 + ".") is None
    assert summary("x" * 299 + ".") == "x" * 299 + "." and summary("x" * 300 + ".") is None
    assert (
        summary("A first paragraph without a stop\n\nsecond paragraph here.")
        == "A first paragraph without a stop"
    )
    for prefix in (
        "Deprecated since 2.0, use another.",
        "See the other function for this.",
        "Alias of the other function here.",
    ):
        assert summary(prefix) is None, prefix
    assert summary("abcdefghij0123456789") == "abcdefghij0123456789"  # half of it letters
    assert summary("abcdefghi01234567899") is None  # fewer than half
    assert summary("abcdefghij01234567899") == "abcdefghij01234567899"  # 10 letters of 21: 21 // 2 is 10


def test_a_docstring_is_cut_at_its_last_line_within_600_characters() -> None:
    cut = code._cut
    assert cut("x" * 600) == "x" * 600
    assert cut("y" * 300 + "\n" + "z" * 299) == "y" * 300 + "\n" + "z" * 299  # 600 with its last line
    assert cut("x" * 601) == "x" * 600  # one line: cut at the limit
    assert cut("y" * 300 + "   \n" + "z" * 400) == "y" * 300  # the line's trailing spaces go too
    assert cut("  " + "y" * 300 + "\n" + "z" * 400) == "  " + "y" * 300  # a leading indent stays
    assert cut("  " + "x" * 650) == "  " + "x" * 598


def test_a_module_doc_is_a_prose_first_paragraph_of_80_to_700_characters() -> None:
    def doc(paragraph: str) -> str | None:
        return code._module_doc(ast.parse(f'"""{paragraph}\n\nMore."""'))

    assert doc("w" * 80) == "w" * 80 and doc("w" * 79) is None
    assert doc("w" * 700) == "w" * 700 and doc("w" * 701) is None
    assert doc("Copyright " + "w" * 90) is None and doc("Licensed under " + "w" * 90) is None
    assert doc("Some ChatML <|im_start|> in a module docstring " + "w" * 60) is None


def test_files_are_parsed_in_passes_by_docstring_density_and_size(tmp_path: Path) -> None:
    def source(size: int, quotes: str = "'''") -> Path:
        head = f"def f():\n    {quotes}A docstring.{quotes}\n"
        path = tmp_path / f"{size}-{len(quotes)}.py"
        path.write_text(head + "#" * (size - len(head) - 1) + "\n")
        assert path.stat().st_size == size
        return path

    dense = source(1000)  # two triple quotes in a kilobyte: density exactly 2
    assert code._parse(dense, math.inf, 2.0) is not None and code._parse(dense, 2.0, 0.5) is None
    under = source(1001)  # just under 2: the second pass's
    assert code._parse(under, math.inf, 2.0) is None and code._parse(under, 2.0, 0.5) is not None
    many = "\n".join(f'def f{index}():\n    """Doc."""' for index in range(60)) + "\n"
    largest = tmp_path / "largest.py"
    largest.write_text(many + "#" * (code.MAX_FILE_BYTES - len(many) - 1) + "\n")
    assert largest.stat().st_size == code.MAX_FILE_BYTES and code._parse(largest, math.inf, 0.5) is not None
    largest.write_text(many + "#" * (code.MAX_FILE_BYTES - len(many)) + "\n")
    assert code._parse(largest, math.inf, 0.0) is None  # one byte over


def test_a_parameter_list_is_written_out_up_to_120_characters() -> None:
    def parameters(text: str) -> str:
        return code._arguments(ast.parse(f"def f({text}): pass").body[0].args)

    exact = "a_parameter_name_" + "x" * 100 + "=1"
    exact = exact + "0" * (120 - len(ast.unparse(ast.parse(f"def f({exact}): pass").body[0].args)))
    assert len(parameters(exact)) == 120 and parameters(exact) == ast.unparse(
        ast.parse(f"def f({exact}): pass").body[0].args
    )
    assert parameters(exact + "0") == exact.split("=")[0]  # 121: the names only


def test_source_files_are_every_python_file_in_path_hash_order(tmp_path: Path) -> None:
    root = tmp_path / "pkg"
    for relative in ("a.py", "b.py", "sub/c.py", "sub/deeper/d.py", "tests/t.py", ".cache/e.py", "notes.txt"):
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text("")
    files = code._source_files(root)
    expected = ["a.py", "b.py", "sub/c.py", "sub/deeper/d.py"]
    assert files == sorted(expected, key=lambda path: hashlib.sha256(path.encode()).digest())


def test_a_file_that_does_not_parse_does_not_end_the_scan(tmp_path: Path) -> None:
    root = write_package(tmp_path)
    entries = list(code._scan("widgets", root, ["sparse.py", "__init__.py"], math.inf, 2.0))
    assert [entry.module for entry in entries][:1] == ["widgets"] and len(entries) > 1


def test_a_package_gives_at_most_its_item_quota(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(code, "MAX_ITEMS_PER_PACKAGE", 2)
    entries = list(package_entries([("widgets", write_package(tmp_path))]))
    assert sum(isinstance(entry, CodeItem) for entry in entries) == 2
    assert sum(isinstance(entry, ModuleDoc) for entry in entries) == 1  # docs are not items


def test_a_module_file_is_no_package_and_a_class_s_bases_and_a_bare_call_show() -> None:
    assert code._package_dir("typing") is None and code._package_dir("json") is not None
    (item,) = code._items(
        ast.parse('class Both(A, B):\n    """A class with two bases, documented."""'), "p", "p.m"
    )
    assert item.parameters == "A, B"
    bare = CodeItem("p", "p.m", "function", "run", "", "Run it all.", "Run it all now, at once.")
    assert "Write a Python function `run()` for this description: Run it all now, at once." in bare.prompts(
        random.Random(0), 8
    )
