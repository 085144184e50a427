"""`just mutate MODULE...`: mutmut's mutants of the named modules, run against only the tests that import
them, then the score and every surviving mutant with its change.

mutmut 3 takes its module list and test selection from `[tool.mutmut]` in pyproject.toml only, so each
run gets a scratch project in `.mutmut/`: links to the repository's files and a pyproject.toml whose
`[tool.mutmut]` is the repository's plus this run's modules and test files. The scratch project is made
anew every run: mutmut keeps a surviving mutant's verdict until it is named again, so a reused one would
still list the mutant a new test kills.

Mutants listed as equivalent in docs/testing.md (a table of name, change and reason) are left out of
the score; `check_equivalents` (run by tests/test_mutation_list.py) fails when a listed mutant no longer
exists or changes something else than it says, so the list cannot go stale.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from difflib import unified_diff
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".mutmut"
TESTING_DOC = ROOT / "docs" / "testing.md"
EQUIVALENTS_HEADING = "## Accepted equivalent mutants"
# `mutmut results` statuses. A timeout is the tests noticing the mutant (a loop that no longer ends);
# a child killed by a signal (mutmut calls SIGKILL and SIGSEGV "segfault") or ending oddly is not: the
# machine ran out of memory or the process died, so it is shown apart and left out of the score.
KILLED = {"killed", "timeout"}
CRASHED = {"segfault", "suspicious"}
ROW = re.compile(r"^\| `(?P<name>app\.[^`]+)` \| (?P<change>.+?) \| (?P<why>.+) \|$")


class BadInput(Exception):
    """One line for the user: what was wrong with the command line."""


@dataclass(frozen=True)
class Equivalent:
    name: str
    change: str
    why: str


def module_of(path: str) -> str:
    """`app/train/metrics.py` -> `app.train.metrics`, after checking that it is a module of app/."""
    file = (ROOT / path).resolve()
    if file.suffix != ".py" or not file.is_file() or not file.is_relative_to(ROOT / "app"):
        raise BadInput(f"{path}: expected a module file under app/, e.g. app/train/metrics.py")
    return ".".join(file.relative_to(ROOT).with_suffix("").parts)


def imported_modules(file: Path) -> set[str]:
    """Every module a file imports, lazy imports included: `from app.x import y` counts as app.x and
    app.x.y, because y may be a module."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def covering_tests(modules: Iterable[str]) -> list[str]:
    """The test files that import one of the modules, directly or through a helper module of tests/."""
    imports = {path: imported_modules(path) for path in sorted((ROOT / "tests").glob("*.py"))}
    helpers = {
        f"tests.{path.stem}": names for path, names in imports.items() if not path.stem.startswith("test_")
    }
    wanted = set(modules)
    return [
        str(path.relative_to(ROOT))
        for path, names in imports.items()
        if path.stem.startswith("test_")
        and (
            names & wanted
            or any(names_of_helper & wanted for h, names_of_helper in helpers.items() if h in names)
        )
    ]


def scratch_pyproject(modules: list[str], tests: list[str], also_copy: list[str]) -> str:
    """The repository's pyproject.toml with this run's modules and tests in `[tool.mutmut]`."""
    import tomllib

    from app.config.toml_text import toml_value

    text = (ROOT / "pyproject.toml").read_text()
    settings = tomllib.loads(text)["tool"]["mutmut"] | {
        "only_mutate": [module.replace(".", "/") + ".py" for module in modules],
        "pytest_add_cli_args_test_selection": tests,
        "also_copy": also_copy,
    }
    table = "[tool.mutmut]\n" + "".join(f"{key} = {toml_value(value)}\n" for key, value in settings.items())
    section = re.compile(r"^\[tool\.mutmut\]\n(?:(?!\[).*\n|\n)*", re.MULTILINE)
    scratch, replaced = section.subn(lambda _: table + "\n", text)
    assert replaced == 1, "pyproject.toml has one [tool.mutmut] table"
    assert tomllib.loads(scratch)["tool"]["mutmut"] == settings
    return scratch


def make_scratch_project(modules: list[str], tests: list[str]) -> None:
    """`.mutmut/`: links to the repository's tracked top-level files, copied into mutmut's mutants/
    because tests read them next to their own file (configs/, Dockerfile, ...)."""
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.splitlines()
    top = sorted({name.split("/", 1)[0] for name in tracked} - {"pyproject.toml"})
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir()
    for name in top:
        (WORK / name).symlink_to(ROOT / name)
    also_copy = [name for name in top if name not in ("app", "tests", "uv.lock")]
    (WORK / "pyproject.toml").write_text(scratch_pyproject(modules, tests, also_copy))


def results() -> dict[str, str]:
    """mutant name -> mutmut's status, for every mutant of the run."""
    lines = subprocess.run(
        [mutmut_command(), "results", "--all=true"], cwd=WORK, check=True, capture_output=True, text=True
    ).stdout.splitlines()
    return dict(line.strip().rsplit(": ", 1) for line in lines if line.strip())


def mutmut_command() -> str:
    return str(Path(sys.executable).parent / "mutmut")


def mutant_changes(module: str, only: Iterable[str] | None = None) -> dict[str, str]:
    """mutant name -> its change as one markdown table cell, from mutmut's own mutation of the module's
    current source (the names and changes a run gets). `only`: just these names, where they exist
    (reading each change back costs more than mutating the file, for a few names out of hundreds)."""
    import libcst
    from mutmut.mutation.diff_apply import read_mutant_function, read_original_function
    from mutmut.mutation.file_mutation import mutate_file_contents

    path = module.replace(".", "/") + ".py"
    mutated = mutate_file_contents(path, (ROOT / path).read_text())
    tree = libcst.parse_module(mutated.code)  # once: mutmut's own diff parses the whole file per mutant
    wanted = None if only is None else set(only)
    changes = {}
    for short_name in mutated.mutant_names:
        name = f"{module}.{short_name}"
        if wanted is not None and name not in wanted:
            continue
        original, mutant = (
            libcst.Module([read(tree, name)]).code.strip().split("\n")
            for read in (read_original_function, read_mutant_function)
        )
        changes[name] = change_cell(list(unified_diff(original, mutant, lineterm=""))[2:])
    return changes


def change_cell(diff: list[str]) -> str:
    """A unified diff's changed lines as `` old `` → `` new `` (several lines joined by ⏎)."""

    def side(sign: str) -> str:
        text = " ⏎ ".join(line[1:].strip() for line in diff if line.startswith(sign))
        return f"`` {text} ``".replace("|", "\\|") if text else "(nothing)"

    return f"{side('-')} → {side('+')}"


def read_equivalents(doc: Path = TESTING_DOC) -> list[Equivalent]:
    """The table under `## Accepted equivalent mutants` in docs/testing.md."""
    lines = doc.read_text().splitlines()
    start = lines.index(EQUIVALENTS_HEADING)
    table = []
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        if match := ROW.match(line):
            table.append(Equivalent(match["name"], match["change"], match["why"]))
    return table


def check_equivalents(equivalents: list[Equivalent]) -> list[str]:
    """One line per listed mutant that no longer exists or no longer makes the listed change."""
    by_module: dict[str, list[Equivalent]] = {}
    for entry in equivalents:
        by_module.setdefault(entry.name.rsplit(".", 1)[0], []).append(entry)
    stale = []
    for module, entries in by_module.items():
        if not (ROOT / (module.replace(".", "/") + ".py")).is_file():
            stale += [f"{entry.name}: its module {module} is gone" for entry in entries]
            continue
        changes = mutant_changes(module, [entry.name for entry in entries])
        for entry in entries:
            if entry.name not in changes:
                stale.append(f"{entry.name}: no such mutant now")
            elif changes[entry.name] != entry.change:
                stale.append(f"{entry.name}: now makes {changes[entry.name]}, listed as {entry.change}")
    return stale


@dataclass(frozen=True)
class Score:
    """One module's verdicts: equivalent mutants and crashed ones are outside the score."""

    mutants: int
    killed: int
    equivalent: int
    crashed: list[str]
    survivors: list[str]

    @property
    def percent(self) -> float:
        scored = self.killed + len(self.survivors)
        return 100 * self.killed / scored if scored else 100.0


def score(statuses: dict[str, str], equivalent: set[str]) -> Score:
    """The score of one module's mutants (name -> mutmut's status)."""
    counted = {name: status for name, status in statuses.items() if name not in equivalent}
    return Score(
        mutants=len(statuses),
        killed=sum(status in KILLED for status in counted.values()),
        equivalent=len(statuses) - len(counted),
        crashed=sorted((n for n, s in counted.items() if s in CRASHED), key=_numbered),
        survivors=sorted((n for n, s in counted.items() if s not in KILLED | CRASHED), key=_numbered),
    )


def report(modules: list[str], statuses: dict[str, str], minutes: float) -> None:
    """Per module: the counts and the score over the non-equivalent mutants; then each survivor."""
    equivalent = {entry.name for entry in read_equivalents()}
    for module in modules:
        mine = {name: status for name, status in statuses.items() if name.rsplit(".", 1)[0] == module}
        verdict = score(mine, equivalent)
        survivors = verdict.survivors
        unreached = Counter(_numbered(name)[0] for name in survivors if mine[name] == "no tests")
        print(
            f"{module}: {verdict.mutants} mutants, {verdict.killed} killed, {verdict.equivalent} equivalent, "
            f"{len(survivors)} survived ({sum(unreached.values())} not reached by the tests), "
            f"{len(verdict.crashed)} crashed: {verdict.percent:.1f}% of the scored killed"
        )
        if verdict.crashed:
            print(
                f"  crashed (a signal or an odd exit, not a test noticing; not scored, rerun them): "
                f"{', '.join(verdict.crashed)}"
            )
        for function, count in sorted(unreached.items()):
            print(
                f"  {function}: its {count} mutants are not reached by the tests (none calls it in-process)"
            )
        changes = mutant_changes(module, survivors) if survivors else {}
        for name in survivors:
            if mine[name] != "no tests":
                print(f"  {name} ({mine[name]}): {changes[name]}")
    print(f"mutate: {minutes:.1f} min")


def _numbered(name: str) -> tuple[str, int]:
    function, _, number = name.rpartition("__mutmut_")
    return function, int(number)


def run_as_group(command: list[str], cwd: Path) -> int:
    """Run `command` in a process group of its own and wait for it. A stop (Ctrl-C, SIGTERM) kills the
    whole group: mutmut's forked test runners otherwise outlive `just mutate` and keep the cores busy."""
    process = subprocess.Popen(command, cwd=cwd, start_new_session=True)

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        return process.wait()
    except KeyboardInterrupt:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="just mutate", description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="+", help="module files, e.g. app/train/metrics.py")
    parser.add_argument("--tests", nargs="+", help="test files to run instead of those importing the modules")
    parser.add_argument("--jobs", type=int, default=2, help="mutants tested at once (default 2)")
    args = parser.parse_args(argv)
    try:
        modules = [module_of(path) for path in args.modules]
        tests = args.tests or covering_tests(modules)
        if not tests:
            raise BadInput(f"no test file in tests/ imports {', '.join(modules)}; name them with --tests")
    except BadInput as error:
        print(f"mutate: {error}", file=sys.stderr)
        return 2
    print(f"mutate: {', '.join(modules)} against {' '.join(tests)}", flush=True)
    make_scratch_project(modules, tests)
    started = time.monotonic()
    returncode = run_as_group([mutmut_command(), "run", f"--max-children={args.jobs}"], WORK)
    if returncode != 0:
        print(f"mutate: mutmut run exited {returncode} (its output is above)", file=sys.stderr)
        return 1
    report(modules, results(), (time.monotonic() - started) / 60)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
