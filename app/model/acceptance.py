"""Objectives on acceptance rather than likelihood, added to the block CE (`train.objective`).

The training data are the target's own greedy answers, so at every block slot the target's distribution
is the one-hot of the label, and what verification accepts depends only on the drafter's softmax
probability p_j of the label at slot j:

- "ce+tv": the total-variation distance of slot j's distribution to the target's, 1 - p_j, weighed and
  normalised like the CE (the decayed slot weights over their sum);
- "ce+acceptance": minus the expected accepted drafts of a chain round, per block sum_k P_k with
  P_k = p_1 ... p_k over the block's slots, cut at its first unsupervised slot (P_k = 0 from there),
  averaged over the blocks with a supervised first slot.
- "ce+tree": the same sum for a tree that keeps K candidates at each depth (K = `train.eval_tree_top_k`):
  slot j is covered with s_j = 1 - (1 - p_j)^K, the chance that the label is among K draws from the
  drafter's distribution there, and P_k = s_1 ... s_k. K = 1 is "ce+acceptance".

Both are functions of log p_j = -CE_j alone, and d(log p_j)/d(logits_j) = one_hot - softmax = -g_j,
where g_j is the unweighted gradient the CE chunk already writes. So an objective's gradient w.r.t. row
j's logits is c_j g_j with a scalar c_j = -dL/d(log p_j) computed from the detached p's, and, since row
scaling commutes with the LM head's matmul, the hidden gradient of row j is (w_j + lambda c_j)(g_j @ W):
the chunked loss (`app.model.objective.chunked_lm_head_ce`) makes no extra pass over the logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from app.errors import UserError

SlotTerms = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
]
"""`terms(p, weights, supervised, blocks) -> (L's part, c)` for whole blocks: the labels' probabilities,
the CE's normalised slot weights and the supervision `[a, B-1]` each, the acceptance normaliser (0-d);
L's part of these blocks (0-d) and c = -dL/d(log p) `[a, B-1]`."""


def tv_terms(
    p: torch.Tensor, weights: torch.Tensor, supervised: torch.Tensor, blocks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_j w_j (1 - p_j) and c_j = w_j p_j: the weights are the CE's, already over their sum, so the
    TV term has the CE's normaliser and an unsupervised slot (w = 0) carries nothing."""
    return (weights * (1 - p)).sum(), weights * p


def acceptance_terms(
    p: torch.Tensor, weights: torch.Tensor, supervised: torch.Tensor, blocks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """-sum_k P_k / blocks and c_j = sum_{k >= j} P_k / blocks (every P_k from slot j on has p_j as a
    factor). P_k is the chance that the first k drafts of a greedy chain round are all accepted if
    each slot were sampled from the drafter, so sum_k P_k is the round's expected accepted drafts;
    under DDTree the same product ranks the tree's paths. A draft past an unsupervised slot has no
    known target token: the product stops there."""
    return tree_terms(p, weights, supervised, blocks, top_k=1)


def tree_terms(
    p: torch.Tensor, weights: torch.Tensor, supervised: torch.Tensor, blocks: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`acceptance_terms` for a tree of `top_k` candidates per depth: P_k = s_1 ... s_k with the label's
    coverage s_j = 1 - (1 - p_j)^K, and c_j = sum_{k >= j} P_k / blocks x dlog s_j / dlog p_j, where
    dlog s / dlog p = K p (1 - p)^(K-1) / s (1 when K = 1). DDTree keeps each depth's top-K, not K
    draws; the draws make coverage smooth in p_j: a label already likely enough to be among the top-K
    (s near 1) gets little push, one at the edge of it the most, each weighted by the chance that the
    tree reaches its depth. Budget and ranking are the tree's own (`app.model.tree`)."""
    miss = (1 - p).clamp_min(0)
    coverage = 1 - miss**top_k
    elasticity = top_k * p * miss ** (top_k - 1) / coverage.clamp_min(torch.finfo(coverage.dtype).tiny)
    prefix = torch.cumprod(coverage * supervised, dim=1)
    tails = prefix.flip(1).cumsum(dim=1).flip(1)
    return -prefix.sum() / blocks, tails * elasticity / blocks


OBJECTIVE_TERMS: dict[str, Callable[[int], SlotTerms]] = {
    "ce+tv": lambda tree_top_k: tv_terms,
    "ce+acceptance": lambda tree_top_k: acceptance_terms,
    "ce+tree": lambda tree_top_k: partial(tree_terms, top_k=tree_top_k),
}
"""`train.objective` -> its terms, given the tree's candidates per depth (`train.eval_tree_top_k`, read
by "ce+tree" alone); "ce" has none (the CE alone, the chunk's fast path)."""


@dataclass(frozen=True)
class SlotObjective:
    """An objective on the labels' probabilities, added to the CE with weight `weight` (lambda), over one
    feature batch's blocks; the chunked loss asks it for each chunk of whole blocks."""

    terms: SlotTerms
    weight: float
    supervised: torch.Tensor
    """`[A, B-1]` bool: the batch's supervised slots (invalid anchors: none)."""
    blocks: torch.Tensor
    """0-d: blocks with a supervised first slot (at least 1), the acceptance objective's normaliser."""

    @classmethod
    def build(
        cls, objective: str, weight: float, supervised: torch.Tensor, *, tree_top_k: int
    ) -> SlotObjective | None:
        """`train.objective`'s objective over the batch's `supervised [A, B-1]` ("ce+tree": for a tree of
        `tree_top_k` candidates per depth); None for "ce", so the CE chunk runs as it always did (its
        weights, no per-row output)."""
        if objective == "ce":
            return None
        if objective not in OBJECTIVE_TERMS:
            choices = ", ".join(repr(name) for name in ["ce", *OBJECTIVE_TERMS][:-1])
            last = list(OBJECTIVE_TERMS)[-1]
            raise UserError(f"train.objective: must be one of {choices} or {last!r}, got {objective!r}")
        blocks = supervised[:, 0].sum().clamp_min(1).float()
        return cls(OBJECTIVE_TERMS[objective](tree_top_k), weight, supervised, blocks)

    def chunk(
        self, anchors: slice, row_ce: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(lambda L's part, lambda c `[a, B-1]`) of the blocks `anchors`, from their unweighted CE rows
        and normalised CE weights `[a, B-1]`."""
        value, c = self.terms(torch.exp(-row_ce), weights, self.supervised[anchors], self.blocks)
        return self.weight * value, self.weight * c
