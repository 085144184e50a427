"""What eval reports (`app.evaluate.result`): tau pooled over rounds, the histogram, the tree budgets,
the per-depth table and the per-domain split, in the lines `dflash eval` prints, the record periodic
eval keeps and the JSON report, on small hand-counted results (in-process, no model)."""

from __future__ import annotations

import json
import math

from app.evaluate.result import (
    EvalResult,
    GenerationResult,
    TreeResult,
    acceptance_histogram,
    depth_statistics,
    describe_depths,
    describe_domains,
)

BLOCK = 4


def three_prompts() -> EvalResult:
    """6 rounds emitting 3, 1, 3 | 4 | 1, 1 tokens (13 in all, tau 13 / 6); a budget-16 tree's rounds
    emit 4, 3 | 4 | 2; the second prompt has no domain."""
    per_prompt = [
        GenerationResult(list(range(7)), [3, 1, 3], "kv-cache"),
        GenerationResult(list(range(4)), [4], "kv-cache"),
        GenerationResult([5, 6], [1, 1], "kv-cache"),
    ]
    tree = TreeResult(16, 8, BLOCK, [[4, 3], [4], [2]])
    return EvalResult.pooled(per_prompt, BLOCK, [tree], ["code", "", "code"])


def ranked() -> EvalResult:
    """Two prompts of one domain whose rounds emit 2, 4 | 1 tokens, with the drafter's rank of the
    target's token per depth (-1 outside its top-K, -2 past the answer)."""
    per_prompt = [GenerationResult([1, 2, 3, 4], [2, 4], "replay"), GenerationResult([5], [1], "replay")]
    ranks = [[[0, -1, -1], [0, 0, 2]], [[3, -2, -2]]]
    return EvalResult.pooled(per_prompt, BLOCK, None, ["math", "math"], ranks)


def test_describe_prints_tau_counts_the_histogram_each_tree_and_each_domain():
    result = three_prompts()
    assert result.tau == 13 / 6 and result.rounds == 6 and result.generated_tokens == 13
    assert result.target_cache == "kv-cache" and result.tree_tau == 13 / 4
    assert result.histogram == [3, 0, 2, 1]
    assert result.tokens_per_target_forward == 13 / 9  # 6 rounds and 3 prefills
    assert result.describe() == [
        "tau (mean acceptance length, max 4; the serving engines' `accept length`): 2.167",
        "prompts: 3, rounds: 6, generated tokens: 13, tokens/round: 2.167, tokens/target forward: 1.444",
        "target state between rounds: kv-cache",
        "acceptance histogram (tokens emitted per round: rounds):",
        "    1:      3 " + "#" * 40,
        "    2:      0 ",
        "    3:      2 " + "#" * 27,
        "    4:      1 " + "#" * 13,
        "tree tau (DDTree, budget 16, top-8 per depth): 3.250 (+50.0% vs the chain) over 4 rounds",
        "  tokens emitted per round: rounds: 2:1 3:1 4:2",
        "per domain:",
        "  (none): tau 4.000, tree@16 4.000 (1 prompts)",
        "  code: tau 1.800, tree@16 3.000 (2 prompts)",
        "  gap between the best and the worst domain: 2.200",
    ]


def test_summary_report_and_summary_line_carry_the_same_figures():
    result = three_prompts()
    assert result.summary() == {
        "tau": 13 / 6,
        "tree_tau": 3.25,
        "tree_budget": 16,
        "rounds": 6,
        "generated_tokens": 13,
        "domains": {
            "(none)": {"tau": 4.0, "tree_tau": 4.0, "prompts": 1},
            "code": {"tau": 1.8, "tree_tau": 3.0, "prompts": 2},
        },
    }
    code = {
        "tau": 1.8,
        "rounds": 5,
        "prompts": 2,
        "generated_tokens": 9,
        "block_size": BLOCK,
        "trees": {"16": {"tau": 3.0, "top_k": 8, "rounds": 3}},
        "per_depth": {},
    }
    report = result.report()
    assert report["domains"]["code"] == code
    assert report == {
        "tau": 13 / 6,
        "rounds": 6,
        "prompts": 3,
        "generated_tokens": 13,
        "block_size": BLOCK,
        "trees": {"16": {"tau": 3.25, "top_k": 8, "rounds": 4}},
        "per_depth": {},
        "domains": {
            "(none)": {
                "tau": 4.0,
                "rounds": 1,
                "prompts": 1,
                "generated_tokens": 4,
                "block_size": BLOCK,
                "trees": {"16": {"tau": 4.0, "top_k": 8, "rounds": 1}},
                "per_depth": {},
            },
            "code": code,
        },
    }
    assert "domains" not in result.report(per_domain=False)
    assert (
        result.summary_line()
        == "tau=2.167 (tree tau=3.250 at budget 16) over 6 rounds of 3 prompts; (none) 4.00, code 1.80"
    )
    assert result.describe_prompts() == [
        "prompt 0: 7 tokens, chain tau 2.333, tree tau (budget 16) 3.500",
        "prompt 1: 4 tokens, chain tau 4.000, tree tau (budget 16) 4.000",
        "prompt 2: 2 tokens, chain tau 1.000, tree tau (budget 16) 2.000",
    ]


def test_a_domain_result_selects_its_prompts_trees_and_ranks():
    result = three_prompts()
    code = result.by_domain()["code"]
    assert [p.tokens for p in code.per_prompt] == [list(range(7)), [5, 6]]
    assert code.domains == ["code", "code"] and code.block_size == BLOCK and code.target_cache == "kv-cache"
    assert [(t.budget, t.top_k, t.block_size, t.acceptance_lengths) for t in code.trees] == [
        (16, 8, BLOCK, [[4, 3], [2]])
    ]
    assert code.tree_tau == 3.0 and code.depth_ranks == []
    picked = ranked().select([1])
    assert picked.depth_ranks == [[[3, -2, -2]]] and picked.domains == ["math"] and picked.tau == 1.0
    plain = EvalResult.pooled(result.per_prompt, BLOCK).select([2, 0])
    assert plain.domains == [] and plain.trees == [] and plain.tau == 9 / 5 and plain.tree_tau is None
    assert plain.by_domain() == {} and plain.summary_line() == "tau=1.800 over 5 rounds of 2 prompts"
    assert plain.summary() == {"tau": 9 / 5, "rounds": 5, "generated_tokens": 9}
    assert EvalResult.pooled(result.per_prompt, BLOCK, domains=["", "", ""]).by_domain() == {}


def test_the_per_depth_table_counts_acceptance_and_top_k_coverage():
    result = ranked()
    assert depth_statistics(result) == {
        "accepted": [2 / 3, 1 / 3, 1 / 3],
        "top1": [2 / 3, 1 / 2, 0.0],
        "top4": [1.0, 1 / 2, 1 / 2],
        "top8": [1.0, 1 / 2, 1 / 2],
    }
    assert describe_depths(result) == [
        "per depth (share of chain rounds): depth accepted     top1     top4     top8",
        "    1     0.667    0.667    1.000    1.000",
        "    2     0.333    0.500    0.500    0.500",
        "    3     0.333    0.000    0.500    0.500",
    ]
    lines = result.describe()
    assert lines[2] == (
        "target state between rounds: replay (the rounds replayed from the target's greedy decode, "
        "batched; --check-lossless runs the loop)"
    )
    assert lines[-6:] == [*describe_depths(result), "per domain:", "  math: tau 2.333 (2 prompts)"]
    assert result.report()["per_depth"] == depth_statistics(result)
    # rank 7 is in the top-8 only, rank 8 in none; a round short of the block has no rank past its end
    short = EvalResult.pooled([GenerationResult([1], [1, 1], "replay")], BLOCK, depth_ranks=[[[7, 8], [8]]])
    assert _nan_as_none(depth_statistics(short)) == {
        "accepted": [0.0, 0.0, 0.0],
        "top1": [0.0, 0.0, None],
        "top4": [0.0, 0.0, None],
        "top8": [0.5, 0.0, None],
    }
    assert json.loads(json.dumps(short.report(), allow_nan=False))["per_depth"]["top1"] == [0.0, 0.0, None]
    assert describe_depths(EvalResult.pooled(result.per_prompt, BLOCK)) == []


def _nan_as_none(stats: dict[str, list[float]]) -> dict[str, list[float | None]]:
    return {name: [None if math.isnan(v) else v for v in values] for name, values in stats.items()}


def test_an_empty_result_has_no_tau_and_says_so():
    empty = EvalResult.pooled([], 3)
    assert math.isnan(empty.tau) and empty.rounds == 0 and empty.target_cache == "replay"
    assert math.isnan(empty.tokens_per_target_forward) and empty.histogram == [0, 0, 0]
    assert empty.describe() == [
        "tau (mean acceptance length, max 3; the serving engines' `accept length`): nan",
        "prompts: 0, rounds: 0, generated tokens: 0, tokens/round: nan, tokens/target forward: nan",
        "target state between rounds: replay (the rounds replayed from the target's greedy decode, "
        "batched; --check-lossless runs the loop)",
        "acceptance histogram (tokens emitted per round: rounds):",
        "    1:      0 ",
        "    2:      0 ",
        "    3:      0 ",
    ]
    assert empty.summary_line() == "tau=nan over 0 rounds of 0 prompts"
    tree = TreeResult(64, 4, 3)
    assert tree.rounds == 0 and math.isnan(tree.tau) and tree.histogram == [0, 0, 0]


def test_a_tree_over_a_chain_without_rounds_has_no_gain_and_a_prompt_without_rounds_no_tau():
    per_prompt = [GenerationResult([], [], "recompute"), GenerationResult([1, 2], [2], "recompute")]
    tree = TreeResult(8, 2, BLOCK, [[], [3]])
    result = EvalResult.pooled(per_prompt, BLOCK, [tree], ["idle", "busy"])
    assert result.describe()[2] == (
        "target state between rounds: recompute (the target re-ran over the accepted sequence every round)"
    )
    assert result.describe_prompts() == [
        "prompt 0: 0 tokens, chain tau nan, tree tau (budget 8) nan",
        "prompt 1: 2 tokens, chain tau 2.000, tree tau (budget 8) 3.000",
    ]
    # the idle domain has no tau: no gap between one measured domain and nothing
    assert describe_domains(result) == [
        "per domain:",
        "  busy: tau 2.000, tree@8 3.000 (1 prompts)",
        "  idle: tau nan, tree@8 nan (1 prompts)",
    ]
    silent = EvalResult.pooled([GenerationResult([], [], "replay")], BLOCK, [TreeResult(8, 2, BLOCK, [[2]])])
    assert (
        silent.describe()[-2]
        == "tree tau (DDTree, budget 8, top-2 per depth): 2.000 (+nan% vs the chain) over 1 rounds"
    )
    assert silent.report()["trees"] == {"8": {"tau": 2.0, "top_k": 2, "rounds": 1}}


def test_the_histogram_counts_rounds_per_tokens_emitted():
    assert acceptance_histogram([[1, 4, 4], [], [2]], 4) == [1, 1, 0, 2]
    assert acceptance_histogram([], 2) == [0, 0]
    assert TreeResult(16, 8, 4, [[4, 3], [4], [2]]).select([0, 2]).histogram == [0, 1, 1, 1]


def test_each_domain_lists_every_tree_budget_and_a_record_without_trees_has_no_tree_tau():
    per_prompt = [GenerationResult([1, 2], [2], "replay"), GenerationResult([3], [1], "replay")]
    trees = [TreeResult(16, 4, BLOCK, [[3], [1]]), TreeResult(64, 4, BLOCK, [[4], [2]])]
    result = EvalResult.pooled(per_prompt, BLOCK, trees, ["code", "prose"])
    assert describe_domains(result) == [
        "per domain:",
        "  code: tau 2.000, tree@16 3.000, tree@64 4.000 (1 prompts)",
        "  prose: tau 1.000, tree@16 1.000, tree@64 2.000 (1 prompts)",
        "  gap between the best and the worst domain: 1.000",
    ]
    assert ranked().summary() == {
        "tau": 7 / 3,
        "rounds": 3,
        "generated_tokens": 5,
        "domains": {"math": {"tau": 7 / 3, "prompts": 2}},
    }
