"""The Python API (`app.api`), as a notebook uses it: a config from a mapping, train, evaluate, export."""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path

import pytest
import torch

from app import api
from app.export import load_exported, load_trained_drafter
from tests.helpers import ROOT, SMALL


def test_a_notebook_trains_evaluates_and_exports_the_tiny_config(
    tiny_lm_dir, tiny_conversations, tmp_path: Path
) -> None:
    raw = tomllib.loads((ROOT / "configs" / "tiny.toml").read_text())
    original = copy.deepcopy(raw)
    overrides = [*SMALL, f"data.train_files={tiny_conversations}", f"train.output_dir={tmp_path / 'run'}",
                 "train.max_steps=2"]  # fmt: skip
    config = api.load_config(raw, overrides)
    assert raw == original  # the caller's mapping is not changed by the overrides
    assert config == api.load_config(
        ROOT / "configs" / "tiny.toml", overrides
    )  # a mapping is a file's content

    lines: list[str] = []
    trained = api.train(config, log=lines.append)
    assert (trained.run_dir, trained.steps, trained.checkpoint.name) == (tmp_path / "run", 2, "step_00000002")
    assert any(" step=2/2 " in line for line in lines)

    evaluation = api.evaluate(trained.run_dir, prompts=2, max_new_tokens=8)
    assert (evaluation.step, evaluation.checkpoint, len(evaluation.result.per_prompt)) == (
        2,
        trained.checkpoint,
        2,
    )
    assert 1.0 <= evaluation.tau <= config.drafter.block_size
    assert evaluation.describe()[0] == f"eval: step 2 ({trained.checkpoint}) on cpu, 2 prompts"

    exported = api.export(trained.run_dir, tmp_path / "export", dtype="fp32")
    assert (exported.directory, exported.step, exported.block_size) == (tmp_path / "export", 2, 4)
    assert "--speculative-num-draft-tokens 4" in exported.serving[0]
    weights = load_trained_drafter(trained.run_dir).model_state
    for name, tensor in load_exported(exported.directory).state_dict().items():
        assert torch.equal(tensor, weights[name]), name


def test_bad_input_raises_the_commands_one_line_error() -> None:
    with pytest.raises(api.UserError, match=r"^<config mapping>: target: is required: set target\.path \("):
        api.load_config({"drafter": {"mask_token_id": 3}})
    several = api.load_config(ROOT / "configs" / "qwen3.6-27b.toml")
    with pytest.raises(api.UserError, match=r"^topology: 8 processes configured; they run under torchrun"):
        api.train(several)
