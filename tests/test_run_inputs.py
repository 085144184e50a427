"""One `load_run_inputs` (app/pipeline/inputs.py) sets up what both training roles and `dflash eval` start from."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import app.pipeline.inputs as inputs_module
from app.model.target import TargetModel
from app.pipeline.inputs import load_run_inputs
from tests.helpers import random_target_config

ROOT = Path(__file__).resolve().parents[1]
USERS = ["app/train/trainer.py", "app/train/ranks.py", "app/evaluate/trained.py"]
# What only load_run_inputs calls: a second call site is a second way of setting up a run's inputs.
LOADERS = {"load_tokenizer", "pick_device", "load_training_data", "load_tokenized"}


def called_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            function = node.func
            names.add(function.id if isinstance(function, ast.Name) else getattr(function, "attr", ""))
    return names


@pytest.mark.parametrize("user", USERS)
def test_both_roles_and_eval_set_up_their_inputs_through_load_run_inputs(user: str) -> None:
    called = called_names(ROOT / user)
    assert "load_run_inputs" in called
    assert called & LOADERS == set()


def test_nothing_else_in_train_or_evaluate_loads_a_run_s_inputs() -> None:
    paths = [*(ROOT / "app" / "train").glob("*.py"), *(ROOT / "app" / "evaluate").glob("*.py")]
    paths.append(ROOT / "app" / "pipeline" / "target_worker.py")
    # the resume precheck reads the tokenizer alone, to refuse a changed signal before the inputs load
    paths.remove(ROOT / "app" / "train" / "resume.py")
    assert {str(path.relative_to(ROOT)): sorted(called_names(path) & LOADERS) for path in paths} == {
        str(path.relative_to(ROOT)): [] for path in paths
    }
    assert "load_target" not in called_names(ROOT / "app" / "pipeline" / "target_worker.py")


def test_a_run_s_inputs(tiny_tokenizer_dir: Path, tiny_conversations: Path, tmp_path: Path) -> None:
    config = random_target_config(tiny_tokenizer_dir, tiny_conversations, tmp_path / "run")
    inputs = load_run_inputs(config)
    assert inputs.device.type == "cpu" and inputs.accepted == []
    assert isinstance(inputs.target, TargetModel)
    assert inputs.train_data is not None and inputs.eval_data is not None
    assert len(inputs.eval_data) == config.data.eval_holdout

    split_drafter = load_run_inputs(config, with_target=False)
    assert split_drafter.target is None and split_drafter.train_data is not None
    assert len(split_drafter.train_data) == len(inputs.train_data)

    held_out = load_run_inputs(config, data="eval", with_target=False)
    assert held_out.train_data is None and held_out.eval_data is not None
    assert held_out.eval_data.lengths.tolist() == inputs.eval_data.lengths.tolist()  # the same records
    assert load_run_inputs(config, data="none", with_target=False).eval_data is None


def test_eval_data_from_eval_files_does_not_tokenize_the_training_files(
    tiny_tokenizer_dir: Path, tiny_conversations: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = random_target_config(tiny_tokenizer_dir, tiny_conversations, tmp_path / "run")
    config = config.model_copy(
        update={"data": config.data.model_copy(update={"eval_files": [str(tiny_conversations)]})}
    )

    def refused(*args: object) -> None:
        raise AssertionError("the training files were tokenized for eval data alone")

    monkeypatch.setattr(inputs_module, "load_training_data", refused)
    inputs = load_run_inputs(config, data="eval", with_target=False)
    assert inputs.train_data is None and inputs.eval_data is not None and len(inputs.eval_data) > 0
