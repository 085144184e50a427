"""Eval's replay of the speculative rounds (`app.evaluate.replay`): the walk over the greedy answer,
the per-depth statistics and the per-domain results. That the replay equals the real loop on a
trained drafter is checked in tests/test_speculative.py (its trained drafter), and on a scripted one
in tests/test_tree.py."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from app.evaluate import replay
from app.evaluate.prompts import first_per_domain, prompts_from_file
from app.evaluate.replay import (
    _drafts_at_every_anchor,
    chain_rounds,
    evaluate_replay,
    replay_prompt,
    tree_rounds,
)
from app.evaluate.result import EvalResult, GenerationResult, TreeResult, depth_statistics
from app.model.tree import grow_tree
from tests.test_speculative import AutocastWitness, greedy_reference, random_target_config, target_and_drafter

BLOCK = 5  # 4 drafted depths per round
ANSWER = list(range(100, 123))  # 23 tokens: the prefill's token and 22 more


def drafts(correct: int, second_at: set[int] = frozenset()) -> list[list[list[int]]]:
    """Top-2 drafts `[anchor][depth][rank]` at every anchor: the first `correct` depths right at rank 0,
    the rest wrong, except depths in `second_at` whose true token is at rank 1."""
    blocks = []
    for anchor in range(len(ANSWER) - 1):
        block = []
        for depth in range(BLOCK - 1):
            index = anchor + 1 + depth
            truth = ANSWER[index] if index < len(ANSWER) else -1
            if depth < correct:
                block.append([truth, 7])
            elif depth in second_at:
                block.append([8, truth])
            else:
                block.append([8, 9])
        blocks.append(block)
    return blocks


def test_a_chain_round_accepts_the_matching_prefix_and_the_next_starts_after_it():
    lengths, ranks = chain_rounds(drafts(correct=2), ANSWER)
    # 22 tokens after the prefill's, 3 per round (2 accepted + the target's), the last round cut: 7 x 3 + 1
    assert lengths == [3] * 7 + [1]
    assert ranks[0] == [0, 0, -1, -1] and len(ranks) == len(lengths)
    assert ranks[-1] == [0, -2, -2, -2]  # the last round's answer ends after its first depth
    full, _ = chain_rounds(drafts(correct=4), ANSWER)
    assert full == [5, 5, 5, 5, 2]  # a whole block accepted is B tokens: 4 drafts and the bonus


def test_a_tree_finds_the_true_token_at_rank_1_and_the_chain_does_not():
    token_ids = drafts(correct=1, second_at={1})
    per_depth = [[-0.01, -3.0], [-0.1, -0.15], [-1.0, -3.0], [-1.0, -3.0]]
    log_probs = [per_depth for _ in token_ids]
    chain, ranks = chain_rounds(token_ids, ANSWER)
    assert chain == [2] * 11 and ranks[0] == [0, 1, -1, -1]
    # a budget of 3 holds the rank-0 path to depth 2 and the rank-1 sibling of its depth-2 node
    assert tree_rounds(log_probs, token_ids, ANSWER, budget=3) == [3] * 7 + [1]
    assert tree_rounds(log_probs, token_ids, ANSWER, budget=1) == chain[:11]


def test_depth_statistics_count_acceptance_and_top_k_coverage_per_depth():
    per_prompt = [GenerationResult(ANSWER, [3, 1, 5], "replay")]
    ranks = [[[0, 0, 3, -1], [5, 0, -1, -1], [0, 0, 0, 0]]]
    result = EvalResult.pooled(per_prompt, BLOCK, depth_ranks=ranks)
    stats = depth_statistics(result)
    assert stats["accepted"] == [2 / 3, 2 / 3, 1 / 3, 1 / 3]
    assert stats["top1"] == [2 / 3, 1.0, 1 / 3, 1 / 3]
    assert stats["top4"] == [2 / 3, 1.0, 2 / 3, 1 / 3]
    assert stats["top8"] == [1.0, 1.0, 2 / 3, 1 / 3]
    ended = EvalResult.pooled(per_prompt, BLOCK, depth_ranks=[[[0, -2, -2, -2]]])
    assert depth_statistics(ended)["top1"][0] == 1.0 and math.isnan(depth_statistics(ended)["top1"][1])


def test_results_split_by_domain_with_their_own_tau_and_tree_tau():
    per_prompt = [
        GenerationResult(ANSWER[:7], [2, 2, 2], "replay"),
        GenerationResult(ANSWER[:5], [4], "replay"),
        GenerationResult(ANSWER[:4], [1, 1, 1], "replay"),
    ]
    tree = TreeResult(64, 8, BLOCK, [[3, 3], [4], [1, 2]])
    result = EvalResult.pooled(per_prompt, BLOCK, [tree], ["code", "prose", "code"])
    assert result.tau == 13 / 7
    domains = result.by_domain()
    assert list(domains) == ["code", "prose"]
    assert domains["code"].tau == 9 / 6 and domains["code"].tree_tau == 9 / 4
    assert domains["prose"].tau == 4.0 and domains["prose"].trees[0].acceptance_lengths == [[4]]
    summary = result.summary()
    assert summary["domains"] == {
        "code": {"tau": 1.5, "tree_tau": 2.25, "prompts": 2},
        "prose": {"tau": 4.0, "tree_tau": 4.0, "prompts": 1},
    }
    lines = result.describe()
    assert "  code: tau 1.500, tree@64 2.250 (2 prompts)" in lines
    assert "  gap between the best and the worst domain: 2.500" in lines
    assert result.summary_line().endswith("; code 1.50, prose 4.00")
    assert EvalResult.pooled(per_prompt, BLOCK).by_domain() == {}


def test_eval_takes_the_first_prompts_of_each_domain(tmp_path, tiny_tokenizer):
    assert first_per_domain(["code", "code", "prose", "code", "math", "prose"], 2) == [0, 1, 2, 4, 5]
    assert first_per_domain(["", "", ""], 2) == [0, 1]  # no domains: the limit counts in all
    path = tmp_path / "heldout.jsonl"
    records = [
        {"messages": [{"role": "user", "content": f"Continue: item {i}"}], "domain": domain}
        for i, domain in enumerate(["code", "code", "code", "prose", "math", "prose", "prose"])
    ]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    prompts = prompts_from_file(path, tiny_tokenizer, limit=2)
    assert prompts.domains == ["code", "code", "prose", "math", "prose"]
    assert "item 3" in tiny_tokenizer.decode(prompts.ids[2]) and "item 5" in tiny_tokenizer.decode(
        prompts.ids[4]
    )


def test_status_shows_the_latest_held_out_tau_per_domain():
    from app.telemetry.status_report import _progress_line

    per_prompt = [
        GenerationResult(ANSWER[:7], [2, 2, 2], "replay"),
        GenerationResult(ANSWER[:5], [4], "replay"),
    ]
    tree = TreeResult(64, 8, BLOCK, [[3, 3], [4]])
    summary = EvalResult.pooled(per_prompt, BLOCK, [tree], ["code", "prose"]).summary()
    line = _progress_line({"progress": {"step": 40}, "eval": {"step": 40, **summary}})
    assert line.endswith("(step 40); per domain: code 2.00 (tree 3.00), prose 4.00 (tree 4.00)")


def test_the_json_report_holds_every_budget_depth_and_domain():
    per_prompt = [
        GenerationResult(ANSWER[:7], [2, 2, 2], "replay"),
        GenerationResult(ANSWER[:5], [4], "replay"),
    ]
    trees = [TreeResult(16, 8, BLOCK, [[3, 3], [4]]), TreeResult(64, 8, BLOCK, [[6], [4]])]
    ranks = [[[0, -1, -1, -1]] * 3, [[0, 0, 0, -2]]]
    report = EvalResult.pooled(per_prompt, BLOCK, trees, ["code", "prose"], ranks).report()
    assert (
        report["tau"] == 2.5 and report["trees"]["64"]["tau"] == 5.0 and report["trees"]["16"]["rounds"] == 3
    )
    assert report["per_depth"]["top1"] == [1.0, 0.25, 0.25, 0.0]
    assert report["domains"]["prose"]["tau"] == 4.0 and "domains" not in report["domains"]["prose"]
    assert (
        report["domains"]["prose"]["per_depth"]["top1"][3] is None
    )  # no round reached depth 4: null, not NaN
    assert json.loads(json.dumps(report, allow_nan=False)) == report


def test_tree_tau_pools_every_round_of_every_prompt_and_its_gain_is_over_the_chain():
    """Prompts of unequal round counts, so that pooling rounds and averaging per-prompt means differ:
    tau is tokens over rounds, as the serving engines' `accept length` counts it (a per-prompt mean
    would weigh a 1-round prompt like a 4-round one)."""
    per_prompt = [
        GenerationResult(ANSWER[:5], [1, 1, 1, 1], "replay"),
        GenerationResult(ANSWER[:4], [3], "replay"),
    ]
    trees = [TreeResult(16, 4, BLOCK, [[2, 2], [3]]), TreeResult(64, 4, BLOCK, [[4], [3]])]
    result = EvalResult.pooled(per_prompt, BLOCK, trees)
    assert result.tau == 7 / 5  # per prompt: (1 + 3) / 2 = 2
    assert trees[0].tau == result.tree_tau == 7 / 3  # per prompt: (2 + 3) / 2 = 2.5
    assert trees[1].tau == 7 / 2
    lines = result.describe()
    assert "tree tau (DDTree, budget 16, top-4 per depth): 2.333 (+66.7% vs the chain) over 3 rounds" in lines
    assert (
        "tree tau (DDTree, budget 64, top-4 per depth): 3.500 (+150.0% vs the chain) over 2 rounds" in lines
    )
    assert result.summary() == {
        "tau": 1.4,
        "tree_tau": 7 / 3,
        "tree_budget": 16,
        "rounds": 5,
        "generated_tokens": 9,
    }
    assert result.summary_line() == "tau=1.400 (tree tau=2.333 at budget 16) over 5 rounds of 2 prompts"
    report = json.loads(json.dumps(result.report(), allow_nan=False))  # as `dflash eval --json` writes it
    assert report["trees"] == {
        "16": {"tau": 7 / 3, "top_k": 4, "rounds": 3},
        "64": {"tau": 3.5, "top_k": 4, "rounds": 2},
    }


def brute_force_rounds(paths: list[set[tuple[int, ...]]], answer: list[int]) -> list[int]:
    """Round lengths over `answer` where `paths[a]` holds every token sequence the round anchored at
    answer index `a` can accept: each round emits the longest run of the answer after its anchor that
    is one of them, plus the target's token, cut to what is left."""
    lengths, emitted = [], 1
    while emitted < len(answer):
        left = len(answer) - emitted
        accepted = max(
            k for k in range(left + 1) if tuple(answer[emitted : emitted + k]) in paths[emitted - 1]
        )
        lengths.append(min(accepted + 1, left))
        emitted += lengths[-1]
    return lengths


def chain_paths(block: list[list[int]]) -> set[tuple[int, ...]]:
    """Every prefix of the rank-0 drafts."""
    top = [candidates[0] for candidates in block]
    return {tuple(top[:k]) for k in range(len(top) + 1)}


def tree_paths(log_probs: list[list[float]], block: list[list[int]], budget: int) -> set[tuple[int, ...]]:
    """The token sequence from the root to every node of the block's tree, and the empty one."""
    tree = grow_tree(log_probs, block, budget)
    paths: set[tuple[int, ...]] = {()}
    for node in range(len(tree.tokens)):
        path, at = [], node
        while at >= 0:
            path.insert(0, tree.tokens[at])
            at = tree.parents[at]
        paths.add(tuple(path))
    return paths


def test_the_walk_over_random_drafts_equals_a_brute_force_count():
    """Random top-3 drafts over a 4-token vocabulary (so that drafts often match) and answers of 1 to
    25 tokens: the chain accepts a prefix of rank-0 drafts, the tree a path of its nodes (every path
    of the tree enumerated), the ranks are each true token's place among the candidates."""
    rng = random.Random(7)
    for trial in range(60):
        depths, top_k, budget = rng.randint(1, 5), 3, rng.randint(1, 12)
        answer = [rng.randrange(4) for _ in range(rng.randint(1, 25))]
        token_ids = [
            [rng.sample(range(4), top_k) for _ in range(depths)] for _ in range(max(len(answer) - 1, 1))
        ]
        log_probs = [[sorted((-rng.random() * 4 for _ in range(top_k)), reverse=True) for _ in range(depths)]
                     for _ in token_ids]  # fmt: skip

        lengths, ranks = chain_rounds(token_ids, answer)
        assert lengths == brute_force_rounds([chain_paths(block) for block in token_ids], answer), trial
        assert sum(lengths) == len(answer) - 1
        anchors = [sum(lengths[:r]) for r in range(len(lengths))]  # answer index of each round's anchor
        for anchor, round_ranks in zip(anchors, ranks, strict=True):
            truth = answer[anchor + 1 : anchor + 1 + depths]
            block = token_ids[anchor]
            expected = [block[d].index(t) if t in block[d] else -1 for d, t in enumerate(truth)]
            assert round_ranks == expected + [-2] * (depths - len(truth)), trial
        trees = [tree_paths(p, block, budget) for p, block in zip(log_probs, token_ids, strict=True)]
        assert tree_rounds(log_probs, token_ids, answer, budget) == brute_force_rounds(trees, answer), trial


class Clock:
    """`time` for the replay's progress: each reading `step` seconds after the last."""

    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def monotonic(self) -> float:
        self.now += self.step
        return self.now


def test_evaluate_replay_pools_each_prompt_s_rounds_per_budget_and_domain_and_reports_every_10_s(monkeypatch):
    target, drafter = target_and_drafter(random_target_config())
    prompts = [[5, 9, 11], list(range(40, 47)), [3, 1, 4, 1, 5]]
    answers = [greedy_reference(target, prompt, 9, None) for prompt in prompts]
    replayed = [
        replay_prompt(target, drafter, p, a, [2, 6], top_k=2) for p, a in zip(prompts, answers, strict=True)
    ]
    # readings 5 s apart: the start, then per prompt one check (and one more after a line): 5 - 0 < 10,
    # 10 - 0 >= 10 (a line, the clock reset to 15), 20 - 15 < 10
    heard: list[str] = []
    monkeypatch.setattr(replay, "time", Clock(5.0))
    domains = ("code", "prose", "code")
    result = evaluate_replay(target, drafter, prompts, answers, [2, 6], 2, None, domains, heard.append)
    assert heard == ["eval: replayed the rounds of 2/3 prompts"]
    assert [r.tokens for r in result.per_prompt] == answers and result.domains == list(domains)
    assert [r.acceptance_lengths for r in result.per_prompt] == [r.chain.acceptance_lengths for r in replayed]
    assert result.depth_ranks == [r.depth_ranks for r in replayed] and result.block_size == 4
    assert [(t.budget, t.top_k, t.block_size) for t in result.trees] == [(2, 2, 4), (6, 2, 4)]
    for tree in result.trees:
        assert tree.acceptance_lengths == [r.trees[tree.budget] for r in replayed]
    assert list(result.by_domain()) == ["code", "prose"]
    plain = evaluate_replay(target, drafter, prompts, answers, [], 2)  # no domains, no progress
    assert plain.domains == [] and plain.trees == [] and plain.tau == result.tau


def test_the_drafts_at_every_anchor_are_each_block_s_top_k_however_many_blocks_a_pass_drafts(monkeypatch):
    """Every answer token but the last anchors a block of B - 1 depths with the top-K (8, more than the
    3 depths) candidates each; drafted 2 blocks per pass the same as in one pass."""
    target, drafter = target_and_drafter(random_target_config())
    prompt, answer = [5, 9, 11], greedy_reference(target, [5, 9, 11], 9, None)
    sequence = torch.tensor(prompt + answer)
    features = target.features(sequence[None])[0]
    log_probs, token_ids = _drafts_at_every_anchor(target, drafter, sequence, features, len(prompt), 8, None)
    assert (len(token_ids), len(token_ids[0]), len(token_ids[0][0])) == (len(answer) - 1, 3, 8)
    assert all(values == sorted(values, reverse=True) for block in log_probs for values in block)
    monkeypatch.setattr(replay, "ANCHORS_PER_PASS", 2)
    chunked_log_probs, chunked_ids = _drafts_at_every_anchor(
        target, drafter, sequence, features, len(prompt), 8, None
    )
    assert chunked_ids == token_ids
    assert torch.allclose(torch.tensor(chunked_log_probs), torch.tensor(log_probs), atol=1e-5)


def test_the_drafter_drafts_in_the_asked_precision_and_answers_go_with_their_prompts():
    target, drafter = target_and_drafter(random_target_config())
    prompts = [[5, 9, 11], [3, 1, 4]]
    answers = [greedy_reference(target, prompt, 6, None) for prompt in prompts]
    witness = AutocastWitness(drafter.arch)
    evaluate_replay(target, witness, prompts, answers, [4], 2, torch.bfloat16)
    assert witness.seen == {torch.bfloat16}
    with pytest.raises(ValueError, match="zip"):
        evaluate_replay(target, drafter, prompts, answers[:1], [4], 2)
