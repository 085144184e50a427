"""What is installed, checked before anything imports it: a locked package at another version (one
that transformers itself checks at import), a copy on PYTHONPATH shadowing the venv's, a file edited
inside an installed package. The faults are planted for real in a temporary directory on the path,
never in the venv."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

from app.env import assess, collect_fingerprint, diff_fingerprints
from app.env.health import edited_file_findings, startup_file_findings
from app.env.integrity import edited_files, startup_files
from app.env.origins import site_packages
from app.env.preflight import require_locked_stack
from app.errors import UserError
from tests.helpers import ROOT, run_dflash
from tests.test_doctor import write_distribution

SYNC = "fix: ./uvw sync (in the image: rebuild it from uv.lock)"
UNSET = "or unset PYTHONPATH (it comes before the venv on sys.path)"


def test_a_locked_package_transformers_rejects_is_the_guards_line_not_its_traceback(tmp_path: Path) -> None:
    """safetensors 0.7.0 shadowing the locked 0.8.0: transformers' import-time check raised a 50-line
    ImportError advising `pip install transformers -U`; `dflash train` names the package and the fix
    in one line before anything imports transformers, and makes no run directory. The copy is on
    PYTHONPATH, so the fix removes it (no sync would); with it, a tokenizers package there that would
    import instead of the venv's."""
    site = tmp_path / "site"
    write_distribution(site, "safetensors", "0.7.0")
    (site / "tokenizers").mkdir()
    (site / "tokenizers" / "__init__.py").write_text("raise ImportError('a stale copy')\n")
    run_dir = tmp_path / "run"
    done = run_dflash(
        "train", "configs/tiny.toml", f"train.output_dir={run_dir}", env={"PYTHONPATH": str(site)}
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        f"dflash: error: safetensors 0.7.0 installed in {site}, uv.lock pins 0.8.0; fix: remove that "
        f"safetensors copy, {UNSET}; tokenizers imports from {site / 'tokenizers'}, not the venv's "
        f"site-packages ({', '.join(site_packages())}): that copy shadows the locked one; fix: remove "
        f"{site / 'tokenizers'}, {UNSET}"
    ], done.stderr
    assert not run_dir.exists()


def test_every_command_that_imports_the_stack_names_a_version_transformers_rejects_first(
    tmp_path: Path,
) -> None:
    """safetensors 0.7.0 on PYTHONPATH crashed config show, eval, export and build-cache with
    transformers' 53-59-line ImportError: each command that imports the stack says the one line first."""
    site = tmp_path / "site"
    write_distribution(site, "safetensors", "0.7.0")
    line = (
        f"dflash: error: safetensors 0.7.0 installed in {site}, uv.lock pins 0.8.0 (transformers requires "
        f"safetensors>=0.8.0: not even train.allow_environment_drift can run it); fix: remove that "
        f"safetensors copy, {UNSET}"
    )
    commands = [
        ["config", "show", "configs/tiny.toml"], ["eval", str(tmp_path / "run")],
        ["export", str(tmp_path / "run"), "--out", str(tmp_path / "out")], ["build-cache", "configs/tiny.toml"],
        ["bench", "drafter", "configs/tiny.toml"], ["datagen", "configs/tiny.toml"], ["demo"],
        ["prompts", "build", str(tmp_path / "prompts")],
    ]  # fmt: skip
    for command in commands:
        done = run_dflash(*command, env={"PYTHONPATH": str(site)})
        assert (done.returncode, done.stderr.splitlines()) == (2, [line]), (command, done.stderr)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["site"]


def test_an_allowed_drift_runs_off_lock_versions_but_not_one_an_installed_package_rejects(
    tmp_path: Path,
) -> None:
    """A copy inside the venv (`site` counts the directory as the venv's) is fixed by a sync."""
    accepted, rejected = tmp_path / "accepted", tmp_path / "rejected"
    write_distribution(accepted, "safetensors", "0.9.0")  # transformers asks for >= 0.8.0
    write_distribution(rejected, "safetensors", "0.7.0")
    venv = [str(accepted), str(rejected), *site_packages()]
    require_locked_stack(allow_drift=True, search_path=[str(accepted), *sys.path], site=venv)
    # a package outside the lock (an inference server's pins, say) is never imported by a run: its
    # requirements decide nothing
    server = accepted / "some_server-1.0.dist-info"
    server.mkdir()
    (server / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: some-server\nVersion: 1.0\nRequires-Dist: safetensors<0.9\n"
    )
    require_locked_stack(allow_drift=True, search_path=[str(accepted), *sys.path], site=venv)
    with pytest.raises(UserError) as refused:
        require_locked_stack(allow_drift=False, search_path=[str(accepted), *sys.path], site=venv)
    assert str(refused.value) == (  # a package the lock does not name is a problem too, unless allowed
        f"safetensors 0.9.0 installed, uv.lock pins 0.8.0; {SYNC}; 1 packages not in uv.lock: some-server 1.0; {SYNC}"
    )
    with pytest.raises(UserError) as refused:
        require_locked_stack(allow_drift=True, search_path=[str(rejected), *sys.path], site=venv)
    assert str(refused.value) == (
        "safetensors 0.7.0 installed, uv.lock pins 0.8.0 (transformers requires safetensors>=0.8.0: "
        f"not even train.allow_environment_drift can run it); {SYNC}"
    )
    require_locked_stack(allow_drift=False)  # this venv is the lock


def test_the_fingerprint_says_where_each_key_package_imports_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The venv's copies and PYTHONPATH are recorded; a copy elsewhere is a problem (and a breaking
    difference) whose fix names that copy, and a second dist-info's fix names the one outside the
    venv, not the venv's own, whichever comes first."""
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    fingerprint = collect_fingerprint()
    imports = fingerprint["imports"]
    assert imports["pythonpath"] == str(tmp_path) and imports["shadowed"] == []
    assert imports["origins"]["torch"] == str(Path(torch.__file__).resolve().parent)
    assert imports["origins"]["fla"] is None or imports["origins"]["fla"].startswith(
        imports["site_packages"][0]
    )
    stale = str(tmp_path / "torch")
    shadowed = {**imports, "origins": {**imports["origins"], "torch": stale}, "shadowed": ["torch"]}
    venv = imports["site_packages"][0]
    twice = {"name": "safetensors", "versions": ["0.8.0", "0.7.0"], "locations": [venv, str(tmp_path)]}
    drifted = {
        **fingerprint,
        "imports": shadowed,
        "packages": {**fingerprint["packages"], "duplicates": [twice]},
    }
    problems = [(f.message, f.fix) for f in assess(drifted) if f.level == "problem"]
    assert problems == [
        (f"safetensors installed 2 times: 0.8.0, 0.7.0 (in {venv}, {tmp_path})",
         f"remove the safetensors copies in {tmp_path}, {UNSET}"),
        (f"torch imports from {stale}, not the venv's site-packages ({', '.join(imports['site_packages'])}): "
         "that copy shadows the locked one", f"remove {stale}, {UNSET}"),
    ]  # fmt: skip
    changes = [
        (d.field, d.breaking)
        for d in diff_fingerprints(fingerprint, drifted)
        if d.field.startswith("imports")
    ]
    assert changes == [("imports.shadowed", True)]


def test_the_documented_doctor_shows_the_environment_as_it_was(tmp_path: Path) -> None:
    """`just doctor` and the docs run the doctor without uv's sync (which repaired an off-lock version
    first and then reported OK): the recipe's own command line, run with safetensors 0.7.0 on the
    path, reports it and exits 1."""
    recipe = re.search(r"^doctor \*args:\n((?:    .*\n)+)", (ROOT / "Justfile").read_text(), re.MULTILINE)
    assert recipe is not None
    assert recipe.group(1).strip() == "./uvw run --no-sync dflash doctor {{args}}"
    for doc in ("README.md", "docs/guide.md", "docs/containers.md"):
        assert "uvw run dflash doctor" not in (ROOT / doc).read_text(), doc
    site = tmp_path / "site"
    write_distribution(site, "safetensors", "0.7.0")
    command = recipe.group(1).strip().replace("{{args}}", "").split()
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(site), "COLUMNS": "400"},
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "problem: safetensors 0.7.0 installed, uv.lock pins 0.8.0\n" in done.stdout
    assert "verdict: NOT the locked training stack" in done.stdout


def test_a_file_edited_inside_an_installed_package_is_named_with_its_fix(tmp_path: Path) -> None:
    """A copy of the venv's safetensors (never the venv's own files) with one file patched in place
    (same size), one grown and one deleted: each is named against the wheel's RECORD, the doctor's
    fix reinstalls it past uv's hardlinked cache (or removes a copy outside the venv), it is a breaking
    difference, and dflash train's early check refuses it."""
    installed = metadata.distribution("safetensors")
    site = tmp_path / "site"
    for part in ("safetensors", f"safetensors-{installed.version}.dist-info"):
        shutil.copytree(installed.locate_file(part), site / part)
    patched = site / "safetensors" / "torch.py"
    patched.write_text(patched.read_text().replace("import torch", "import tarch", 1))
    with (site / "safetensors" / "numpy.py").open("a") as handle:
        handle.write("# patched\n")
    (site / "safetensors" / "flax.py").unlink()

    edited = edited_files([str(site)], packages=["safetensors"])
    assert [(e["file"], e["why"]) for e in edited] == [
        ("safetensors/flax.py", "missing"), ("safetensors/numpy.py", "size"), ("safetensors/torch.py", "content"),
    ]  # fmt: skip
    assert edited_files(packages=["safetensors"]) == []  # the venv's own copy is untouched
    in_venv = {"imports": {"site_packages": [str(site)]}, "installed_files": {"edited": edited}}
    (finding,) = edited_file_findings(in_venv)
    assert finding.message == (
        f"safetensors {installed.version} in {site}: 3 files differ from its wheel's RECORD (edited after "
        "install): safetensors/flax.py (missing), safetensors/numpy.py (size), safetensors/torch.py (content)"
    )
    assert finding.fix.startswith(
        "./uvw cache clean safetensors, then ./uvw sync --reinstall-package safetensors (uv hardlinks"
    )
    changes = diff_fingerprints({}, in_venv)
    assert [(d.field, d.breaking) for d in changes] == [("installed_files.edited", True)]
    # a recording from before the check is no difference from a clean start
    assert diff_fingerprints({}, {"installed_files": {"edited": []}, "imports": {"shadowed": []}}) == []
    with pytest.raises(UserError) as refused:
        require_locked_stack(allow_drift=False, search_path=[str(site), *sys.path])
    assert str(refused.value).endswith("safetensors/torch.py (content); fix: remove that safetensors copy")


def test_a_same_size_edit_of_a_source_triton_compiles_at_run_time_is_named(tmp_path: Path) -> None:
    """triton compiles `backends/nvidia/driver.c` at run time: a patch that keeps its size is an edit
    (sources compiled at run time are hashed, not compared by size)."""
    installed = metadata.distribution("triton")
    record = next(line for line in installed.read_text("RECORD").splitlines() if "nvidia/driver.c," in line)
    source = record.split(",")[0]
    site = tmp_path / "site"
    info = site / f"triton-{installed.version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: triton\nVersion: {installed.version}\n")
    (info / "RECORD").write_text(record + "\n")
    text = Path(str(installed.locate_file(source))).read_text()
    (site / source).parent.mkdir(parents=True)
    (site / source).write_text(text.replace("return NULL;", "return 0L  ;", 1))  # same size, another program
    assert len((site / source).read_bytes()) == len(text.encode())
    edited = edited_files([str(site)], packages=["triton"])
    assert [(e["file"], e["why"]) for e in edited] == [(source, "content")]


def test_a_startup_file_no_package_installed_or_one_edited_is_a_problem(tmp_path: Path) -> None:
    """A `.pth` in site-packages runs its `import` lines at every interpreter start. setuptools'
    own `distutils-precedence.pth` (copied with its RECORD into a temporary site) is known; a planted
    `hook.pth` is named with its removal, an edited copy of the known one with its reinstall; both are
    breaking differences, and dflash train's early check refuses them."""
    installed = metadata.distribution("setuptools")
    site = tmp_path / "site"
    site.mkdir()
    info = f"setuptools-{installed.version}.dist-info"
    shutil.copytree(installed.locate_file(info), site / info)
    known = site / "distutils-precedence.pth"
    shutil.copy(installed.locate_file("distutils-precedence.pth"), known)
    assert startup_files([str(site)], [str(site)]) == []
    (site / "hook.pth").write_text("import os; os.environ['TORCHINDUCTOR_FREEZING'] = '1'\n")
    known.write_text(known.read_text().replace("local", "LOCAL"))
    found = startup_files([str(site)], [str(site)])
    assert found == [
        {"file": str(known), "package": "setuptools", "why": "content"},
        {"file": str(site / "hook.pth"), "package": None, "why": "no package installed it"},
    ]
    fingerprint = {"installed_files": {"startup": found}}
    lines = [finding.line() for finding in startup_file_findings(fingerprint)]
    assert lines[1] == (
        f"{site / 'hook.pth'}: a startup file no installed package put there runs code at every interpreter "
        f"start; fix: remove it (rm {site / 'hook.pth'})"
    )
    assert lines[0].startswith(
        f"{known}: a startup file of setuptools differs from its wheel's RECORD (content); fix: ./uvw cache "
        "clean setuptools, then ./uvw sync --reinstall-package setuptools"
    )
    assert [(d.field, d.breaking) for d in diff_fingerprints({}, fingerprint)] == [
        ("installed_files.startup", True)
    ]
    with pytest.raises(UserError) as refused:
        require_locked_stack(allow_drift=False, search_path=[str(site), *sys.path], site=[str(site)])
    assert f"{site / 'hook.pth'}: a startup file no installed package put there" in str(refused.value)


@pytest.mark.parametrize("edit", ["hash", "version"])
def test_an_edited_lock_is_named_as_the_lock_with_how_to_restore_it(tmp_path: Path, edit: str) -> None:
    """A hash-only edit of uv.lock was refused only once torch had loaded; a changed version digit got
    `./uvw sync` as its fix, which cannot parse it. The stack check names the lock and its restore."""
    for name in ("pyproject.toml", "uv.lock"):
        shutil.copy(ROOT / name, tmp_path / name)
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "lock"], check=True)
    require_locked_stack(allow_drift=False, project_root=tmp_path)
    lock = (tmp_path / "uv.lock").read_text()
    if edit == "hash":
        digest = re.search(r'hash = "sha256:([0-9a-f]{64})"', lock).group(1)  # type: ignore[union-attr]
        edited = lock.replace(digest, digest[::-1], 1)
    else:
        edited = re.sub(r'(name = "safetensors"\nversion = ")(\d)', lambda m: m.group(1) + "9", lock, count=1)
    assert edited != lock
    (tmp_path / "uv.lock").write_text(edited)
    revision = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    with pytest.raises(UserError) as refused:
        require_locked_stack(allow_drift=False, project_root=tmp_path)
    assert str(refused.value) == (
        f"uv.lock differs from commit {revision[:12]} (edited): the lock no longer pins what the commit pins; "
        "fix: git checkout uv.lock, then ./uvw sync --locked (or commit the edit, if it is meant)"
    )
