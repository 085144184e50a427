"""Bad inputs through the `dflash` command as a user types them, each in its own interpreter: exit 2,
one line on standard error naming the file, field, variable or record and what was expected, no
traceback, nothing left behind, and (for these) refused before torch loads, in about half a second.

Bad inputs found only once the data or the target load are tested beside the code that finds them."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import ROOT, unwritable_directory

TORCH_MARKER = "(torch loaded: {})"
DRIVER = (
    "import atexit, sys\n"
    f"atexit.register(lambda: print({TORCH_MARKER!r}.format('torch' in sys.modules), file=sys.stderr))\n"
    "sys.argv = ['dflash', *sys.argv[1:]]\n"
    "from app.cli import main\n"
    "main()\n"
)
"""`python -m app` that says on exit whether torch was imported."""


def non_utf8_config(tmp: Path) -> tuple[list[str], dict[str, str], str]:
    (tmp / "bad.toml").write_bytes(b"# \xff\n[train]\nlr = 1\n")
    return (
        ["config", "show", str(tmp / "bad.toml")],
        {},
        f"{tmp / 'bad.toml'}: not UTF-8 text: byte b'\\xff' at line 1, column 3 (invalid start byte); "
        "save the file as UTF-8",
    )


def directory_as_config(tmp: Path) -> tuple[list[str], dict[str, str], str]:
    return (
        ["train", str(tmp), f"train.output_dir={tmp / 'run'}"],
        {},
        f"{tmp}: a directory without config.json, so not a run directory; expected a .toml, .yaml, .yml "
        "or .json config file, or a run directory",
    )


def unclosed_list_override(tmp: Path) -> tuple[list[str], dict[str, str], str]:
    override = "data.train_files=[unclosed"
    return (
        ["train", "configs/tiny.toml", override, f"train.output_dir={tmp / 'run'}"],
        {},
        f"override {override!r}: data.train_files: a list with unbalanced brackets; expected [a, b] or a,b",
    )


def torchrun_variable(tmp: Path) -> tuple[list[str], dict[str, str], str]:
    return (
        ["train", "configs/tiny.toml", f"train.output_dir={tmp / 'run'}"],
        {"WORLD_SIZE": "abc"},
        "WORLD_SIZE=abc: expected an integer >= 1 (torchrun sets it in each process it starts; outside "
        "torchrun, unset WORLD_SIZE)",
    )


def cache_under_a_file(tmp: Path) -> tuple[list[str], dict[str, str], str]:
    (tmp / "file").write_text("")
    return (
        ["train", "configs/tiny.toml", f"train.output_dir={tmp / 'run'}"],
        {"DFLASH_CACHE": str(tmp / "file" / "cache")},
        f"DFLASH_CACHE={tmp / 'file' / 'cache'}: {tmp / 'file'} is a file, not a directory; point "
        "DFLASH_CACHE at a directory",
    )


def resume_of_no_run(tmp: Path) -> tuple[list[str], dict[str, str], str]:
    return (
        ["train", "configs/tiny.toml", f"train.output_dir={tmp / 'mistyped'}", "--resume"],
        {},
        f"train.output_dir = {tmp / 'mistyped'}: does not exist, so there is no run to resume there; check "
        "the path, or drop --resume to start a new run",
    )


def blocks_longer_than_samples(tmp: Path) -> tuple[list[str], dict[str, str], str]:
    return (
        ["train", "configs/tiny.toml", "drafter.block_size=300", f"train.output_dir={tmp / 'run'}"],
        {},
        "configs/tiny.toml: drafter.block_size: a training sample needs 2 x block_size = 600 supervised "
        "tokens, more than data.max_length (512) holds; got block_size 300",
    )


def resume_on_changed_data(tmp: Path) -> tuple[list[str], dict[str, str], str]:
    """A run directory whose recorded data identity no longer matches its data file."""
    from app.config import load_config
    from app.data.identity import DataIdentity, current_identity, record_data_identity

    data, run_dir = tmp / "data.jsonl", tmp / "run"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    config = load_config("configs/tiny.toml", [f"data.train_files=['{data}']", f"train.output_dir={run_dir}"])
    run_dir.mkdir()
    record_data_identity(run_dir, DataIdentity(current_identity(config), None), resume=False, log=print)
    data.write_text('{"messages": [{"role": "user", "content": "ho"}]}\n')
    return (
        [
            "train",
            "configs/tiny.toml",
            f"data.train_files=['{data}']",
            f"train.output_dir={run_dir}",
            "--resume",
        ],
        {},
        f"{run_dir}: cannot resume: the data differs from the run's last start ({data} changed); resume with "
        "the original data, or set train.allow_data_change=true to continue on the changed data (recorded in "
        "data_identity.json)",
    )


def degrading_compiler_variable(tmp: Path) -> tuple[list[str], dict[str, str], str]:
    return (
        ["train", "configs/tiny.toml", f"train.output_dir={tmp / 'run'}"],
        {"TORCHDYNAMO_DISABLE": "1"},
        "TORCHDYNAMO_DISABLE=1: torch.compile is disabled: every kernel runs eager; fix: unset TORCHDYNAMO_DISABLE",
    )


def rank_outside_torchrun(tmp: Path) -> tuple[list[str], dict[str, str], str]:
    return (
        ["train", "configs/tiny.toml", f"train.output_dir={tmp / 'run'}"],
        {"RANK": "0", "WORLD_SIZE": "2"},
        "RANK=0 WORLD_SIZE=2: set outside torchrun (a leftover export?) for a config that lays out 1 process; "
        "unset RANK WORLD_SIZE",
    )


def output_dir_under_a_symlink_loop(tmp: Path) -> tuple[list[str], dict[str, str], str]:
    (tmp / "loop").symlink_to(tmp / "loop")
    return (
        ["train", "configs/tiny.toml", f"train.output_dir={tmp / 'loop' / 'run'}"],
        {},
        f"train.output_dir = {tmp / 'loop' / 'run'}: {tmp / 'loop'} is a symlink to {tmp / 'loop'}, which "
        "does not resolve (a loop, or gone)",
    )


def blank_training_data(tmp: Path) -> tuple[list[str], dict[str, str], str]:
    (tmp / "blank.jsonl").write_text("  \n\n\t\n")
    return (
        [
            "train",
            "configs/tiny.toml",
            f"data.train_files=['{tmp / 'blank.jsonl'}']",
            f"train.output_dir={tmp / 'run'}",
        ],
        {},
        f"data.train_files: {tmp / 'blank.jsonl'}: blank (only whitespace), so there is nothing to train on; "
        "point data.train_files at the regenerated data",
    )


def missing_training_data(tmp: Path) -> tuple[list[str], dict[str, str], str]:
    return (
        [
            "train",
            "configs/tiny.toml",
            f"data.train_files=['{tmp / 'gone.jsonl'}']",
            f"train.output_dir={tmp / 'run'}",
        ],
        {},
        f"data file not found: {tmp / 'gone.jsonl'}",
    )


def fresh_run_into_a_foreign_directory(tmp: Path) -> tuple[list[str], dict[str, str], str]:
    (tmp / "mine").mkdir()
    (tmp / "mine" / "notes.md").write_text("mine\n")
    (tmp / "mine" / "train.log").write_text("")  # what `> DIR/train.log` makes first: no reason to refuse
    return (
        ["train", "configs/tiny.toml", f"train.output_dir={tmp / 'mine'}"],
        {},
        f"train.output_dir = {tmp / 'mine'}: holds notes.md, which are not a run's; a new run would mix its "
        "files with them: choose a new or empty directory",
    )


CASES: list[Callable[[Path], tuple[list[str], dict[str, str], str]]] = [
    non_utf8_config,
    directory_as_config,
    unclosed_list_override,
    torchrun_variable,
    cache_under_a_file,
    resume_of_no_run,
    blocks_longer_than_samples,
    resume_on_changed_data,
    degrading_compiler_variable,
    rank_outside_torchrun,
    output_dir_under_a_symlink_loop,
    blank_training_data,
    missing_training_data,
    fresh_run_into_a_foreign_directory,
]


@pytest.mark.parametrize("case", CASES, ids=[case.__name__ for case in CASES])
def test_a_bad_input_is_one_line_exit_2_before_torch_loads(
    tmp_path: Path, case: Callable[[Path], tuple[list[str], dict[str, str], str]]
) -> None:
    refused_before_torch(tmp_path, *case(tmp_path))


def test_a_read_only_output_directory_is_refused_before_torch_loads(tmp_path: Path) -> None:
    why = "Operation not permitted" if os.geteuid() == 0 else "Permission denied"  # root: chattr +i
    with unwritable_directory(tmp_path / "read-only") as read_only:
        refused_before_torch(
            tmp_path,
            ["train", "configs/tiny.toml", f"train.output_dir={read_only / 'run'}"],
            {},
            f"train.output_dir = {read_only / 'run'}: cannot create or write files there ({why})",
        )


def test_an_unwritable_cache_is_refused_before_torch_loads(tmp_path: Path) -> None:
    why = "Operation not permitted" if os.geteuid() == 0 else "Permission denied"
    run = f"train.output_dir={tmp_path / 'run'}"
    with unwritable_directory(tmp_path / "read-only") as read_only:
        cache = read_only / "cache"
        refused_before_torch(
            tmp_path,
            ["train", "configs/tiny.toml", run],
            {"DFLASH_CACHE": str(cache)},
            f"DFLASH_CACHE={cache}: cannot create or write {cache} ({why}); point DFLASH_CACHE at a "
            "writable directory",
        )
        refused_before_torch(
            tmp_path,
            ["train", "configs/tiny.toml", run, f"data.cache_dir={read_only / 'tokenized'}"],
            {},
            f"data.cache_dir = {read_only / 'tokenized'}: cannot create or write files there ({why})",
        )


def refused_before_torch(tmp_path: Path, args: list[str], env: dict[str, str], message: str) -> None:
    """`dflash ARGS` with `env` added exits 2 with `message` as its one line, before torch loads,
    writing nothing under `tmp_path`."""
    before = sorted(tmp_path.rglob("*"))
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, **env},
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines() == [f"dflash: error: {message}", TORCH_MARKER.format(False)]
    assert sorted(tmp_path.rglob("*")) == before  # nothing written, not even the run directory
