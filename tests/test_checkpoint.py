"""Checkpoints: atomic, checksummed, keep-last-N, `latest` pointer, corrupt ones skipped, written in the
background from a host copy of the state."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.checkpoint.store import (
    CheckpointWarning,
    check_run_directory,
    check_training_signal,
    checkpoint_root,
    complete_checkpoints,
    load_latest_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from app.checkpoint.writer import CheckpointWriteError, CheckpointWriter, HostSnapshot, SavedCheckpoint
from app.errors import UserError
from tests.helpers import unwritable_directory

ROOT = Path(__file__).resolve().parents[1]


def save(run_dir: Path, step: int, keep_last: int = 3) -> Path:
    weights = {"fc.weight": torch.full((4, 4), float(step))}
    optimizer = {
        "state": {0: {"exp_avg": torch.ones(4) * step}},
        "param_groups": [{"lr": 0.1, "params": [0]}],
    }
    return save_checkpoint(
        run_dir, step, weights, optimizer, {"cpu": torch.get_rng_state()}, {"cursor": step}, keep_last
    )


def test_round_trip_and_latest_pointer(tmp_path: Path) -> None:
    save(tmp_path, 10)
    path = save(tmp_path, 20)
    assert (checkpoint_root(tmp_path) / "latest").read_text() == path.name
    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None and loaded.step == 20 and loaded.state["cursor"] == 20
    assert torch.equal(loaded.model_state["fc.weight"], torch.full((4, 4), 20.0))
    assert torch.equal(loaded.optimizer_state["state"][0]["exp_avg"], torch.ones(4) * 20)


def test_keep_last_prunes_only_after_the_new_one_is_complete(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4, 5):
        save(tmp_path, step, keep_last=2)
    assert [p.name for p in complete_checkpoints(checkpoint_root(tmp_path))] == [
        "step_00000004",
        "step_00000005",
    ]


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_corrupt_latest_falls_back_to_previous_with_warning(tmp_path: Path, damage: str) -> None:
    save(tmp_path, 1)
    broken = save(tmp_path, 2) / "model.safetensors"
    if damage == "truncate":
        os.truncate(broken, broken.stat().st_size // 2)
    elif damage == "flip":
        data = bytearray(broken.read_bytes())
        data[-1] ^= 0xFF
        broken.write_bytes(bytes(data))
    else:
        broken.unlink()
    with pytest.warns(
        CheckpointWarning,
        match=r"step_00000002: model\.safetensors (is truncated|fails its sha256|is missing)",
    ):
        loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None and loaded.step == 1


def test_failed_write_leaves_no_partial_checkpoint(tmp_path: Path) -> None:
    save(tmp_path, 1)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(tmp_path, 2, {"w": torch.ones(1)}, {"bad": Unpicklable()}, {}, {}, keep_last=3)
    root = checkpoint_root(tmp_path)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"]
    assert load_latest_checkpoint(tmp_path).step == 1


KILLED_MIDWAY = """
import os, signal, sys, torch
from app.checkpoint.store import save_checkpoint

class KilledMidway:  # pickled after model.safetensors is written: the process dies mid-checkpoint
    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGKILL)

save_checkpoint(sys.argv[1], 2, {"w": torch.ones(1)}, {"state": KilledMidway()}, {}, {}, keep_last=3)
"""


def test_a_write_killed_midway_leaves_the_previous_checkpoint_latest(tmp_path: Path) -> None:
    """SIGKILL in the middle of step 2's write: no step_00000002 exists (not even partial), step 1 stays
    latest and loads, and the next write clears what the killed writer left hidden."""
    save(tmp_path, 1)
    done = subprocess.run(
        [sys.executable, "-c", KILLED_MIDWAY, str(tmp_path)], cwd=ROOT, capture_output=True, timeout=120
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    root = checkpoint_root(tmp_path)
    assert not (root / "step_00000002").exists()
    assert (root / "latest").read_text() == "step_00000001"
    assert load_latest_checkpoint(tmp_path).step == 1
    assert any(path.name.startswith(".step_00000002.") for path in root.iterdir())  # its staging
    save(tmp_path, 3)
    assert sorted(path.name for path in root.iterdir()) == ["latest", "step_00000001", "step_00000003"]


def test_empty_run_dir_has_no_checkpoint(tmp_path: Path) -> None:
    assert load_latest_checkpoint(tmp_path) is None


def test_changed_training_signal_is_refused_naming_the_field(tmp_path: Path) -> None:
    saved = {"train.anchors": 512, "drafter.block_size": 16}
    check_training_signal(saved, dict(saved), tmp_path)
    with pytest.raises(UserError, match=r"training signal train\.anchors changed from 512 to 1024"):
        check_training_signal(saved, {**saved, "train.anchors": 1024}, tmp_path)


# ---- background writes (the trainer's path) ---------------------------------------------------------


def live_state(step: int) -> tuple[dict, dict, dict, dict]:
    weights = {"fc.weight": torch.full((256, 256), float(step))}
    optimizer = {
        "state": {0: {"exp_avg": torch.ones(256) * step}},
        "param_groups": [{"lr": 0.1, "params": [0]}],
    }
    return weights, optimizer, {"cpu": torch.get_rng_state()}, {"cursor": step}


def test_background_write_keeps_the_state_of_the_moment_of_saving(tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path, keep_last=3)
    weights, optimizer, rng, state = live_state(5)
    path = writer.save(5, weights, optimizer, rng, state)
    weights["fc.weight"].add_(100.0)  # the next optimizer step changes the live tensors at once
    optimizer["state"][0]["exp_avg"].mul_(-1.0)
    assert writer.completed(block=True) == [SavedCheckpoint(path, 5)]
    loaded = load_latest_checkpoint(tmp_path)
    assert loaded is not None and loaded.path == path and loaded.step == 5
    assert torch.equal(loaded.model_state["fc.weight"], torch.full((256, 256), 5.0))
    assert torch.equal(loaded.optimizer_state["state"][0]["exp_avg"], torch.ones(256) * 5)
    assert writer.completed(block=True) == []  # each completed checkpoint is reported once


def test_host_snapshot_reuses_its_buffers_and_holds_the_values_of_the_moment() -> None:
    snapshot = HostSnapshot()
    weights, optimizer, _, _ = live_state(1)
    first_weights, first_optimizer = snapshot.copy((weights, optimizer))
    weights["fc.weight"].add_(100.0)
    assert torch.equal(first_weights["fc.weight"], torch.full((256, 256), 1.0))
    assert first_optimizer["param_groups"] == optimizer["param_groups"]

    second_weights, second_optimizer = snapshot.copy(live_state(2)[:2])
    assert second_weights["fc.weight"] is first_weights["fc.weight"]  # same buffer, new values
    assert second_optimizer["state"][0]["exp_avg"] is first_optimizer["state"][0]["exp_avg"]
    assert torch.equal(second_optimizer["state"][0]["exp_avg"], torch.ones(256) * 2)

    resized = {"fc.weight": torch.ones(8, 8, dtype=torch.bfloat16)}
    (third_weights,) = snapshot.copy((resized,))
    assert third_weights["fc.weight"].dtype == torch.bfloat16 and torch.equal(
        third_weights["fc.weight"], resized["fc.weight"]
    )


def test_back_to_back_saves_are_written_in_order_and_pruned(tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path, keep_last=2)
    paths = [writer.save(step, *live_state(step)) for step in (1, 2, 3)]
    assert [saved.step for saved in writer.completed(block=True)] == [1, 2, 3]
    assert complete_checkpoints(checkpoint_root(tmp_path)) == paths[1:]
    assert (checkpoint_root(tmp_path) / "latest").read_text() == "step_00000003"


def test_a_failed_background_write_is_raised_at_the_next_look_and_leaves_nothing(tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path, keep_last=3)
    writer.save(1, *live_state(1))
    weights, optimizer, _, state = live_state(2)
    writer.save(2, weights, optimizer, {"cpu": lambda: None}, state)  # torch.save cannot pickle it
    with pytest.raises(
        CheckpointWriteError, match=r"checkpoint of step 2 in .*checkpoints could not be written"
    ):
        writer.completed(block=True)
    root = checkpoint_root(tmp_path)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"]  # no partial step_2
    assert (root / "latest").read_text() == "step_00000001"
    assert [saved.step for saved in writer.completed(block=True)] == [1]  # the earlier one still counts
    writer.save(3, *live_state(3))  # the writer carries on
    assert [saved.step for saved in writer.completed(block=True)] == [3]


def test_checkpoint_bench_compares_the_training_pause_both_ways(tiny_lm_dir, tmp_path: Path) -> None:
    from app.bench.checkpoint import format_report, run_checkpoint_bench
    from app.config import load_config

    config = load_config(Path(__file__).parents[1] / "configs" / "tiny.toml", ["train.device=cpu"])
    result = run_checkpoint_bench(config, tmp_path / "bench", repeats=1)
    # fp32 weights and two AdamW moments: more than 4 bytes per parameter
    assert result["parameters"] > 0 and result["checkpoint_bytes"] > 4 * result["parameters"]
    assert 0 < result["background_pause_s"] <= result["background_write_s"] and result["in_place_s"] > 0
    assert not (tmp_path / "bench" / "in_place").exists() and not (tmp_path / "bench" / "background").exists()
    report = format_report(result)
    assert "in place:   training waits" in report and "training pause: " in report


def test_checkpoints_are_ordered_by_step_not_by_name(tmp_path: Path) -> None:
    """Past 8 digits the names no longer sort like the steps: pruning and `latest` go by the number."""
    for step in (99_999_999, 100_000_000):
        save(tmp_path, step, keep_last=1)
    assert [p.name for p in complete_checkpoints(checkpoint_root(tmp_path))] == ["step_100000000"]
    assert load_latest_checkpoint(tmp_path).step == 100_000_000


def test_the_run_directory_is_created_and_proven_writable(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "new"
    check_run_directory(run_dir, resume=False)
    assert run_dir.is_dir() and list(run_dir.iterdir()) == []  # the probe is gone


def test_temp_files_a_killed_start_left_are_removed_at_the_next(tmp_path: Path) -> None:
    """A SIGKILL between a temp file's write and its rename leaves `.status.json.<random>.tmp`; the
    next start removes those of the run directory and of `checkpoints/`, and nothing else."""
    root = checkpoint_root(tmp_path)
    root.mkdir()
    killed = [
        tmp_path / ".status.json.k1ll3d_0.tmp",
        tmp_path / ".config.json.abcdefgh.tmp",
        root / ".latest.12345678.tmp",
    ]
    kept = [
        tmp_path / "notes.tmp",
        tmp_path / ".hidden",
        tmp_path / "status.json",
        tmp_path / ".status.json.tmp",
    ]
    for path in [*killed, *kept]:
        path.write_text("{")
    check_run_directory(tmp_path, resume=True)
    assert [path.exists() for path in killed + kept] == [False] * len(killed) + [True] * len(kept)


def test_a_resume_into_a_directory_that_does_not_exist_is_refused(tmp_path: Path) -> None:
    """Not a new run from step 0 that exits 0 as if it had resumed (the API's path; `dflash train`
    refuses before torch loads, tests/test_bad_inputs.py)."""
    with pytest.raises(UserError, match=r"^train.output_dir = .*/typo: does not exist, so there is no run"):
        check_run_directory(tmp_path / "typo", resume=True)
    assert not (tmp_path / "typo").exists()


@pytest.mark.parametrize("where", ["under a file", "a file"])
def test_an_output_dir_that_cannot_be_a_directory_is_refused_naming_the_setting(
    tmp_path: Path, where: str
) -> None:
    file = tmp_path / "notes.txt"
    file.write_text("keep me")
    run_dir = file / "run" if where == "under a file" else file
    blamed = re.escape(str(file)) if where == "under a file" else "it"
    with pytest.raises(
        UserError, match=rf"^train.output_dir = {re.escape(str(run_dir))}: {blamed} is a file"
    ):
        check_run_directory(run_dir, resume=False)
    assert file.read_text() == "keep me"


@pytest.mark.parametrize("where", ["a symlink loop", "under a dangling symlink"])
def test_an_output_dir_through_a_broken_symlink_is_refused_naming_it(tmp_path: Path, where: str) -> None:
    """mkdir's own words were "(File exists)"."""
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a" if where == "a symlink loop" else "gone")
    run_dir = tmp_path / "a" if where == "a symlink loop" else tmp_path / "b" / "run"
    broken, target = ("it", "b") if where == "a symlink loop" else (str(tmp_path / "b"), "gone")
    with pytest.raises(UserError) as refused:
        check_run_directory(run_dir, resume=False)
    assert str(refused.value) == (
        f"train.output_dir = {run_dir}: {broken} is a symlink to {target}, which does not resolve (a loop, "
        "or gone)"
    )


def test_a_read_only_output_dir_is_refused_naming_the_setting(tmp_path: Path) -> None:
    with unwritable_directory(tmp_path / "run") as run_dir:
        with pytest.raises(
            UserError, match=r"^train.output_dir = .*/run: cannot create or write files there \("
        ):
            check_run_directory(run_dir, resume=False)
        with pytest.raises(UserError, match=r"^train.output_dir = .*/run/sub: cannot create or write files"):
            check_run_directory(run_dir / "sub", resume=False)


FILE_SIZE_LIMITED = """
import json, resource, signal, sys, torch
from pathlib import Path
from app.checkpoint.writer import CheckpointWriter
from app.errors import UserError

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, not the process
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
writer = CheckpointWriter(Path(sys.argv[1]), keep_last=3)
small, big = torch.zeros(16), torch.zeros(1 << 15)  # 64 B, 128 KiB
for step, weights, moments in ((1, small, small), (2, big, small), (3, small, big)):
    writer.save(step, {"w": weights}, {"state": {0: {"exp_avg": moments}}, "param_groups": []}, {}, {})
    try:
        writer.completed(block=True)
    except UserError as error:
        print(json.dumps({"step": step, "error": str(error)}))
"""


def test_a_write_the_os_refuses_is_a_user_error_naming_the_checkpoint_kept(tmp_path: Path) -> None:
    """A real EFBIG (a file size limit), raised in safetensors (step 2's weights) and in torch.save
    (step 3's optimizer state): each is a UserError naming the OS error and the earlier checkpoint,
    and leaves no trace; step 1 stays complete and `latest`."""
    done = subprocess.run(
        [sys.executable, "-c", FILE_SIZE_LIMITED, str(tmp_path)], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    failures = [json.loads(line) for line in done.stdout.splitlines()]
    assert [failure["step"] for failure in failures] == [2, 3]
    for failure in failures:
        assert re.fullmatch(
            rf"checkpoint of step {failure['step']} in .*/checkpoints could not be written \(File too large\); "
            r"the previous checkpoint step_00000001 is kept: free space \(or raise the quota or file size "
            r"limit\), then continue with --resume",
            failure["error"],
        ), failure["error"]
    root = checkpoint_root(tmp_path)
    assert sorted(path.name for path in root.iterdir()) == ["latest", "step_00000001"]
    assert (root / "latest").read_text() == "step_00000001"
    assert verify_checkpoint(root / "step_00000001") is None


def test_a_resume_with_another_objective_is_refused_and_ce_runs_keep_their_signal(
    tmp_path: Path, tiny_tokenizer
) -> None:
    """The objective defines what the drafter learns; a CE run's signal is the one checkpoints from
    before the objectives saved (no objective field), so those still resume."""
    from app.config import validate_config
    from app.train.setup import training_signal

    def signal_of(**train) -> dict:
        raw = {
            "target": {"builtin": "tiny-lm"},
            "drafter": {"num_layers": 1, "block_size": 4, "mask_token_id": 3},
            "train": {"anchors": 8, **train},
        }
        return training_signal(validate_config(raw), [1], tiny_tokenizer)

    ce = signal_of()
    assert not any(key.startswith("train.objective") for key in ce)
    tv = signal_of(objective="ce+tv", objective_weight=0.5)
    check_training_signal(tv, signal_of(objective="ce+tv", objective_weight=0.5), tmp_path)
    with pytest.raises(UserError, match=r"training signal train\.objective changed from 'ce\+tv' to None"):
        check_training_signal(tv, ce, tmp_path)
    with pytest.raises(UserError, match=r"train\.objective_weight changed from 0\.5 to 2\.0"):
        check_training_signal(tv, signal_of(objective="ce+tv", objective_weight=2.0), tmp_path)
