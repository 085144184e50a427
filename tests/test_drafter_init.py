"""`drafter.init = "target"`: the drafter's layers start as the target's last decoder layers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.config import validate_config
from app.config.load import ConfigError
from app.errors import UserError
from app.model.drafter import DFlashDrafter, DrafterArch
from app.model.drafter_init import init_from_target
from app.model.target import load_target
from app.train.trainer import Trainer
from tests.helpers import SMALL_TARGET_LAYERS, random_target_config, small_drafter_raw_config


def small_pair(**drafter) -> tuple[DFlashDrafter, object]:
    config = validate_config(small_drafter_raw_config(**drafter))
    target = load_target(config, "cpu")
    return DFlashDrafter(DrafterArch.from_config(config, target), seed=0, device="cpu"), target


def test_each_drafter_layer_takes_the_target_layer_counted_from_the_top() -> None:
    drafter, target = small_pair(num_layers=2)
    fc_before = drafter.fc.weight.clone()
    line = init_from_target(drafter, target)
    layers = target.model.get_decoder().layers
    for index, layer in enumerate(drafter.layers):
        theirs = dict(layers[SMALL_TARGET_LAYERS - 2 + index].named_parameters())
        for name, parameter in layer.named_parameters():
            assert torch.equal(parameter, theirs[name]), (index, name)
    # Qwen3's q/k norms included: every tensor of both layers has its counterpart
    assert len(dict(drafter.layers[0].named_parameters())) == len(dict(layers[0].named_parameters()))
    assert torch.equal(drafter.norm.weight, target.model.get_decoder().norm.weight)
    assert torch.equal(drafter.fc.weight, fc_before)  # no counterpart: random as before
    last = SMALL_TARGET_LAYERS - 1
    assert line.startswith(f"drafter init: {2 * 11 + 1} tensors from the target's layers {last - 1}-{last}")


def test_a_drafter_layout_other_than_the_target_s_is_refused_naming_the_tensor() -> None:
    drafter, target = small_pair(num_layers=1, intermediate_size=64)
    last = SMALL_TARGET_LAYERS - 1
    expected = rf"drafter layer 0's mlp\.gate_proj\.weight is \(64, 64\), target layer {last}'s is \(96, 64\)"
    with pytest.raises(UserError, match=expected):
        init_from_target(drafter, target)


def test_a_split_topology_cannot_init_from_the_target() -> None:
    raw = small_drafter_raw_config(init="target")
    raw["topology"] = {"target_ranks": 1, "drafter_ranks": 1, "nproc_per_node": 2}
    with pytest.raises(ConfigError, match=r"drafter\.init: 'target' copies the target's layers"):
        validate_config(raw)


def test_a_run_with_init_target_starts_from_the_target_s_layers(
    tiny_tokenizer_dir, tiny_conversations, tmp_path: Path
) -> None:
    config = random_target_config(tiny_tokenizer_dir, tiny_conversations, tmp_path / "run", max_steps=1)
    config.drafter.init = "target"
    lines: list[str] = []
    trainer = Trainer(config, log=lines.append)
    top = trainer.target.model.get_decoder().layers[-1]
    assert torch.equal(trainer.drafter.layers[-1].mlp.down_proj.weight, top.mlp.down_proj.weight)
    assert any(line.startswith("drafter init: ") for line in lines)
