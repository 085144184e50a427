"""The training run guards its own environment: a drifted start is refused (or, allowed on purpose,
recorded as DEGRADED), every start is appended to the run's record, and a resume is compared with
the run's last good start. The faults are planted for real: a distribution on sys.path, a compiler
variable in the environment, an edited lock, a recorded start of another stack."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from app.config import load_config
from app.env import assess, collect_fingerprint, diff_fingerprints, read_starts, recorded_fingerprint
from app.env.compiler_flags import degrading_flags, recorded_compiler_env
from app.env.guard import EnvironmentCheck, check_environment
from app.env.lock_closure import required_packages
from app.env.project import code_hashes
from app.env.record import ENVIRONMENT_RECORD, append_start
from app.errors import UserError
from app.telemetry.reporter import RunStart
from app.telemetry.status import StatusFile
from app.telemetry.status_report import render_status
from app.train.ranks import run_drafter_rank
from app.train.trainer import Trainer
from tests.helpers import ROOT, run_dflash, small_config
from tests.test_doctor import write_distribution


def quiet(line: str) -> None:
    pass


# --- refusing a start ----------------------------------------------------------------------------


def test_train_refuses_a_drifted_environment_before_loading_anything(
    tiny_lm_dir, tiny_conversations, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dflash train` with SGLang on the path and the inductor caches disabled: exit 2 before torch
    loads, one line naming each finding with its fix, nothing written. The guard itself (each training
    process, once torch has loaded: what the early check cannot see) says the same, a line each."""
    site = tmp_path / "site"
    write_distribution(site, "sglang", "0.5.3")
    run_dir = tmp_path / "run"
    done = run_dflash(
        "train", "configs/tiny.toml", f"data.train_files=['{tiny_conversations}']", f"train.output_dir={run_dir}",
        env={"PYTHONPATH": str(site), "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"},
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(
        "dflash: error: inference-stack packages in the training environment: sglang 0.5.3"
    )
    assert (
        "; fix: ./uvw sync (in the image: rebuild it from uv.lock); TORCHINDUCTOR_FORCE_DISABLE_CACHES=1: "
        in line
    )
    assert line.endswith("; fix: unset TORCHINDUCTOR_FORCE_DISABLE_CACHES")
    assert not run_dir.exists()

    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
    with pytest.raises(UserError) as refused:
        check_environment(None, resume=False, allow_drift=False)
    lines = str(refused.value).splitlines()
    assert lines[0] == "the environment is not one this run may train in (2 findings):"
    assert lines[1].startswith("  - inference-stack packages in the training environment: sglang 0.5.3")
    assert lines[1].endswith("; fix: ./uvw sync (in the image: rebuild it from uv.lock)")
    assert lines[2].startswith("  - TORCHINDUCTOR_FORCE_DISABLE_CACHES=1: inductor ignores every cache")
    assert lines[2].endswith("; fix: unset TORCHINDUCTOR_FORCE_DISABLE_CACHES")
    assert lines[3] == (
        "to train anyway, set train.allow_environment_drift=true (the run's status then says DEGRADED)"
    )


def test_an_allowed_drift_trains_degraded_and_every_start_is_recorded(
    tiny_lm_dir, tiny_conversations, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A clean first start, then a resume with SGLang on the path allowed on purpose: the record gains
    a second start naming what it accepted, fingerprint.json stays the first start's, status says
    DEGRADED, and comparisons use the last good start (the first), not the drifted resume."""
    run_drafter_rank(small_config(tiny_conversations, tmp_path, "train.max_steps=1"), None, False, quiet)
    first_fingerprint = (tmp_path / "fingerprint.json").read_bytes()
    site = tmp_path / "polluted-site"
    write_distribution(site, "sglang", "0.5.3")
    monkeypatch.syspath_prepend(str(site))
    allowed = small_config(
        tiny_conversations, tmp_path, "train.max_steps=1", "train.allow_environment_drift=true"
    )
    lines: list[str] = []
    run_drafter_rank(allowed, None, True, lines.append)

    starts = read_starts(tmp_path)
    assert [(start.start, start.step, start.good) for start in starts] == [(1, 0, True), (2, 1, False)]
    assert "sglang 0.5.3" in starts[1].accepted[0]
    # each start keeps the settings it trained with (config.json is the newest start's)
    assert [start.config["train"]["allow_environment_drift"] for start in starts] == [False, True]
    assert "packages.stray.sglang" in starts[1].accepted[1]  # and it differs from start 1
    assert any(
        line.startswith("warning: DEGRADED start, accepted by train.allow_environment_drift")
        for line in lines
    )
    assert (tmp_path / "fingerprint.json").read_bytes() == first_fingerprint

    text, healthy = render_status(tmp_path)
    assert not healthy and "health: DEGRADED" in text
    assert "environment: inference-stack packages in the training environment: sglang 0.5.3" in text
    reference, described = recorded_fingerprint(tmp_path)
    assert described.endswith("last good start: " + starts[0].describe())
    assert reference == starts[0].fingerprint
    drift = [d.field for d in diff_fingerprints(reference, collect_fingerprint()) if d.breaking]
    assert drift == ["packages.stray.sglang"]


def test_a_resume_in_another_stack_is_refused_naming_each_change(
    tiny_lm_dir, tiny_conversations, tmp_path: Path
) -> None:
    """The run's first start recorded another torch build and another version of one file of the
    appliance: a resume here is refused with a line for each, and appends nothing to the record.
    It also recorded flash-linear-attention, which the tiny target (no linear-attention layer) never
    uses: no finding."""
    config = small_config(tiny_conversations, tmp_path, "train.max_steps=1")
    Trainer(config, log=quiet).run()
    record = tmp_path / ENVIRONMENT_RECORD
    start = json.loads(record.read_text())
    start["fingerprint"]["torch"]["version"] = "2.9.1"
    start["fingerprint"]["code"]["model/drafter.py"] = "0" * 16
    start["fingerprint"]["fast_kernels"]["fla"] = {"present": True, "version": "0.6.0", "error": None}
    record.write_text(json.dumps(start) + "\n")
    before = record.read_bytes()
    resumed = small_config(tiny_conversations, tmp_path, "train.max_steps=1")
    with pytest.raises(UserError) as refused:
        Trainer(resumed, resume=True, log=quiet)
    message = str(refused.value)
    assert "(2 findings)" in message
    assert "  - since start 1 (step 0, " in message
    assert "torch.version 2.9.1 -> " in message and "code.model/drafter.py 0000000000000000 -> " in message
    assert f"`dflash doctor --against {tmp_path}` lists every difference" in message
    assert record.read_bytes() == before


def test_a_new_run_starts_a_new_record_and_a_torn_line_is_cut(tmp_path: Path) -> None:
    fingerprint = collect_fingerprint()
    append_start(tmp_path, fingerprint, step=0, accepted=[], new_run=True)
    with (tmp_path / ENVIRONMENT_RECORD).open("a") as handle:
        handle.write('{"start": 2, "at": "killed mid-wri')  # a kill during an append
    assert len(read_starts(tmp_path)) == 1
    append_start(tmp_path, fingerprint, step=7, accepted=["x"], new_run=False)
    assert [(start.start, start.step) for start in read_starts(tmp_path)] == [(1, 0), (2, 7)]
    append_start(tmp_path, fingerprint, step=0, accepted=[], new_run=True)
    assert [start.start for start in read_starts(tmp_path)] == [1]


# --- what the doctor sees ------------------------------------------------------------------------


def test_compiler_variables_are_recorded_and_the_degrading_ones_are_problems(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    monkeypatch.setenv("HOME_UNRELATED", "1")
    live = recorded_compiler_env()
    assert live["TORCHDYNAMO_DISABLE"] == "1" and "HOME_UNRELATED" not in live
    recorded = recorded_compiler_env(
        {
            "TORCHDYNAMO_DISABLE": "1",
            "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
            "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",  # on: harmless
            "TORCH_LOGS": "recompiles",  # recorded, harmless
            "TORCH_CACHING_PRECOMPILE": "1",
            "TORCH_STRICT_PRECOMPILE": "0",  # recorded, harmless
            "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1",  # numerics: recorded
            "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
            "PATH": "/usr/bin",
        }
    )
    assert list(recorded) == [
        "CUBLAS_WORKSPACE_CONFIG", "TORCHDYNAMO_DISABLE", "TORCHINDUCTOR_AUTOGRAD_CACHE",
        "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "TORCH_CACHING_PRECOMPILE",
        "TORCH_LOGS", "TORCH_STRICT_PRECOMPILE",
    ]  # fmt: skip
    assert [flag.name for flag, _ in degrading_flags(recorded)] == [
        "TORCHDYNAMO_DISABLE",
        "TORCHINDUCTOR_FX_GRAPH_CACHE",
        "TORCH_CACHING_PRECOMPILE",
    ]
    problems = [
        f for f in assess({**collect_fingerprint(), "compiler_env": recorded}) if f.level == "problem"
    ]
    assert [f.fix for f in problems] == [
        "unset TORCHDYNAMO_DISABLE", "unset TORCHINDUCTOR_FX_GRAPH_CACHE", "unset TORCH_CACHING_PRECOMPILE",
    ]  # fmt: skip

    clean = {**collect_fingerprint(), "compiler_env": {"TORCH_LOGS": "dynamo"}}
    changes = {d.field: d.breaking for d in diff_fingerprints(clean, {**clean, "compiler_env": recorded})}
    assert changes == {
        "compiler_env.TORCHDYNAMO_DISABLE": True,
        "compiler_env.TORCHINDUCTOR_AUTOGRAD_CACHE": False,
        "compiler_env.TORCHINDUCTOR_FX_GRAPH_CACHE": True,
        "compiler_env.TORCH_LOGS": False,
        "compiler_env.TORCH_CACHING_PRECOMPILE": True,
        "compiler_env.TORCH_STRICT_PRECOMPILE": False,
        "compiler_env.TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": True,  # numerics: set only at a resume, refused
        "compiler_env.CUBLAS_WORKSPACE_CONFIG": True,
    }


def test_code_hashes_name_each_changed_file(tmp_path: Path) -> None:
    package = tmp_path / "app"
    (package / "model").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "model" / "drafter.py").write_text("layers = 5\n")
    before = {"code": code_hashes(package)}
    (package / "model" / "drafter.py").write_text("layers = 6\n")
    (package / "model" / "new.py").write_text("")
    after = {"code": code_hashes(package)}
    assert sorted(after["code"]) == ["__init__.py", "model/drafter.py", "model/new.py"]
    changed = [(d.field, d.breaking) for d in diff_fingerprints(before, after) if d.field.startswith("code.")]
    assert changed == [("code.model/drafter.py", True), ("code.model/new.py", True)]


def synthetic_lock(*members: str, dev: tuple[str, ...] = ()) -> dict:
    """A uv.lock of the project depending on `members`, each depending on nothing."""
    project = {
        "name": "dflash-appliance",
        "version": "0.1.0",
        "dependencies": [{"name": name} for name in members],
        "dev-dependencies": {"dev": [{"name": name} for name in dev]},
    }
    return {"package": [project, *({"name": name, "version": "1.0"} for name in {*members, *dev})]}


def test_the_lock_closure_finds_what_an_edited_lock_adds() -> None:
    """A lock naming a package this venv lacks is not what is installed, though every installed
    version matches it; a dependency group counts only where it was synced."""
    lock = synthetic_lock("torch", "newdep", dev=("pytest", "ruff"))
    assert set(required_packages(lock, {"torch"})) == {"torch", "newdep"}  # dev not synced here
    assert set(required_packages(lock, {"torch", "pytest"})) == {"torch", "newdep", "pytest", "ruff"}
    marked = synthetic_lock("torch")
    marked["package"][0]["dependencies"].append({"name": "pywin32", "marker": "sys_platform == 'win32'"})
    assert set(required_packages(marked, {"torch"})) == {"torch"}


def test_plain_doctor_fails_on_a_lock_that_adds_a_package(tmp_path: Path) -> None:
    """The project's own uv.lock, with one more dependency of the project: every installed version
    still matches, yet the doctor says the lock differs from what is installed, and how to fix it."""
    lock = (ROOT / "uv.lock").read_text()
    anchor = 'source = { editable = "." }\ndependencies = [\n'
    assert anchor in lock
    edited = lock.replace(anchor, anchor + '    { name = "brand-new-dep" },\n')
    edited += '\n[[package]]\nname = "brand-new-dep"\nversion = "1.0"\nsource = { registry = "https://pypi.org/simple" }\n'
    (tmp_path / "uv.lock").write_text(edited)
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    found = collect_fingerprint(project_root=tmp_path)
    assert found["packages"]["missing"] == [{"name": "brand-new-dep", "locked": ["1.0"]}]
    problems = [f for f in assess(found) if f.level == "problem"]
    assert [f.message for f in problems] == [
        "uv.lock differs from what is installed: 1 packages it installs here are absent: brand-new-dep 1.0"
    ]
    assert problems[0].fix == "./uvw sync (in the image: rebuild it from uv.lock)"
    assert not [f for f in assess(collect_fingerprint()) if f.level == "problem"]  # the real lock: in sync


def git(repo: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        check=True,
        capture_output=True,
    )


@pytest.mark.skipif(
    shutil.which("git") is None, reason="needs git to make a checkout (a fresh machine may have only Python)"
)
def test_edits_against_the_commit_are_recorded_and_an_edited_lock_is_a_problem(tmp_path: Path) -> None:
    """A checkout whose uv.lock and one file of app/ differ from its commit: the fingerprint names
    both; the lock is a problem whose fix restores it (`./uvw sync --locked` alone would install the
    edit); the code edit is no problem, but a run started there says so in `dflash status`."""
    repo = tmp_path / "checkout"
    (repo / "app").mkdir(parents=True)
    for name in ("pyproject.toml", "uv.lock"):
        shutil.copy(ROOT / name, repo / name)
    (repo / "app" / "loop.py").write_text("STEPS = 1\n")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "clean")
    assert collect_fingerprint(project_root=repo)["project"]["changed"] == []
    (repo / "app" / "loop.py").write_text("STEPS = 2\n")
    with (repo / "uv.lock").open("a") as handle:
        handle.write("# pinned by hand\n")
    found = collect_fingerprint(project_root=repo)
    assert found["project"]["changed"] == ["app/loop.py", "uv.lock"]
    problems = [finding for finding in assess(found) if finding.level == "problem"]
    revision = found["project"]["revision"][:12]
    assert [(f.message, f.fix) for f in problems] == [
        (
            f"uv.lock differs from commit {revision} (edited): the lock no longer pins what the commit pins",
            "git checkout uv.lock, then ./uvw sync --locked (or commit the edit, if it is meant)",
        )
    ]
    run_dir = tmp_path / "run"
    StatusFile(load_config(ROOT / "configs" / "tiny.toml")).on_start(RunStart(run_dir, {}, found, {}))
    text, _ = render_status(run_dir)
    assert f"code: 2 files differ from commit {revision}: app/loop.py, uv.lock" in text.splitlines()
    # the start's own log says it too (the lock is a problem, named apart)
    assert EnvironmentCheck(found).notes == [
        f"this run's code differs from commit {revision} in 1 file(s): app/loop.py"
    ]
