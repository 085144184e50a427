"""What a resume checks before it loads a checkpoint (app/train/resume.py), called directly: each
refusal is the whole line a user reads, each allowed change the one note it logs. The trainer's resume
tests (tests/test_trainer.py) run the same checks end to end, minutes of CPU; these take milliseconds."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from app.checkpoint.store import MANIFEST, Checkpoint, checkpoint_root
from app.config import load_config
from app.config.schema import TrainConfig
from app.errors import UserError
from app.train.resume import check_resumable, precheck_resume, refuse_if_all_damaged
from app.train.schedule import schedule_settings

SIGNAL = {"train.anchors": 64, "drafter.block_size": 8}
PLAN = "plan-1"


def train_config(**fields: Any) -> TrainConfig:
    return TrainConfig(**({"lr": 1e-3} | fields))


def checkpoint(tmp_path: Path, **state: Any) -> Checkpoint:
    saved = {
        "signal": SIGNAL,
        "plan": PLAN,
        "batches_per_step": 2,
        "schedule": schedule_settings(100, train_config()),
        "total_steps": 100,
        "step": 10,
    }
    return Checkpoint(tmp_path / "step_00000010", {}, {}, {}, saved | state)


def check(saved: Checkpoint, *, batches_per_step: int = 2, total_steps: int = 100, **train: Any) -> list[str]:
    """The notes a resume logs; raises its refusal."""
    notes: list[str] = []
    check_resumable(
        saved,
        signal=dict(SIGNAL),
        plan=PLAN,
        total_steps=total_steps,
        batches_per_step=batches_per_step,
        train=train_config(**train),
        log=notes.append,
    )
    return notes


def test_an_unchanged_run_resumes_without_a_word(tmp_path: Path) -> None:
    assert check(checkpoint(tmp_path)) == []


def test_a_changed_signal_or_batch_plan_is_refused_naming_the_checkpoint(tmp_path: Path) -> None:
    saved = checkpoint(tmp_path, signal={**SIGNAL, "train.anchors": 32})
    with pytest.raises(UserError) as refused:
        check(saved)
    assert str(refused.value) == (
        f"{saved.path}: cannot resume: training signal train.anchors changed from 32 to 64; start a new "
        "run (new train.output_dir) or restore the old value"
    )
    saved = checkpoint(tmp_path, plan="plan-0")
    with pytest.raises(UserError) as refused:
        check(saved)
    assert str(refused.value) == (
        f"{saved.path}: cannot resume: the training data or batching settings changed (batch plan plan-0 "
        f"!= {PLAN}), so the saved data position means nothing in the new plan; resume with the run's "
        "data and data.* settings, or start a new run"
    )


def test_a_changed_global_batch_names_the_grad_accum_that_keeps_it(tmp_path: Path) -> None:
    saved = checkpoint(tmp_path, batches_per_step=4)
    with pytest.raises(UserError) as refused:
        check(saved, batches_per_step=2, grad_accum=1)  # two drafter ranks, one batch each
    assert str(refused.value) == (
        f"{saved.path}: cannot resume: the checkpoint trained 4 batches per step (drafter ranks x "
        "train.grad_accum), this run 2: the global batch would change; set train.grad_accum=2 to keep "
        "it, or set train.reschedule=true to train with the new one from this step on"
    )
    with pytest.raises(UserError, match=r"set train\.grad_accum=1 to keep it"):
        check(checkpoint(tmp_path, batches_per_step=2), batches_per_step=4, grad_accum=2)  # 2 ranks x 2
    with pytest.raises(UserError, match=r"this run 2: .*; use a number of drafter ranks that divides 3 and"):
        check(checkpoint(tmp_path, batches_per_step=3), batches_per_step=2, grad_accum=1)
    assert check(saved, batches_per_step=2, reschedule=True) == [
        "note: train.reschedule: the checkpoint trained 4 batches per step (drafter ranks x "
        "train.grad_accum), this run 2; the data continues at the saved position"
    ]


def test_a_checkpoint_from_before_the_global_batch_was_recorded_trained_one_batch_per_step(
    tmp_path: Path,
) -> None:
    old = checkpoint(tmp_path)
    del old.state["batches_per_step"]
    assert check(old, batches_per_step=1) == []
    with pytest.raises(UserError, match="trained 1 batches per step"):
        check(old, batches_per_step=2)


def test_a_changed_schedule_is_refused_or_followed_on_purpose(tmp_path: Path) -> None:
    saved = checkpoint(tmp_path)
    with pytest.raises(UserError) as refused:
        check(saved, total_steps=120)
    assert str(refused.value) == (
        f"{saved.path}: cannot resume: the learning-rate schedule would change (total_steps 100 -> 120; "
        "total_steps follows train.epochs, train.max_steps, train.grad_accum and the drafter ranks); "
        "resume with the run's settings, or set train.reschedule=true to follow the new schedule from "
        "this step on"
    )
    with pytest.raises(
        UserError, match=re.escape("would change (total_steps 100 -> 120; lr 0.001 -> 0.002;")
    ):
        check(saved, total_steps=120, lr=2e-3)
    assert check(saved, total_steps=120, lr=2e-3, reschedule=True) == [
        "note: train.reschedule: the learning rate follows the new schedule (total_steps 100 -> 120; "
        "lr 0.001 -> 0.002)"
    ]


def test_a_checkpoint_from_before_the_full_schedule_record_compares_its_total_steps(tmp_path: Path) -> None:
    old = checkpoint(tmp_path)
    del old.state["schedule"]
    assert check(old, lr=5e-3) == []  # only total_steps was recorded then
    with pytest.raises(UserError, match=re.escape("(total_steps 100 -> 90;")):
        check(old, total_steps=90)


def write_checkpoint(run_dir: Path, step: int, files: dict[str, bytes], state: dict[str, Any]) -> Path:
    path = checkpoint_root(run_dir) / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / "state.json").write_text(json.dumps(state))
    listed = {**files, "state.json": (path / "state.json").read_bytes()}
    for name, data in files.items():
        (path / name).write_bytes(data)
    manifest = {name: {"sha256": "0" * 64, "bytes": len(data)} for name, data in listed.items()}
    (path / MANIFEST).write_text(json.dumps({"step": step, "files": manifest}))
    return path


def test_only_a_run_whose_every_checkpoint_is_damaged_is_refused(tmp_path: Path) -> None:
    refuse_if_all_damaged(tmp_path)  # a run that never wrote one starts over
    write_checkpoint(tmp_path, 1, {}, {})
    write_checkpoint(tmp_path, 2, {}, {})
    (checkpoint_root(tmp_path) / "step_00000003").mkdir()  # no manifest: never complete
    with pytest.raises(UserError) as refused:
        refuse_if_all_damaged(tmp_path)
    assert str(refused.value) == (
        f"{checkpoint_root(tmp_path)}: cannot resume: every checkpoint fails verification (step_00000001, "
        "step_00000002; the warnings above say why); restore one, or start a new run with another "
        "train.output_dir"
    )


@pytest.fixture(scope="module")
def tiny_run() -> Any:
    return load_config("configs/tiny.toml", [])


def run_in(config: Any, output_dir: Path) -> Any:
    return config.model_copy(
        update={"train": config.train.model_copy(update={"output_dir": str(output_dir)})}
    )


def current_signal(config: Any) -> dict[str, Any]:
    from app.model.loading import load_tokenizer
    from app.model.target import resolve_layer_ids, target_text_config
    from app.train.setup import training_signal

    layers = target_text_config(config.target).num_hidden_layers
    return training_signal(config, resolve_layer_ids(config.drafter, layers), load_tokenizer(config))


def test_precheck_reads_the_signal_of_the_checkpoint_a_resume_starts_from(
    tmp_path: Path, tiny_run: Any, tiny_lm_dir: Path
) -> None:
    """The one `latest` names while it is intact, else the newest intact one."""
    config = run_in(tiny_run, tmp_path)
    signal = current_signal(config)
    precheck_resume(config)  # no checkpoint: nothing to refuse
    weights = {"model.safetensors": b"weights"}
    write_checkpoint(tmp_path, 1, weights, {"signal": signal})
    changed = write_checkpoint(tmp_path, 2, weights, {"signal": {**signal, "drafter.num_layers": 9}})
    write_checkpoint(tmp_path, 3, weights, {"signal": signal})
    newest = write_checkpoint(tmp_path, 4, weights, {"signal": {}})
    (newest / "model.safetensors").write_bytes(b"cut")  # truncated: a resume starts from step 3
    precheck_resume(config)
    (checkpoint_root(tmp_path) / "latest").write_text("step_00000002\n")  # the run went back to step 2
    with pytest.raises(UserError) as refused:
        precheck_resume(config)
    assert str(refused.value).startswith(
        f"{changed}: cannot resume: training signal drafter.num_layers changed from 9 to "
    )
    other = tmp_path / "other"  # the newest damaged, the one intact before it changed
    config = run_in(config, other)
    write_checkpoint(other, 1, weights, {"signal": {**signal, "drafter.num_layers": 9}})
    write_checkpoint(other, 2, weights, {"signal": signal})
    (checkpoint_root(other) / "step_00000002" / "model.safetensors").unlink()
    with pytest.raises(UserError, match=r"step_00000001: cannot resume: training signal drafter\.num_layers"):
        precheck_resume(config)


def test_precheck_refuses_when_every_checkpoint_fails_naming_each_reason(
    tmp_path: Path, tiny_run: Any, tiny_lm_dir: Path
) -> None:
    config = run_in(tiny_run, tmp_path)
    first = write_checkpoint(tmp_path, 1, {"model.safetensors": b"weights"}, {})
    (first / "model.safetensors").unlink()
    second = write_checkpoint(tmp_path, 2, {"model.safetensors": b"weights"}, {})
    (second / "model.safetensors").write_bytes(b"cut")
    with pytest.raises(UserError) as refused:
        precheck_resume(config)
    assert str(refused.value) == (
        f"{checkpoint_root(tmp_path)}: cannot resume: every checkpoint fails verification (step_00000001: "
        "model.safetensors is missing; step_00000002: model.safetensors is truncated (3 of 7 bytes)); "
        "restore one, or start a new run with another train.output_dir"
    )
    (second / "model.safetensors").write_bytes(b"weights")  # intact again, but no signal saved
    precheck_resume(config)
