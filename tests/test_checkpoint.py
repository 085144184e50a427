"""Checkpoints: atomic, checksummed, keep-last-N, `latest` pointer, corrupt ones skipped."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from app.checkpoint.store import (
    CheckpointWarning,
    check_training_signal,
    checkpoint_root,
    complete_checkpoints,
    load_latest_checkpoint,
    save_checkpoint,
)
from app.errors import UserError


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


def test_empty_run_dir_has_no_checkpoint(tmp_path: Path) -> None:
    assert load_latest_checkpoint(tmp_path) is None


def test_changed_training_signal_is_refused_naming_the_field(tmp_path: Path) -> None:
    saved = {"train.anchors": 512, "drafter.block_size": 16}
    check_training_signal(saved, dict(saved), tmp_path)
    with pytest.raises(UserError, match=r"training signal train\.anchors changed from 512 to 1024"):
        check_training_signal(saved, {**saved, "train.anchors": 1024}, tmp_path)
