"""The accepted equivalent mutants of docs/testing.md, which `just mutate` leaves out of a module's score,
stay true: each still exists under its name and still makes the change it is listed with. Costs mutmut's
mutation of each listed module (libcst, about a second each), not a mutation run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _mutate_script():
    spec = importlib.util.spec_from_file_location("mutate", ROOT / "scripts" / "mutate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutate"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


mutate = _mutate_script()


def test_every_listed_equivalent_mutant_still_makes_its_listed_change():
    listed = mutate.read_equivalents()
    assert listed, "docs/testing.md lists the accepted equivalent mutants in a table"
    assert all(entry.why.strip() for entry in listed)
    assert len({entry.name for entry in listed}) == len(listed)
    assert mutate.check_equivalents(listed) == []


def test_a_renumbered_changed_or_vanished_mutant_is_reported(tmp_path):
    changes = mutate.mutant_changes("app.bench.quality_report")
    name, change = next((n, c) for n, c in changes.items() if "_ranks__" in n)
    doc = tmp_path / "testing.md"
    doc.write_text(
        "# Testing\n\n## Accepted equivalent mutants\n\n| mutant | change | why |\n| --- | --- | --- |\n"
        f"| `{name}` | {change} | the reason |\n"
        f"| `{name}` | {change.replace('``', '`` x', 1)} | listed with another change |\n"
        "| `app.bench.quality_report.x__ranks__mutmut_9999` | `` a `` → `` b `` | renumbered away |\n"
        "| `app.gone.x_f__mutmut_1` | `` a `` → `` b `` | module removed |\n"
        "\n## Next section\n| `app.bench.quality_report.x_not_read__mutmut_1` | x | y |\n"
    )
    listed = mutate.read_equivalents(doc)
    assert [entry.why for entry in listed] == [
        "the reason",
        "listed with another change",
        "renumbered away",
        "module removed",
    ]
    stale = mutate.check_equivalents(listed)
    assert [line.split(":")[0] for line in stale] == [
        name,
        "app.bench.quality_report.x__ranks__mutmut_9999",
        "app.gone.x_f__mutmut_1",
    ]
    assert f"now makes {change}" in stale[0] and "no such mutant now" in stale[1] and "is gone" in stale[2]


def test_a_module_s_covering_tests_are_those_importing_it_directly_or_through_a_helper():
    assert mutate.covering_tests(["app.bench.quality_report"]) == ["tests/test_bench_quality.py"]
    # test_local_datagen.py reads prompts only through tests/datagen_helpers.py
    prompts = mutate.covering_tests(["app.datagen.prompts"])
    assert {"tests/test_datagen.py", "tests/test_local_datagen.py"} <= set(prompts)
    assert "tests/test_bench_quality.py" not in prompts
