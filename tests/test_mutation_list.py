"""The accepted equivalent mutants of docs/testing.md, which `just mutate` leaves out of a module's score,
stay true: each still exists under its name and still makes the change it is listed with. Costs mutmut's
mutation of each listed module (libcst, about a second each), not a mutation run."""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
import time
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


def test_timeouts_count_as_killed_crashes_stand_apart_and_equivalents_leave_the_score():
    statuses = {
        "m.x_f__mutmut_1": "killed",
        "m.x_f__mutmut_2": "timeout",  # the mutant made a loop endless: the tests noticed
        "m.x_f__mutmut_3": "segfault",  # mutmut's name for a child killed by SIGKILL or SIGSEGV
        "m.x_f__mutmut_4": "suspicious",
        "m.x_f__mutmut_10": "survived",
        "m.x_f__mutmut_5": "no tests",
        "m.x_g__mutmut_1": "survived",
    }
    verdict = mutate.score(statuses, equivalent={"m.x_g__mutmut_1"})
    assert (verdict.mutants, verdict.killed, verdict.equivalent) == (7, 2, 1)
    assert verdict.crashed == ["m.x_f__mutmut_3", "m.x_f__mutmut_4"]
    assert verdict.survivors == ["m.x_f__mutmut_5", "m.x_f__mutmut_10"]  # numbered order, not text order
    assert verdict.percent == 50.0
    assert mutate.score({"m.x_g__mutmut_1": "survived"}, {"m.x_g__mutmut_1"}).percent == 100.0


def test_a_stopped_run_takes_its_whole_process_group_with_it(tmp_path):
    """`just mutate` stopped (Ctrl-C, SIGTERM) leaves no mutmut test runner behind on the cores."""
    pid_file = tmp_path / "grandchild"
    child = (
        "import subprocess, sys, time\n"
        "runner = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(runner.pid))\n"
        "time.sleep(120)\n"
    )
    driver = (
        f"import sys; sys.path.insert(0, {str(ROOT / 'scripts')!r}); import mutate\n"
        f"sys.exit(mutate.run_as_group([sys.executable, '-c', {child!r}], {str(tmp_path)!r}))\n"
    )
    stopping = subprocess.Popen([sys.executable, "-c", driver])
    deadline = time.monotonic() + 60
    while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    stopping.send_signal(signal.SIGTERM)
    assert stopping.wait(timeout=30) == 130
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


def _alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie nobody has reaped yet."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"
