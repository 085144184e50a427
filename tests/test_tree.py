"""DDTree: best-first tree construction, tree acceptance from the greedy decode, and the real
tree-verification forward it must agree with (attention-only tiny Qwen3 target, CPU)."""

import itertools
import json
import math

import pytest
import torch
from transformers import DynamicCache

from app.errors import UserError
from app.evaluate.lossless import check_lossless
from app.evaluate.replay import evaluate_replay, replay_prompt
from app.evaluate.speculative import CachedTarget, speculative_generate
from app.evaluate.tree import _masked_forward, tree_verification_inputs, verified_tree_decode
from app.model.drafter import DFlashDrafter
from app.model.tree import DraftTree, build_tree
from tests.helpers import dflash
from tests.test_speculative import greedy_reference, random_target_config, single_thread, target_and_drafter  # noqa: F401 (a fixture)
from tests.test_target import ARCHITECTURES

PROMPT = [5, 17, 42, 99, 3, 250, 11]
NEW_TOKENS = 40
NO_STOP: frozenset[int] = frozenset()


def log_probs_to_logits(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows).log()


def test_the_tree_grows_best_first_by_summed_log_probability_within_the_budget():
    # depth 1: a 0.6, b 0.29, c 0.11; depth 2: x 0.5, y 0.4, z 0.1 (tokens a,b,c,x,y,z = 0..5)
    logits = log_probs_to_logits([[0.6, 0.29, 0.11, 1e-9, 1e-9, 1e-9], [1e-9, 1e-9, 1e-9, 0.5, 0.4, 0.1]])
    tree = build_tree(logits, budget=5, top_k=3)
    # path scores: a .6, ax .3, b .29, ay .24, bx .145, by .116, c .11, ...
    assert list(zip(tree.tokens, tree.parents, tree.depths, strict=True)) == [
        (0, -1, 1),  # a
        (3, 0, 2),  # ax
        (1, -1, 1),  # b
        (4, 0, 2),  # ay
        (3, 2, 2),  # bx (b is node 2)
    ]
    assert build_tree(logits, budget=2, top_k=3).tokens == [0, 3]
    assert (
        build_tree(logits, budget=100, top_k=2).tokens.__len__() == 2 + 2 * 2
    )  # every path of top-2 x top-2


def test_acceptance_is_the_longest_prefix_on_a_path_and_the_mask_sees_ancestors_only():
    logits = log_probs_to_logits([[0.6, 0.3, 0.1, 1e-9], [1e-9, 0.2, 0.1, 0.7]])
    # top-2 a .6, b .3 then d .7, b .2: a .6, ad .42, b .3, bd .21 (ab .12 is past the budget)
    tree = build_tree(logits, budget=4, top_k=2)
    assert tree.tokens == [0, 3, 1, 3] and tree.parents == [-1, 0, -1, 2]
    assert tree.accepted([0, 3, 9]) == 2 and tree.accepted([1, 3]) == 2
    assert tree.accepted([0, 1]) == 1  # a -> b is not in the tree
    assert tree.accepted([2]) == 0
    visible = tree.visibility()
    assert visible.tolist() == [
        [True, False, False, False, False],  # the root sees itself
        [True, True, False, False, False],  # a
        [True, True, True, False, False],  # a -> d
        [True, False, False, True, False],  # b: not a
        [True, False, False, True, True],  # b -> d: not a, not a -> d
    ]


def best_paths_by_enumeration(logits: torch.Tensor, budget: int, top_k: int) -> list[tuple[int, ...]]:
    """Every path of the per-depth top-K lists from depth 1 on, scored by its summed log-probabilities
    (left to right, as the tree adds them), the `budget` best first: what `build_tree` must take."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    ranked = [
        sorted(range(logits.shape[1]), key=lambda t, row=row: -row[t])[:top_k] for row in log_probs.tolist()
    ]
    scored = []
    for depth in range(1, len(ranked) + 1):
        for path in itertools.product(*ranked[:depth]):
            score = 0.0
            for level, token in enumerate(path):
                score += float(log_probs[level, token])
            scored.append((score, path))
    scored.sort(key=lambda item: -item[0])
    return [path for _, path in scored[:budget]]


def tree_paths(tree) -> list[tuple[int, ...]]:
    """Each node's tokens from the root down to it, in the tree's node order."""
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tree.tokens, tree.parents, strict=True):
        paths.append((*(paths[parent] if parent >= 0 else ()), token))
    return paths


@pytest.mark.parametrize("seed", range(4))
def test_the_tree_is_the_best_budget_paths_of_a_brute_force_enumeration(seed):
    """On random logits, every budget: a wrong score for a sibling or a child still makes a tree (and
    verification stays lossless) but not the best one, so acceptance silently drops."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 7, generator=generator) * 2
    for top_k in (1, 3):
        every = best_paths_by_enumeration(logits, 10**6, top_k)
        for budget in (1, 2, 5, 13, 40, len(every), len(every) + 3):
            tree = build_tree(logits, budget, top_k)
            assert tree_paths(tree) == every[:budget], (top_k, budget)
            assert tree.depths == [len(path) for path in every[:budget]]


def test_bad_budgets_are_one_line_user_errors():
    with pytest.raises(UserError, match=r"budget and top-k must be >= 1, got budget 0"):
        build_tree(torch.zeros(3, 8), budget=0, top_k=4)


class RankedDrafter(DFlashDrafter):
    """Drafts from the known greedy continuation: at depth d of the block rooted at position p the
    true token gets rank `rank(p, d)` (logits fall by 1 per rank), so the test knows which tree
    holds it. Also checks that the context cache holds the tokens before each root, in order (the
    loop's holds exactly those, the replay's the whole sequence)."""

    def __init__(self, arch, prompt_length, continuation, rank):
        super().__init__(arch, seed=0)
        self.prompt_length, self.continuation, self.rank = prompt_length, continuation, rank

    def blocks_logits(self, cache, anchor_tokens, anchor_positions, embed_tokens, lm_head):
        return torch.stack([self._block(cache, int(position)) for position in anchor_positions])

    def _block(self, cache, position):
        assert torch.equal(cache.positions[:position], torch.arange(position)), "context cache out of step"
        vocab, depth = self.arch.vocab_size, self.arch.block_size - 1
        start = position + 1 - self.prompt_length
        truth = (self.continuation + [0] * depth)[start : start + depth]
        rows = []
        for d, token in enumerate(truth, start=1):
            order = [
                t
                for t in torch.randperm(
                    vocab, generator=torch.Generator().manual_seed(position * 31 + d)
                ).tolist()
                if t != token
            ]
            order.insert(self.rank(position, d), token)
            row = torch.empty(vocab)
            row[torch.tensor(order)] = -torch.arange(vocab, dtype=torch.float)
            rows.append(row)
        return torch.stack(rows)


def pattern(position: int, depth: int) -> int:
    """Rank of the true token: the top one, but the second at every third (position + depth)."""
    return 1 if (position + depth) % 3 == 0 else 0


@pytest.fixture(scope="module")
def scripted():
    raw = random_target_config()
    raw["drafter"]["block_size"] = 6
    target, drafter = target_and_drafter(raw)
    greedy = greedy_reference(target, PROMPT, NEW_TOKENS, None)
    ranked = RankedDrafter(drafter.arch, len(PROMPT), greedy, pattern)
    return target, ranked, greedy


def test_top_1_with_budget_b_minus_1_is_the_chain_round_for_round(scripted):
    target, drafter, greedy = scripted
    chain = speculative_generate(target, drafter, PROMPT, NEW_TOKENS)
    assert chain.tokens == greedy
    assert max(chain.acceptance_lengths) > 1  # the test drafts some right tokens
    depth = drafter.arch.block_size - 1
    replayed = replay_prompt(target, drafter, PROMPT, greedy, [depth], top_k=1)
    assert replayed.trees == {depth: chain.acceptance_lengths}
    assert replayed.chain.acceptance_lengths == chain.acceptance_lengths


def test_a_tree_holding_the_top_1_chain_accepts_at_least_as_much_at_every_root(scripted):
    target, drafter, greedy = scripted
    depth, better, holding = drafter.arch.block_size - 1, 0, 0
    features = target.features(torch.tensor([PROMPT + greedy]))[0]
    for emitted in range(1, len(greedy) - depth):
        position = len(PROMPT) + emitted - 1
        context = drafter.new_cache()
        drafter.extend_context(features[:position], torch.arange(position), context)
        logits = drafter.draft_logits(context, greedy[emitted - 1], position, None, None)
        continuation = greedy[emitted : emitted + depth]
        top_1 = build_tree(logits, budget=depth, top_k=1)
        chain = top_1.accepted(continuation)
        tree = build_tree(logits, budget=32, top_k=4)
        if tree.accepted(top_1.tokens) == depth:  # the tree holds the top-1 chain
            holding += 1
            assert tree.accepted(continuation) >= chain, emitted
            better += tree.accepted(continuation) > chain
    assert holding > len(greedy) // 2 and better > 0  # true tokens at rank 1-4: a tree finds some


def test_tree_acceptance_from_the_greedy_decode_equals_a_real_tree_verification_forward(scripted):
    target, drafter, greedy = scripted
    tokens, verified = verified_tree_decode(target, drafter, PROMPT, NEW_TOKENS, NO_STOP, budget=32, top_k=3)
    assert tokens == greedy  # lossless
    simulated = replay_prompt(target, drafter, PROMPT, greedy, [32], top_k=3).trees[32]
    assert simulated == verified
    chain = speculative_generate(target, drafter, PROMPT, NEW_TOKENS).acceptance_lengths
    assert sum(simulated) == sum(chain) and len(simulated) < len(chain)  # fewer rounds, same tokens
    assert sum(simulated) / len(simulated) > sum(chain) / len(chain) and not math.isnan(sum(simulated))


def test_the_lossless_check_compares_chain_and_real_tree_with_the_greedy_decode(scripted):
    target, drafter, _ = scripted
    greedy = speculative_generate(target, drafter, PROMPT, NEW_TOKENS).tokens
    result = evaluate_replay(target, drafter, [PROMPT], [greedy], [32], top_k=3)
    check = check_lossless(target, drafter, [PROMPT], result, NEW_TOKENS, [])
    assert check.ok and (check.chain_equal, check.tree_equal, check.tree_budget) == (1, 1, 32)

    result.per_prompt[0].tokens[5] += 1  # a chain that emitted another token
    result.trees[0].acceptance_lengths[0][0] += 1  # tree tau computed from other rounds
    broken = check_lossless(target, drafter, [PROMPT], result, NEW_TOKENS, [])
    assert not broken.ok and (broken.chain_equal, broken.tree_equal) == (0, 0)
    assert broken.first_mismatch == [
        "prompt 0: the chain's output or rounds differ from the greedy decode or the loop",
        "prompt 0: tree verification differs",
    ]


def test_the_lossless_check_fails_when_any_one_of_several_prompts_mismatches(scripted):
    """Three prompts: one prompt's chain, or one prompt's tree, differing (the middle or the last one,
    not the first) fails the whole check and is named; the others still count as equal."""
    target, drafter, _ = scripted
    # the drafter drafts PROMPT's continuation at any position: prompts of its length keep it in range
    prompts = [PROMPT, [9, 8, 7, 6, 5, 4, 3], [101, 17, 3, 250, 11, 42, 5]]
    answers = [speculative_generate(target, drafter, prompt, 16).tokens for prompt in prompts]
    result = evaluate_replay(target, drafter, prompts, answers, [32], top_k=3)
    # each check counts the prompts that stayed equal: the unbroken ones pass as they must
    result.per_prompt[1].acceptance_lengths[0] += 1  # the middle prompt's chain rounds differ
    chain = check_lossless(target, drafter, prompts, result, 16, [])
    assert not chain.ok and (chain.chain_equal, chain.tree_equal) == (2, 3)
    assert chain.first_mismatch == [
        "prompt 1: the chain's output or rounds differ from the greedy decode or the loop"
    ]
    result.per_prompt[1].acceptance_lengths[0] -= 1

    result.trees[0].acceptance_lengths[2][-1] += 1  # the last prompt's tree tau from other rounds
    tree = check_lossless(target, drafter, prompts, result, 16, [])
    assert not tree.ok and (tree.chain_equal, tree.tree_equal) == (3, 2)
    assert tree.first_mismatch == ["prompt 2: tree verification differs"]


def test_a_tree_verified_on_the_kv_cache_gives_the_logits_and_features_of_the_uncached_forward(scripted):
    """What `dflash bench tree` times (the verification forward after a KV-cached context) computes
    what the real tree verification does over the whole sequence."""
    target, drafter, greedy = scripted
    accepted = torch.tensor(PROMPT + greedy[:5])
    context = drafter.new_cache()
    features = target.features(accepted[None])[0]
    drafter.extend_context(features, torch.arange(len(accepted)), context)
    tree = build_tree(drafter.draft_logits(context, greedy[5], len(accepted), None, None), 12, 3)
    block = torch.tensor([greedy[5], *tree.tokens])
    logits, block_features = _masked_forward(target, accepted, tree, block)

    session = CachedTarget(target, DynamicCache(config=target.model.config))
    session.forward(accepted, 1)
    session.commit(len(accepted))
    bias, positions = tree_verification_inputs(tree, len(accepted), target.dtype, accepted.device)
    for _ in range(2):  # the second verification sees the context the first one left
        cached_logits, cached_features = session.forward(block, len(block), bias, positions)
        session.commit(0)
        torch.testing.assert_close(cached_logits, logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cached_features, block_features, atol=1e-5, rtol=1e-5)
    assert session.cache.get_seq_length() == len(accepted)


def test_bench_tree_times_a_round_s_parts_per_budget_and_refuses_a_hybrid_target(
    tmp_path, capsys, monkeypatch
):
    """The `dflash` entry point in this process: a new interpreter per call cost ~10 s of CPU each."""
    config = tmp_path / "tree.json"
    config.write_text(json.dumps(random_target_config()))
    result = dflash(
        capsys,
        monkeypatch,
        "bench",
        "tree",
        str(config),
        "--budgets",
        "2,16",
        "--context",
        "24",
        "--repeats",
        "2",
    )
    assert result.returncode == 0, result.stderr
    assert "drafter block forward (draft_logits):" in result.stdout
    rows = [line.split() for line in result.stdout.splitlines() if line.split()[:1] in (["2"], ["16"])]
    # block size 4: 3 depths of top-8, so budget 16 takes 16 of the 8 + 64 + 512 nodes there are
    assert [(row[0], row[1]) for row in rows] == [("2", "2"), ("16", "16")]
    assert all(float(row[2]) > 0 and float(row[3]) > 0 and row[4].endswith("%") for row in rows)

    hybrid = tmp_path / "hybrid.json"
    hybrid.write_text(json.dumps({"target": {"architecture": ARCHITECTURES["qwen3_5_text"]},
                                  "drafter": {"num_layers": 1, "mask_token_id": 3}}))  # fmt: skip
    refused = dflash(capsys, monkeypatch, "bench", "tree", str(hybrid))
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        "dflash: error: bench tree: the target has linear-attention layers, which take no ancestor "
        "mask; time tree verification on an attention-only target"
    ]


def test_the_verification_rows_see_the_context_the_root_and_their_ancestors_in_the_target_s_dtype():
    """Nodes 0 and 2 hang under the root, node 1 under node 0; two tokens accepted before the root."""
    tree = DraftTree(tokens=[11, 12, 13], parents=[-1, 0, -1], depths=[1, 2, 1])
    bias, positions = tree_verification_inputs(tree, 2, torch.bfloat16, torch.device("cpu"))
    visible = torch.tensor(
        [
            [1, 1, 1, 0, 0, 0],  # the root: the context and itself
            [1, 1, 1, 1, 0, 0],  # node 0: and the root
            [1, 1, 1, 1, 1, 0],  # node 1: the root and node 0
            [1, 1, 1, 0, 0, 1],  # node 2: the root, not its sibling's branch
        ],
        dtype=torch.bool,
    )
    low = torch.finfo(torch.bfloat16).min
    assert bias.dtype == torch.bfloat16
    assert torch.equal(bias, torch.zeros(4, 6, dtype=torch.bfloat16).masked_fill(~visible, low))
    assert positions.tolist() == [2, 3, 4, 3]  # past + depth


def test_the_verification_forward_makes_every_tensor_on_the_target_s_device():
    """On the meta device (shapes only, no data): a mask, bias or position made on the default device
    instead of the target's would meet the target's tensors in one op and fail, as on a GPU."""
    meta = torch.device("meta")
    tree = DraftTree(tokens=[11, 12, 13], parents=[-1, 0, -1], depths=[1, 2, 1])
    bias, positions = tree_verification_inputs(tree, 2, torch.float32, meta)
    assert (bias.device, positions.device, tuple(bias.shape)) == (meta, meta, (4, 6))
    target, _ = target_and_drafter(random_target_config())
    target.model.to(meta)
    accepted, block = torch.tensor(PROMPT, device=meta), torch.tensor([3, 11, 12, 13], device=meta)
    logits, features = _masked_forward(target, accepted, tree, block)
    assert (logits.device, tuple(logits.shape), tuple(features.shape)) == (meta, (4, 300), (4, 128))


def test_a_bf16_target_verifies_a_tree_as_its_fp32_self():
    """A GPU run's target is bf16: the context's bias is made in the target's dtype like the tree's
    (attention takes one mask dtype)."""
    target, _ = target_and_drafter(random_target_config())
    tree = DraftTree(tokens=[11, 12, 13], parents=[-1, 0, -1], depths=[1, 2, 1])
    accepted, block = torch.tensor(PROMPT), torch.tensor([3, 11, 12, 13])
    reference, _ = _masked_forward(target, accepted, tree, block)
    target.model.to(torch.bfloat16)
    logits, features = _masked_forward(target, accepted, tree, block)
    assert logits.dtype == features.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), reference, atol=0.05, rtol=0.05)
