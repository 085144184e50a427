"""The lossless check (`app.evaluate.lossless`): the target's plain greedy decode, the loop's and the
real tree verification's decodes against eval's replay, which targets get the tree verified, which
mismatches are named, and the verdict line. Small random targets and an untrained drafter on the CPU;
that a broken replay fails the check is in tests/test_tree.py."""

from __future__ import annotations

import pytest
import torch

from app.evaluate.lossless import LosslessCheck, check_lossless, greedy_decode
from app.evaluate.replay import evaluate_replay
from tests.test_speculative import AutocastWitness, greedy_reference, random_target_config, target_and_drafter

PROMPTS = [[5, 9, 11], list(range(40, 47)), [3, 1, 4, 1, 5]]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def model():
    return target_and_drafter(random_target_config())


def replayed(target, drafter, stops=(), budgets=(6,), prompts=PROMPTS):
    answers = [greedy_decode(target, prompt, NEW_TOKENS, list(stops)) for prompt in prompts]
    return evaluate_replay(target, drafter, prompts, answers, list(budgets), top_k=2)


def test_the_verdict_needs_every_prompt_equal_and_its_line_says_what_was_compared():
    assert LosslessCheck(3, 3, None).ok and not LosslessCheck(3, 2, None).ok
    assert LosslessCheck(3, 3, 16, 3).ok
    assert not LosslessCheck(3, 3, 16, 2).ok and not LosslessCheck(3, 2, 16, 3).ok
    chain = (
        "lossless: the speculative loop's output equals the target's greedy decode, and its rounds the "
        "replayed ones, on 2/3 prompts"
    )
    assert LosslessCheck(3, 2, None).describe() == (
        chain + "; tree: not verified by a real forward (the target's layers take no ancestor mask)"
    )
    failed = LosslessCheck(3, 2, 16, 1, ["prompt 0: chain", "prompt 2: tree"])
    assert failed.describe() == (
        chain + "; the real tree-verification forward (budget 16) equals it and tree tau's acceptance on 1/3"
        " (first mismatch: prompt 0: chain; prompt 2: tree)"
    )


def test_the_greedy_decode_is_the_target_s_own_cut_after_the_first_stop_token(model):
    target, _ = model
    free = greedy_reference(target, PROMPTS[1], NEW_TOKENS, None)
    assert greedy_decode(target, PROMPTS[1], NEW_TOKENS, []) == free
    assert greedy_decode(target, PROMPTS[1], 3, ()) == free[:3]
    stops = [free[5], free[2]]
    first = min(free.index(token) for token in stops)
    assert greedy_decode(target, PROMPTS[1], NEW_TOKENS, stops) == free[: first + 1]
    assert greedy_decode(target, PROMPTS[1], NEW_TOKENS, [free[0]]) == free[:1]
    # token 0 in the prompt is attended to (not taken for padding), whatever the pad id
    zeros = [0, 5, 0, 9]
    assert greedy_decode(target, zeros, NEW_TOKENS, []) == greedy_reference(target, zeros, NEW_TOKENS, None)


def test_the_greedy_decode_is_greedy_where_the_target_s_generation_config_samples(model):
    """Qwen3's generation_config.json asks for sampling (do_sample, temperature 0.6)."""
    target, _ = model
    free = greedy_reference(target, PROMPTS[0], NEW_TOKENS, None)
    config = target.model.generation_config
    saved = config.do_sample, config.temperature
    config.do_sample, config.temperature = True, 2.0
    try:
        torch.manual_seed(0)
        assert greedy_decode(target, PROMPTS[0], NEW_TOKENS, []) == free
    finally:
        config.do_sample, config.temperature = saved


def test_an_exact_replay_passes_with_its_stop_tokens_and_the_tree_at_the_first_budget(model):
    target, drafter = model
    free = greedy_reference(target, PROMPTS[1], NEW_TOKENS, None)
    stops = [free[3]]
    result = replayed(target, drafter, stops, budgets=(6, 2))
    assert result.per_prompt[1].tokens == free[: free.index(free[3]) + 1]
    check = check_lossless(target, drafter, PROMPTS, result, NEW_TOKENS, stops)
    assert (check.prompts, check.chain_equal, check.tree_budget, check.tree_equal) == (3, 3, 6, 3)
    assert check.ok and check.first_mismatch == []
    # without the stop token the loop and the greedy decode run on past it: the replay's answer differs
    unstopped = check_lossless(target, drafter, PROMPTS, result, NEW_TOKENS, [])
    assert unstopped.chain_equal == 2 and unstopped.tree_equal == 2
    assert unstopped.first_mismatch == [
        "prompt 1: the chain's output or rounds differ from the greedy decode or the loop",
        "prompt 1: tree verification differs",
    ]


def test_only_the_first_chain_mismatch_and_the_first_tree_mismatch_are_named(model):
    """Each kind's first differing prompt, whichever came first: before, a second tree mismatch was
    named where no chain one came first, and a chain mismatch after a tree one was not named."""
    target, drafter = model
    result = replayed(target, drafter)
    for prompt in (1, 2):
        result.per_prompt[prompt].acceptance_lengths[0] += 1
    result.trees[0].acceptance_lengths[2][0] += 1
    check = check_lossless(target, drafter, PROMPTS, result, NEW_TOKENS, [])
    assert (check.chain_equal, check.tree_equal) == (1, 2)
    assert check.first_mismatch == [
        "prompt 1: the chain's output or rounds differ from the greedy decode or the loop",
        "prompt 2: tree verification differs",
    ]
    first_tree = replayed(target, drafter)
    for prompt in (0, 2):
        first_tree.trees[0].acceptance_lengths[prompt][-1] += 1
    check = check_lossless(target, drafter, PROMPTS, first_tree, NEW_TOKENS, [])
    assert check.first_mismatch == ["prompt 0: tree verification differs"] and check.tree_equal == 1
    # a chain mismatch after a tree mismatch is named too (it was hidden behind the tree's)
    first_tree.per_prompt[1].acceptance_lengths[0] += 1
    check = check_lossless(target, drafter, PROMPTS, first_tree, NEW_TOKENS, [])
    assert check.first_mismatch == [
        "prompt 1: the chain's output or rounds differ from the greedy decode or the loop",
        "prompt 0: tree verification differs",
    ]


def test_a_target_without_an_ancestor_mask_leaves_the_tree_unverified_and_one_without_layer_types_not():
    window = random_target_config(use_sliding_window=True, sliding_window=4, max_window_layers=4)
    for raw, budget in [(window, None), (random_target_config("llama"), 6)]:
        target, drafter = target_and_drafter(raw)
        result = replayed(target, drafter)
        check = check_lossless(target, drafter, PROMPTS, result, NEW_TOKENS, [])
        assert (check.chain_equal, check.tree_budget, check.tree_equal) == (3, budget, 3 if budget else 0)
        assert check.ok
    target, drafter = target_and_drafter(random_target_config())
    untreed = replayed(target, drafter, budgets=())
    assert check_lossless(target, drafter, PROMPTS, untreed, NEW_TOKENS, []).tree_budget is None


def test_the_loop_and_the_tree_decode_run_the_drafter_in_the_asked_precision(model):
    target, drafter = model
    result = replayed(target, drafter, prompts=PROMPTS[:1])
    witness = AutocastWitness(drafter.arch)
    check_lossless(target, witness, PROMPTS[:1], result, NEW_TOKENS, [], torch.bfloat16)
    assert witness.seen == {torch.bfloat16}
