"""`dflash doctor`: the environment fingerprint, stray-package detection, the diff and its exit codes."""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import platform
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from app.cli import doctor_cmd
from app.env import (
    FINGERPRINT_FILENAME,
    assess,
    collect_fingerprint,
    diff_fingerprints,
    has_problems,
    load_fingerprint,
    save_fingerprint,
)
from app.env.fingerprint import bytecode_status, is_under_tmp, torch_rule_inductor_dir
from app.env.gpus import parse_nvidia_smi
from app.env.packages import installed_distributions, locked_versions, package_drift
from app.env.project import find_project_root
from app.errors import UserError
from tests.helpers import run_dflash

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "uv.lock"


@pytest.fixture(scope="module")
def fingerprint() -> dict:
    return collect_fingerprint()


def write_distribution(site: Path, name: str, version: str) -> None:
    """A real installed distribution as importlib.metadata finds it: `<name>-<version>.dist-info/METADATA`."""
    dist_info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


# --- the fingerprint -------------------------------------------------------------------------------


def test_fingerprint_records_the_stack(fingerprint: dict) -> None:
    import torch

    assert json.loads(json.dumps(fingerprint)) == fingerprint  # JSON-serialisable as is
    assert fingerprint["python"]["version"] == platform.python_version()
    assert fingerprint["torch"]["version"] == torch.__version__
    assert fingerprint["torch"]["cuda"] == torch.version.cuda
    assert fingerprint["transformers"] in locked_versions(LOCK)["transformers"]
    assert fingerprint["host"]["hostname"]
    assert fingerprint["created_at"].endswith("+00:00")
    assert fingerprint["lock"] == {
        "path": str(LOCK),
        "sha256": hashlib.sha256(LOCK.read_bytes()).hexdigest(),
        "error": None,
    }
    assert fingerprint["project"]["root"] == str(REPO)
    assert fingerprint["packages"]["checked"] is True
    assert fingerprint["packages"]["installed_count"] > 50
    assert set(fingerprint["fast_kernels"]) == {"fla", "causal_conv1d"}
    assert all(isinstance(status["present"], bool) for status in fingerprint["fast_kernels"].values())
    assert fingerprint["compile_cache"]["inductor_under_tmp"] == is_under_tmp(
        fingerprint["compile_cache"]["inductor_dir"]
    )


def test_no_gpu_is_reported_cleanly(fingerprint: dict) -> None:
    import torch

    gpus = fingerprint["gpus"]
    assert gpus["count"] == len(gpus["devices"])
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    assert gpus == {**gpus, "source": None, "count": 0, "devices": []}
    assert any(note.startswith("torch.cuda:") for note in gpus["notes"])
    infos = [finding.message for finding in assess(fingerprint) if finding.level == "info"]
    assert any(message.startswith("no GPU visible") for message in infos)
    report = io.StringIO()
    doctor_cmd._print_report(Console(file=report, width=200), fingerprint, assess(fingerprint))
    assert "none visible" in report.getvalue()
    assert "verdict:" in report.getvalue()


@pytest.mark.parametrize(
    ("fla", "causal_conv1d", "conv", "absent"),
    [
        # The default GPU image: flash-linear-attention only, its Triton conv stands in for causal-conv1d.
        (True, False, "flash-linear-attention (Triton)", []),
        (True, True, "causal-conv1d (CUDA)", []),
        (False, False, None, ["fla", "causal_conv1d"]),
    ],
)
def test_doctor_names_the_causal_conv_a_hybrid_target_runs_on(
    fingerprint: dict, fla: bool, causal_conv1d: bool, conv: str | None, absent: list[str]
) -> None:
    kernels = {
        "fla": {"present": fla, "version": "0.6.0" if fla else None, "error": None},
        "causal_conv1d": {
            "present": causal_conv1d,
            "version": "1.7.0" if causal_conv1d else None,
            "error": None,
        },
    }
    from app.env.health import CONV_KERNELS
    from app.model.causal_conv import fast_causal_conv

    # The doctor's restatement (it must not import app.model) chooses as the model code does.
    chosen = fast_causal_conv({"fla": fla, "causal_conv1d": causal_conv1d}, cuda=True)
    assert chosen == conv and (conv is None or conv in CONV_KERNELS.values())
    infos = [f.message for f in assess({**fingerprint, "fast_kernels": kernels}) if f.level == "info"]
    named = [message for message in infos if message.startswith("hybrid targets' causal conv on CUDA: ")]
    assert named == ([f"hybrid targets' causal conv on CUDA: {conv}"] if conv else [])
    assert [m.split(" ")[0] for m in infos if "absent" in m] == absent


def test_inductor_default_matches_torch() -> None:
    import importlib.util

    import torch

    # torch's own function, loaded from its file: importing the torch._inductor package costs seconds
    source = Path(torch.__file__).parent / "_inductor" / "runtime" / "cache_dir_utils.py"
    spec = importlib.util.spec_from_file_location("torch_cache_dir_utils", source)
    assert spec is not None and spec.loader is not None
    torch_rule = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(torch_rule)
    assert torch_rule_inductor_dir() == torch_rule.default_cache_dir()


def test_a_cache_variable_under_tmp_is_a_warning_and_torchs_default_is_none(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert is_under_tmp("/tmp/torchinductor_root")
    assert is_under_tmp("/tmp")
    assert not is_under_tmp("/var/cache/dflash")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_root")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/var/cache/dflash/triton")
    found = collect_fingerprint(search_path=[str(tmp_path)])
    assert found["compile_cache"]["inductor_dir_from"] == "TORCHINDUCTOR_CACHE_DIR"
    assert found["compile_cache"]["triton_under_tmp"] is False
    warnings = [finding.message for finding in assess(found) if finding.level == "warning"]
    assert (
        "TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor_root is under /tmp: training refuses it unless "
        "compile.inductor_dir is set"
    ) in warnings
    # torch's own default under /tmp is not what training uses (a per-key dir under the cache root)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    found = collect_fingerprint(search_path=[str(tmp_path)])
    assert (
        found["compile_cache"]["inductor_under_tmp"]
        and found["compile_cache"]["inductor_dir_from"] == "torch default"
    )
    assert not [finding for finding in assess(found) if "under /tmp" in finding.message]


def test_source_without_bytecode_that_none_can_be_written_for_is_a_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Every process then compiles torch's source again at import (13 s of a profiled start on the
    GPU machine): bytecode on disk, or an import allowed to write it, is enough."""
    source = tmp_path / "module.py"
    source.write_text("VALUE = 1\n")
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert bytecode_status(source) == {"cached": False, "writes": False}
    found = collect_fingerprint(search_path=[str(tmp_path)])
    found["python"]["torch_bytecode"] = bytecode_status(source)
    (warning,) = [f for f in assess(found) if "no Python bytecode" in f.message]
    assert warning.level == "warning" and warning.fix.startswith("./uvw sync --compile-bytecode")

    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    assert bytecode_status(source) == {"cached": False, "writes": True}  # the first import writes it
    py_compile.compile(str(source))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert bytecode_status(source) == {"cached": True, "writes": False}
    found["python"]["torch_bytecode"] = bytecode_status(source)
    assert not [f for f in assess(found) if "no Python bytecode" in f.message]


def test_missing_lock_is_reported_not_raised(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "dflash-appliance"\n')
    found = collect_fingerprint(search_path=[str(tmp_path)], project_root=tmp_path)
    assert found["lock"]["sha256"] is None
    assert "uv.lock missing" in found["lock"]["error"]
    assert found["packages"]["checked"] is False
    assert has_problems(found)


def test_project_root_skips_other_projects(tmp_path: Path) -> None:
    ours, nested = tmp_path / "ours", tmp_path / "ours" / "vendor" / "other"
    nested.mkdir(parents=True)
    (ours / "pyproject.toml").write_text('[project]\nname = "dflash-appliance"\n')
    (nested / "pyproject.toml").write_text('[project]\nname = "someone-else"\n')
    assert find_project_root([nested / "src"]) == ours
    assert find_project_root([tmp_path]) is None


def test_nvidia_smi_rows_are_parsed() -> None:
    # the exact line nvidia-smi printed on the H200 machine for this query
    rows = parse_nvidia_smi("NVIDIA H200, 9.0, 143771, 580.159.04\nNVIDIA H200, 9.0, 143771, 580.159.04\n")
    assert rows == 2 * [
        {
            "name": "NVIDIA H200",
            "compute_capability": "9.0",
            "memory_mib": 143771,
            "driver_version": "580.159.04",
        }
    ]


# --- stray and off-lock packages -----------------------------------------------------------------


def test_stray_and_mismatched_distributions_are_flagged(tmp_path: Path) -> None:
    site = tmp_path / "site-packages"
    write_distribution(site, "sglang", "0.5.3")
    write_distribution(site, "flashinfer-python", "0.4.1")
    write_distribution(site, "my_debug_tool", "1.0")
    write_distribution(site, "torch", "2.11.0+cu130")  # the incident's swapped-in build
    write_distribution(site, "numpy", "2.4.6")  # one of the two versions the lock pins (per Python)
    tqdm_version = sorted(locked_versions(LOCK)["tqdm"])[0]
    write_distribution(site, "tqdm", tqdm_version)

    drift = package_drift(locked_versions(LOCK), installed_distributions([str(site)]))

    assert drift["installed_count"] == 6
    stray = {entry["name"]: (entry["version"], entry["inference_stack"]) for entry in drift["stray"]}
    assert stray == {
        "sglang": ("0.5.3", True),
        "flashinfer-python": ("0.4.1", True),
        "my-debug-tool": ("1.0", False),
    }
    assert [(entry["name"], entry["installed"], entry["locked"]) for entry in drift["mismatched"]] == [
        ("torch", "2.11.0+cu130", ["2.10.0"])
    ]
    assert drift["duplicates"] == []


def test_local_build_label_and_duplicates_count(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    write_distribution(first, "torch", "2.10.0")
    write_distribution(second, "torch", "2.10.0+cu130")
    drift = package_drift(locked_versions(LOCK), installed_distributions([str(first), str(second)]))
    assert [entry["installed"] for entry in drift["mismatched"]] == ["2.10.0+cu130"]
    assert drift["duplicates"][0]["name"] == "torch"
    assert drift["duplicates"][0]["versions"] == ["2.10.0", "2.10.0+cu130"]


def test_fingerprint_and_findings_name_the_inference_stack(tmp_path: Path) -> None:
    write_distribution(tmp_path, "sglang", "0.5.3")
    write_distribution(tmp_path, "torch", "2.11.0+cu130")
    found = collect_fingerprint(search_path=[str(tmp_path)])
    problems = [finding.message for finding in assess(found) if finding.level == "problem"]
    assert any(
        message.startswith("inference-stack packages in the training environment: sglang 0.5.3")
        for message in problems
    )
    assert "torch 2.11.0+cu130 installed, uv.lock pins 2.10.0" in problems


def test_bad_lock_file_is_a_user_error(tmp_path: Path) -> None:
    (tmp_path / "uv.lock").write_text("version = 1\n[[package]\n")
    with pytest.raises(UserError, match=r"uv\.lock: not a valid TOML lock file"):
        locked_versions(tmp_path / "uv.lock")
    with pytest.raises(UserError, match="cannot read the lock file"):
        locked_versions(tmp_path / "absent.lock")


# --- the diff ------------------------------------------------------------------------------------

H200 = {
    "name": "NVIDIA H200",
    "compute_capability": "9.0",
    "memory_mib": 143771,
    "driver_version": "580.159.04",
}


def _with(fingerprint: dict, **paths: object) -> dict:
    changed = copy.deepcopy(fingerprint)
    for dotted, value in paths.items():
        *parents, leaf = dotted.split("__")
        section = changed
        for key in parents:
            section = section[key]
        section[leaf] = value
    return changed


@pytest.mark.parametrize(
    ("change", "field", "breaking"),
    [
        ({"torch__version": "2.11.0+cu130"}, "torch.version", True),
        ({"torch__cuda": "13.0"}, "torch.cuda", True),
        ({"triton": "3.5.1"}, "triton", True),
        ({"transformers": "5.17.0"}, "transformers", True),
        ({"lock__sha256": "0" * 64}, "lock.sha256", True),
        ({"python__version": "3.12.3"}, "python.version", True),
        ({"python__version": "3.11.99"}, "python.version", False),
        ({"fast_kernels__fla__present": True}, "fast_kernels.fla.present", True),
        ({"host__hostname": "ct200"}, "host.hostname", False),
        ({"created_at": "2020-01-01T00:00:00+00:00"}, "created_at", False),
        ({"project__revision": "f" * 40}, "project.revision", False),
        ({"compile_cache__inductor_dir": "/var/cache/inductor"}, "compile_cache.inductor_dir", False),
    ],
)
def test_each_difference_is_classified(fingerprint: dict, change: dict, field: str, breaking: bool) -> None:
    differences = diff_fingerprints(fingerprint, _with(fingerprint, **change))
    assert [(difference.field, difference.breaking) for difference in differences] == [(field, breaking)]


def test_gpu_model_is_breaking_but_count_driver_and_memory_are_cosmetic(fingerprint: dict) -> None:
    one_h200 = _with(fingerprint, gpus__devices=[H200], gpus__count=1)
    two_h200 = _with(
        fingerprint,
        gpus__devices=[H200, {**H200, "driver_version": "590.1", "memory_mib": 140000}],
        gpus__count=2,
    )
    other_model = _with(fingerprint, gpus__devices=[{**H200, "name": "NVIDIA H100 80GB HBM3"}], gpus__count=1)

    same_model = {
        difference.field: difference.breaking for difference in diff_fingerprints(one_h200, two_h200)
    }
    assert same_model == {"gpus.count": False, "gpus.driver_version": False, "gpus.memory_mib": False}
    new_model = diff_fingerprints(one_h200, other_model)
    assert [(difference.field, difference.breaking) for difference in new_model] == [("gpus.models", True)]
    assert new_model[0].old == ["NVIDIA H200 (sm 9.0)"]


def test_package_changes_are_breaking(fingerprint: dict) -> None:
    sglang = {"name": "sglang", "version": "0.5.3", "inference_stack": True, "location": "/venv"}
    torch_off_lock = {"name": "torch", "installed": "2.11.0", "locked": ["2.10.0"], "location": "/venv"}
    polluted = _with(fingerprint, packages__stray=[sglang], packages__mismatched=[torch_off_lock])
    differences = diff_fingerprints(fingerprint, polluted)
    assert [(d.field, d.old, d.new, d.breaking) for d in differences] == [
        ("packages.stray.sglang", None, "0.5.3", True),
        ("packages.mismatched.torch", None, "2.11.0", True),
    ]
    assert differences[0].to_dict()["why"] == "installed but not in uv.lock"


def test_identical_fingerprints_have_no_differences(fingerprint: dict) -> None:
    assert diff_fingerprints(fingerprint, copy.deepcopy(fingerprint)) == []


# --- recorded fingerprints -----------------------------------------------------------------------


def test_save_is_atomic_and_a_run_directory_round_trips(fingerprint: dict, tmp_path: Path) -> None:
    written = save_fingerprint(fingerprint, tmp_path)
    assert written == tmp_path / FINGERPRINT_FILENAME
    assert os.listdir(tmp_path) == [FINGERPRINT_FILENAME]  # no temp file left behind
    assert load_fingerprint(tmp_path) == fingerprint
    assert load_fingerprint(written) == fingerprint


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        ("{not json", "not valid JSON (line 1"),
        ("[1, 2]", "expected a JSON object"),
        (
            '{"schema": 1, "torch": {}}',
            "not a dflash environment fingerprint (missing python, gpus, lock, packages)",
        ),
    ],
)
def test_bad_fingerprint_files_are_one_line_user_errors(
    tmp_path: Path, content: str | None, message: str
) -> None:
    path = tmp_path / "fp.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UserError) as raised:
        load_fingerprint(path)
    assert message in str(raised.value)
    assert "\n" not in str(raised.value)


def test_run_directory_without_fingerprint_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=f"run directory {tmp_path} has no fingerprint.json"):
        load_fingerprint(tmp_path)


def test_newer_schema_is_refused(fingerprint: dict, tmp_path: Path) -> None:
    path = save_fingerprint({**fingerprint, "schema": 2}, tmp_path / "fp.json")
    with pytest.raises(UserError, match="fingerprint schema 2, expected 1"):
        load_fingerprint(path)


# --- the command, as a user runs it --------------------------------------------------------------


def test_cli_json_save_then_against_itself(tmp_path: Path) -> None:
    saved = tmp_path / "run"
    saved.mkdir()
    done = run_dflash("doctor", "--json", "--save", str(saved))
    printed = json.loads(done.stdout)
    assert done.returncode == (1 if has_problems(printed) else 0), done.stderr
    assert load_fingerprint(saved) == printed

    same = run_dflash("doctor", "--against", str(saved))
    assert same.returncode == 0, same.stdout + same.stderr
    assert "verdict: same training stack" in same.stdout


def test_cli_against_a_different_stack_exits_1(fingerprint: dict, tmp_path: Path) -> None:
    recorded = _with(fingerprint, torch__version="2.11.0+cu130", host__hostname="ct200")
    save_fingerprint(recorded, tmp_path / "old.json")
    changed = run_dflash("doctor", "--json", "--against", str(tmp_path / "old.json"))
    assert changed.returncode == 1, changed.stderr
    report = json.loads(changed.stdout)
    assert report["breaking"] is True
    by_field = {difference["field"]: difference for difference in report["differences"]}
    assert by_field["torch.version"]["old"] == "2.11.0+cu130"
    assert by_field["torch.version"]["breaking"] is True
    assert by_field["host.hostname"]["breaking"] is False


def test_cli_bad_fingerprint_exits_2_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "corrupt.json").write_text("{")
    for target in (tmp_path / "corrupt.json", tmp_path / "missing.json"):
        done = run_dflash("doctor", "--against", str(target))
        assert done.returncode == 2
        assert done.stdout == ""
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"dflash: error: {target}"), done.stderr


def test_loading_the_doctor_does_not_import_torch() -> None:
    probe = "import sys, app.cli.doctor_cmd, app.env; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr


def test_a_kernel_package_that_sets_torchs_cache_variable_on_import_leaves_the_environment_as_it_was(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    import torch

    # A stand-in `fla` doing what flash-linear-attention's import does: asking torch for its inductor
    # cache dir (torch's own function, from its file), which writes torch's /tmp default into the
    # environment when the variable is unset.
    source = Path(torch.__file__).parent / "_inductor" / "runtime" / "cache_dir_utils.py"
    package = tmp_path / "site" / "fla"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('fla_torch_cache_dir_utils', {str(source)!r})\n"
        "rule = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(rule)\n"
        "rule.cache_dir()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert "fla" not in sys.modules
    request.addfinalizer(lambda: sys.modules.pop("fla", None))  # later tests must not find the stand-in
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("DFLASH_PROBE_KEPT", "yes")

    found = collect_fingerprint(search_path=[str(tmp_path)])

    assert found["fast_kernels"]["fla"]["present"] is True  # the stand-in was imported
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    assert os.environ["DFLASH_PROBE_KEPT"] == "yes"
    assert found["compile_cache"]["inductor_dir_from"] == "torch default"
    warnings = [finding.message for finding in assess(found) if finding.level == "warning"]
    assert not [message for message in warnings if message.startswith("TORCHINDUCTOR_CACHE_DIR")]
