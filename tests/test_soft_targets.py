"""`train.soft_targets`: each slot's label mixes in the target's own next-token distribution."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from app.config import validate_config
from app.config.load import ConfigError
from app.data.batch import DrafterRow, FeatureBatch
from app.model.objective import SoftLabels, chunked_lm_head_ce, soft_ce_chunk, weighted_ce_chunk
from app.model.target import load_target
from app.pipeline.features import eager_forward
from app.train.trainer import Trainer
from tests.helpers import random_target_config, small_drafter_raw_config

VOCAB, HIDDEN = 11, 6


def brute_force_loss(logits, labels, weights, target_logits, mix) -> torch.Tensor:
    """The definition, written out: -sum_v y_v log q_v per row, y = (1 - mix) one-hot + mix p."""
    total = torch.zeros(())
    for row in range(logits.shape[0]):
        log_q = logits[row] - torch.logsumexp(logits[row], dim=0)
        p = torch.exp(target_logits[row] - torch.logsumexp(target_logits[row], dim=0))
        y = [mix * p[v] + (1 - mix) * (v == labels[row]) for v in range(logits.shape[1])]
        total = total - weights[row] * sum(y[v] * log_q[v] for v in range(logits.shape[1]))
    return total


@pytest.mark.parametrize("mix", [0.0, 0.3, 1.0])
def test_a_chunk_s_loss_and_gradient_are_the_definition_s(mix: float) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, VOCAB, generator=generator, dtype=torch.float64) * 3
    target_logits = torch.randn(5, VOCAB, generator=generator, dtype=torch.float64) * 3
    labels = torch.tensor([0, 3, 10, 3, 7])
    weights = torch.tensor([1.0, 0.5, 0.0, 2.0, 1.0], dtype=torch.float64)
    loss, grad, predictions = soft_ce_chunk(logits, labels, weights, target_logits, mix)
    leaf = logits.clone().requires_grad_()
    expected = brute_force_loss(leaf, labels, weights, target_logits, mix)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert torch.allclose(grad.double(), leaf.grad, atol=1e-6)
    assert predictions.tolist() == logits.argmax(-1).tolist()
    if mix == 0.0:  # hard labels: exactly the plain weighted CE
        hard_loss, hard_grad, _ = weighted_ce_chunk(logits, labels, weights)
        assert loss.item() == pytest.approx(hard_loss.item(), rel=1e-6)  # the CE computes in fp32
        assert torch.allclose(grad, hard_grad.double(), atol=1e-6)


def test_the_chunked_loss_with_soft_labels_equals_the_whole_logits_at_any_chunk_size() -> None:
    generator = torch.Generator().manual_seed(1)
    head = nn.Linear(HIDDEN, VOCAB, bias=False).double().requires_grad_(False)
    hidden = torch.randn(4, 3, HIDDEN, generator=generator, dtype=torch.float64)
    target_hidden = torch.randn(4, 3, HIDDEN, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (4, 3), generator=generator)
    weights = torch.rand(4, 3, generator=generator, dtype=torch.float64)
    leaf = hidden.clone().requires_grad_()
    expected = brute_force_loss(
        head(leaf).reshape(-1, VOCAB), labels.reshape(-1), weights.reshape(-1),
        head(target_hidden).reshape(-1, VOCAB), 0.4,
    )  # fmt: skip
    expected.backward()
    for chunk in (1, 3, 4):
        mine = hidden.clone().requires_grad_()
        loss, _ = chunked_lm_head_ce(mine, head, labels, weights, chunk, soft=SoftLabels(target_hidden, 0.4))
        loss.backward()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-6), chunk  # a chunk computes in fp32
        assert torch.allclose(mine.grad, leaf.grad, atol=1e-6), chunk


def test_slot_k_reads_the_target_s_state_one_position_before_its_token() -> None:
    """The target's distribution for the token at row index a + k comes from its hidden state at
    a + k - 1: slot 1 of anchor a reads the anchor's own position."""
    length, block = 12, 4
    target_hidden = torch.arange(length, dtype=torch.float32)[:, None].expand(length, 2).clone()
    row = DrafterRow(
        input_ids=torch.zeros(length, dtype=torch.int64), position_ids=torch.arange(length),
        document_ids=torch.zeros(length, dtype=torch.int32), loss_mask=torch.ones(length, dtype=torch.bool),
        anchor_positions=torch.tensor([0, 5, 10]), anchor_valid=torch.ones(3, dtype=torch.bool),
    )  # fmt: skip
    batch = FeatureBatch(row=row, features=torch.zeros(length, 4), target_hidden=target_hidden)
    soft = SoftLabels.of(batch, block, 0.5)
    assert soft.hidden[..., 0].tolist() == [
        [0, 1, 2],
        [5, 6, 7],
        [10, 11, 11],
    ]  # past the row: clamped, unsupervised
    with pytest.raises(ValueError, match="carries no target final hidden states"):
        SoftLabels.of(FeatureBatch(row=row, features=torch.zeros(length, 4)), block, 0.5)


def test_the_target_s_final_hidden_states_follow_its_features() -> None:
    config = validate_config(small_drafter_raw_config())
    target = load_target(config, "cpu")
    input_ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    features = target.features(input_ids)
    both = target.features(input_ids, final_hidden=True)
    width = features.shape[-1]
    assert both.shape[-1] == width + target.hidden_size and torch.equal(both[..., :width], features)
    logits = target.model(input_ids=input_ids).logits
    assert torch.allclose(target.lm_head(both[..., width:]), logits, atol=1e-5)


@pytest.mark.parametrize(
    ("section", "values"),
    [
        ("train", {"soft_targets": 0.5, "objective": "ce+tv"}),
        ("topology", {"target_ranks": 1, "nproc_per_node": 2}),
    ],
)
def test_soft_targets_are_refused_where_they_cannot_apply(section: str, values: dict) -> None:
    raw = small_drafter_raw_config()
    raw["train"]["soft_targets"] = 0.5
    raw.setdefault(section, {}).update(values)
    with pytest.raises(
        ConfigError, match=r"train\.soft_targets: needs train\.objective = 'ce' and a colocated"
    ):
        validate_config(raw)


def test_a_run_with_soft_targets_trains_on_the_target_s_distribution(
    tiny_tokenizer_dir, tiny_conversations, tmp_path: Path
) -> None:
    losses = {}
    for mix in (0.0, 1.0):
        config = random_target_config(
            tiny_tokenizer_dir, tiny_conversations, tmp_path / f"run{mix}", max_steps=2, soft_targets=mix
        )
        losses[mix] = Trainer(config, log=lambda line: None).run().losses
    assert all(math.isfinite(loss) for loss in losses[1.0])
    # the same batches and initial drafter, other labels: the first step's loss differs
    assert losses[1.0][0] != pytest.approx(losses[0.0][0], rel=1e-3)


def test_a_target_forward_without_final_hidden_states_stops_a_soft_targets_run(
    tiny_tokenizer_dir, tiny_conversations, tmp_path: Path
) -> None:
    """The forward the source is given from outside (on a GPU, the target's CUDA graphs) must carry the
    final hidden states the soft labels need: caught at the first batch, by its shape, not deep in the loss."""
    config = random_target_config(
        tiny_tokenizer_dir, tiny_conversations, tmp_path / "run", max_steps=2, soft_targets=0.5
    )
    trainer = Trainer(config, log=lambda line: None)
    trainer.compile_report.target_forward = eager_forward(trainer.target, final_hidden=False)
    with pytest.raises(
        RuntimeError, match=r"without its final hidden states, which train\.soft_targets needs"
    ):
        trainer.run()
