"""Eval by replay: every round of every prompt from the target's greedy decode, batched.

Greedy verification is lossless (`app.evaluate.speculative`): whatever the drafter proposes, a
speculative decode emits exactly the target's greedy decode, and a round that starts at position p
sees the target's features of every position before p. So the rounds can be replayed without the
round-by-round loop:

1. the target answers all prompts greedily together (`app.generate.decoder`), cut at the token budget
   and the end token as a serving engine stops;
2. one target forward per answered sequence gives the features of every position;
3. the drafter drafts a block at every position where a round can start, all at once, over one
   context cache of the whole sequence, each block seeing only the context before its anchor
   (`DFlashDrafter.blocks_logits`);
4. the rounds are walked on the host: a chain round at anchor p accepts the drafts' longest prefix
   equal to the greedy tokens after p; a DDTree round the longest prefix that is a path of its tree
   (`app.model.tree`); the next round starts after the tokens it emitted.

The acceptance lengths equal the loop's (tests/test_replay.py), at a fraction of its time: the
target runs two batched passes instead of one forward per round, the drafter one batched pass per
sequence. The loop (`speculative_generate`) still runs for the lossless check.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from app.evaluate.result import COVERAGE_K, EvalResult, GenerationResult, TreeResult
from app.evaluate.speculative import drafter_autocast
from app.model.drafter import DFlashDrafter
from app.model.target import TargetModel
from app.model.tree import grow_tree

ANCHORS_PER_PASS = 256
"""Blocks drafted per drafter call: bounds the logits `[A, B-1, V]` of one call (256 x 15 x 152K fp32
is 2.3 GB at a Qwen vocabulary)."""


PROGRESS_EVERY_S = 10.0
"""Seconds between progress lines while the rounds are replayed (eval is never silent for long)."""


@dataclass
class ReplayedPrompt:
    """One prompt's rounds: the chain's and each tree budget's acceptance lengths."""

    chain: GenerationResult
    trees: dict[int, list[int]]
    depth_ranks: list[list[int]]
    """Per chain round, per depth 1..B-1 within the block: the rank of the target's token among the
    drafter's top-K at that depth (0 = its argmax), -1 when it is not among them, -2 when the answer
    ended before that depth."""


@torch.inference_mode()
def replay_prompt(
    target: TargetModel,
    drafter: DFlashDrafter,
    prompt: Sequence[int],
    answer: Sequence[int],
    budgets: Sequence[int],
    top_k: int,
    autocast_dtype: torch.dtype | None = None,
) -> ReplayedPrompt:
    """The rounds of one prompt whose greedy answer (cut at the budget and the end token) is `answer`."""
    sequence = torch.tensor([*prompt, *answer], dtype=torch.long, device=target.device)
    features = target.features(sequence[None])[0]
    ranked = max(top_k, *COVERAGE_K)  # the coverage table's depth ranks need the top 8 at least
    log_probs, token_ids = _drafts_at_every_anchor(
        target, drafter, sequence, features, len(prompt), ranked, autocast_dtype
    )
    chain, ranks = chain_rounds(token_ids, list(answer))
    if ranked > top_k:  # the tree chooses among the configured top-K only
        log_probs = [[depth[:top_k] for depth in anchor] for anchor in log_probs]
        token_ids = [[depth[:top_k] for depth in anchor] for anchor in token_ids]
    trees = {budget: tree_rounds(log_probs, token_ids, list(answer), budget) for budget in budgets}
    return ReplayedPrompt(GenerationResult(list(answer), chain, "replay"), trees, ranks)


def evaluate_replay(
    target: TargetModel,
    drafter: DFlashDrafter,
    prompts: Sequence[Sequence[int]],
    answers: Sequence[Sequence[int]],
    budgets: Sequence[int],
    top_k: int,
    autocast_dtype: torch.dtype | None = None,
    domains: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> EvalResult:
    """Chain and tree tau of `drafter` over `prompts`, whose greedy answers are `answers`."""
    block_size = drafter.arch.block_size
    replayed: list[ReplayedPrompt] = []
    last_report = time.monotonic()
    for prompt, answer in zip(prompts, answers, strict=True):
        replayed.append(replay_prompt(target, drafter, prompt, answer, budgets, top_k, autocast_dtype))
        if progress is not None and time.monotonic() - last_report >= PROGRESS_EVERY_S:
            progress(f"eval: replayed the rounds of {len(replayed)}/{len(prompts)} prompts")
            last_report = time.monotonic()
    trees = [TreeResult(b, top_k, block_size, [r.trees[b] for r in replayed]) for b in budgets]
    return EvalResult.pooled(
        [r.chain for r in replayed],
        block_size,
        trees,
        list(domains) if domains is not None else None,
        [r.depth_ranks for r in replayed],
    )


def _drafts_at_every_anchor(
    target: TargetModel,
    drafter: DFlashDrafter,
    sequence: torch.Tensor,
    features: torch.Tensor,
    prompt_length: int,
    top_k: int,
    autocast_dtype: torch.dtype | None,
) -> tuple[list, list]:
    """Top-K log-probabilities and token ids `[A][B-1][K]` of the blocks at anchors `prompt_length ..
    len(sequence) - 2` (every answer token but the last can start a round), as nested lists."""
    positions = torch.arange(len(sequence), device=sequence.device)
    anchors = positions[prompt_length:-1]
    log_probs: list = []
    token_ids: list = []
    with drafter_autocast(drafter, autocast_dtype):
        cache = drafter.new_cache()
        drafter.extend_context(features, positions, cache)
        for start in range(0, len(anchors), ANCHORS_PER_PASS):
            chunk = anchors[start : start + ANCHORS_PER_PASS]
            logits = drafter.blocks_logits(cache, sequence[chunk], chunk, target.embed_tokens, target.lm_head)
            values, indices = torch.log_softmax(logits, dim=-1).topk(min(top_k, logits.shape[-1]), dim=-1)
            log_probs += values.tolist()
            token_ids += indices.tolist()
    return log_probs, token_ids


def chain_rounds(token_ids: list[list[list[int]]], answer: list[int]) -> tuple[list[int], list[list[int]]]:
    """Chain acceptance lengths over `answer` with drafts `token_ids[a][d][0]` at answer index a + 1
    (a round's anchor is the answer token before its drafts), and the target token's rank per depth."""
    lengths: list[int] = []
    ranks: list[list[int]] = []
    emitted = 1  # the prefill's token
    while emitted < len(answer):
        per_depth = token_ids[emitted - 1]  # the round's anchor is answer[emitted - 1]
        truth = answer[emitted : emitted + len(per_depth)]
        accepted = 0
        while accepted < len(truth) and per_depth[accepted][0] == truth[accepted]:
            accepted += 1
        ranks.append([_rank(candidates, token) for candidates, token in zip(per_depth, truth, strict=False)])
        ranks[-1] += [-2] * (len(per_depth) - len(truth))
        lengths.append(min(accepted + 1, len(answer) - emitted))
        emitted += lengths[-1]
    return lengths, ranks


def tree_rounds(log_probs: list, token_ids: list, answer: list[int], budget: int) -> list[int]:
    """DDTree acceptance lengths over `answer` at `budget` nodes (`app.model.tree`)."""
    lengths: list[int] = []
    emitted = 1
    while emitted < len(answer):
        tree = grow_tree(log_probs[emitted - 1], token_ids[emitted - 1], budget)
        accepted = tree.accepted(answer[emitted : emitted + len(token_ids[0])])
        lengths.append(min(accepted + 1, len(answer) - emitted))
        emitted += lengths[-1]
    return lengths


def _rank(candidates: list[int], token: int) -> int:
    return candidates.index(token) if token in candidates else -1
