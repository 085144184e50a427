"""`train.objective = "ce+tree"`: the expected accepted depth of a tree that keeps K candidates per
depth, against a brute-force enumeration of those candidates on a small vocabulary."""

from __future__ import annotations

import itertools

import pytest
import torch

from app.model.acceptance import SlotObjective, acceptance_terms, tree_terms

VOCAB, DEPTHS = 3, 3
SUPERVISED = torch.tensor([[1, 1, 1], [1, 0, 1], [0, 1, 1], [1, 1, 0]], dtype=torch.bool)
"""Four blocks: whole, a gap after the first slot, an unsupervised first slot, an unsupervised end."""


def expected_accepted_depth(distributions: torch.Tensor, labels: list[int], supervised, top_k: int):
    """One block by enumeration: every way K candidates can be drawn at each depth from the drafter's
    `distributions [D, V]` (the joint of all depths' draws, one entry each), the depths reached (each
    depth's label among its candidates, stopping at the first unsupervised slot), weighted by the
    draws' probability. Differentiable in `distributions`."""
    draws = torch.tensor(list(itertools.product(range(VOCAB), repeat=top_k)))  # [T, K]
    chances = [distributions[depth][draws].prod(-1) for depth in range(DEPTHS)]  # [T] per depth
    hits = [(draws == labels[depth]).any(-1) & bool(supervised[depth]) for depth in range(DEPTHS)]
    joint, reached = torch.ones(()), torch.zeros((), dtype=torch.int64)
    alive = torch.ones((), dtype=torch.bool)
    for depth in range(DEPTHS):  # axis `depth` of the joint holds that depth's draw
        shape = [1] * DEPTHS
        shape[depth] = -1
        joint = joint * chances[depth].reshape(shape)
        alive = alive & hits[depth].reshape(shape)
        reached = reached + alive
    return (joint * reached).sum()


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_the_tree_term_is_the_enumerated_expected_depth_and_its_scale_the_gradient(top_k: int) -> None:
    """L = -mean over blocks with a supervised first slot of the expected accepted depth, and
    c = -dL/dlog p(label): both against autograd through the enumeration."""
    generator = torch.Generator().manual_seed(top_k)
    logits = torch.randn(len(SUPERVISED), DEPTHS, VOCAB, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (len(SUPERVISED), DEPTHS), generator=generator)
    log_q = torch.log_softmax(logits, dim=-1).requires_grad_()
    blocks = SUPERVISED[:, 0].sum().double()
    expected = (
        -sum(
            expected_accepted_depth(log_q[b].exp(), labels[b].tolist(), SUPERVISED[b].tolist(), top_k)
            for b in range(len(SUPERVISED))
        )
        / blocks
    )
    log_p = log_q.gather(-1, labels[..., None]).squeeze(-1)
    value, scale = tree_terms(log_p.detach().exp(), torch.zeros(0), SUPERVISED, blocks, top_k=top_k)
    torch.testing.assert_close(value, expected.detach())
    # along log p(label) with the other tokens scaled to keep the sum at 1 (d log q_v = -p / (1 - p)
    # d log p for each of them), the enumeration's derivative is -c
    (gradient,) = torch.autograd.grad(expected, log_q)
    p = log_p.detach().exp()
    label_part = gradient.gather(-1, labels[..., None]).squeeze(-1)
    along_log_p = label_part - (gradient.sum(-1) - label_part) * p / (1 - p)
    torch.testing.assert_close(scale, -along_log_p)


def test_one_candidate_per_depth_is_the_chain_acceptance_term() -> None:
    p = torch.tensor([[0.9, 0.5, 0.2], [0.3, 0.7, 0.6], [0.6, 0.4, 0.1], [0.05, 0.99, 0.5]])
    blocks = SUPERVISED[:, 0].sum().float()
    chain, tree = acceptance_terms(p, p, SUPERVISED, blocks), tree_terms(p, p, SUPERVISED, blocks, top_k=1)
    for got, want in zip(tree, chain, strict=True):
        torch.testing.assert_close(got, want)


def test_more_candidates_cover_more_and_push_less_on_likely_labels() -> None:
    """A wider tree reaches deeper on the same drafter, and a label already likely enough to be among
    the candidates gets less of the gradient than a rarer one (relative to the chain's)."""
    p = torch.tensor([[0.6, 0.1]])
    whole = torch.ones(1, 2, dtype=torch.bool)
    one = torch.ones(())
    values = {k: tree_terms(p, p, whole, one, top_k=k) for k in (1, 4)}
    assert values[4][0] < values[1][0]  # minus the expected depth: lower is deeper
    ratio = values[4][1] / values[1][1]
    assert ratio[0, 0] < ratio[0, 1]


def test_the_objective_builds_with_the_tree_s_candidates_per_depth() -> None:
    p = torch.tensor([[0.5, 0.5, 0.5]])
    whole = torch.ones(1, 3, dtype=torch.bool)
    objective = SlotObjective.build("ce+tree", 0.5, whole, tree_top_k=2)
    assert objective is not None
    value, _ = objective.chunk(slice(0, 1), -p.log(), torch.ones(1, 3))
    coverage = 1 - 0.5**2
    torch.testing.assert_close(value, torch.tensor(-0.5 * (coverage + coverage**2 + coverage**3)))


def test_the_chain_objective_averages_over_the_blocks_whose_first_slot_is_supervised() -> None:
    """A block whose first slot has no label contributes no accepted draft, and is not counted either:
    the normaliser is the blocks a round could start in, read from the first slot alone."""
    supervised = torch.tensor([[True, False, False], [True, False, False], [False, True, True]])
    objective = SlotObjective.build("ce+acceptance", 1.0, supervised, tree_top_k=1)
    assert objective is not None
    p = torch.full((3, 3), 0.5)
    value, c = objective.chunk(slice(0, 3), -p.log(), torch.ones(3, 3))
    # two blocks with P_1 = 0.5 and nothing after their unsupervised second slot; the third never starts
    torch.testing.assert_close(value, torch.tensor(-(0.5 + 0.5) / 2))
    torch.testing.assert_close(c[:, 0], torch.tensor([0.25, 0.25, 0.0]))
