"""The DDTree draft tree: from the drafter's per-depth distributions of one block, the best-first tree
of at most `budget` nodes that tree verification checks (docs/architecture.md, Eval).

The depths of a block are drafted in parallel, so they are independent. From the top-K tokens of each
depth the tree grows best first, scored by the sum of its path's per-depth log-probabilities: the first
candidate is (depth 1, rank 0); popping (depth d, rank r) under some parent offers its sibling
(d, r + 1) under the same parent and its child (d + 1, rank 0). Ranks are sorted, so every offer
scores no higher than what offered it, and the nodes taken form a tree: the `budget` best paths of
the product of the per-depth top-K lists that are closed under prefixes. Greedy verification of the
tree accepts the longest prefix of the target's greedy continuation that is a path of it
(`DraftTree.accepted`): eval measures tree tau with it, training its streak proxy.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from app.errors import UserError


@dataclass(frozen=True)
class DraftTree:
    """The nodes of one round's tree, in the order they were taken (best first). Node i holds
    `tokens[i]` at depth `depths[i]` (1 = right after the root), under node `parents[i]` (-1: the root,
    the round's last accepted token)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]

    def walk(self, next_token: Callable[[int, int], int | None]) -> list[int]:
        """The nodes taken from the root, each the child of the last one (-1: the root) holding
        `next_token(last node, depth so far)`, until that is None or no child holds it."""
        children = {
            (parent, token): node
            for node, (parent, token) in enumerate(zip(self.parents, self.tokens, strict=True))
        }
        path: list[int] = []
        node = -1
        while (token := next_token(node, len(path))) is not None and (node, token) in children:
            node = children[(node, token)]
            path.append(node)
        return path

    def accepted(self, continuation: Sequence[int]) -> int:
        """How many leading tokens of `continuation` (the target's greedy tokens after the root) are a
        path of the tree from the root."""
        return len(self.walk(lambda node, depth: continuation[depth] if depth < len(continuation) else None))

    def visibility(self) -> torch.Tensor:
        """`[1 + N, 1 + N]` bool: row i (0 = the root, i = node i - 1) sees itself, the root and its
        ancestors: the ancestor mask of the verification forward."""
        size = len(self.tokens) + 1
        visible = torch.eye(size, dtype=torch.bool)
        visible[:, 0] = True
        for node, parent in enumerate(self.parents):
            if parent >= 0:
                visible[node + 1] |= visible[parent + 1]
        return visible


def build_tree(logits: torch.Tensor, budget: int, top_k: int) -> DraftTree:
    """The best-first tree of at most `budget` nodes over per-depth logits `[D, V]` (module docstring)."""
    _check(budget, top_k)
    return grow_tree(*top_k_per_depth(logits, top_k), budget)


def top_k_per_depth(logits: torch.Tensor, top_k: int) -> tuple[list, list]:
    """The log-probabilities and token ids of the `top_k` best tokens per depth, best first, as
    nested lists (`[..., D, V]` logits -> `[..., D, K]`): one transfer from the device for all the
    trees of a batch of blocks."""
    top_k = min(top_k, logits.shape[-1])
    values, indices = torch.log_softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
    return values.tolist(), indices.tolist()


def grow_tree(log_probs: list[list[float]], token_ids: list[list[int]], budget: int) -> DraftTree:
    """The best-first tree of at most `budget` nodes over one block's `top_k_per_depth`."""
    _check(budget, len(token_ids[0]))
    depth_count, top_k = len(log_probs), len(log_probs[0])
    tree = DraftTree(tokens=[], parents=[], depths=[])
    # (-score, depth, rank, parent node, parent's score): ties break by shallower, then better rank
    frontier = [(-log_probs[0][0], 1, 0, -1, 0.0)]
    while frontier and len(tree.tokens) < budget:
        negative_score, depth, rank, parent, parent_score = heapq.heappop(frontier)
        node = len(tree.tokens)
        tree.tokens.append(token_ids[depth - 1][rank])
        tree.parents.append(parent)
        tree.depths.append(depth)
        if rank + 1 < top_k:
            sibling = parent_score + log_probs[depth - 1][rank + 1]
            heapq.heappush(frontier, (-sibling, depth, rank + 1, parent, parent_score))
        if depth < depth_count:
            score = -negative_score
            heapq.heappush(frontier, (-(score + log_probs[depth][0]), depth + 1, 0, node, score))
    return tree


def _check(budget: int, top_k: int) -> None:
    if budget < 1 or top_k < 1:
        raise UserError(f"tree: budget and top-k must be >= 1, got budget {budget}, top-k {top_k}")
