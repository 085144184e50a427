"""The target's own predictability on its answers (`app.evaluate.predictability`): each answer token's
entropy and top-1 probability, equal to a token-by-token brute force, pooled per domain."""

from __future__ import annotations

import math

import pytest
import torch

from app.evaluate.predictability import SURE, UNSURE, _summary, answer_predictability, describe_predictability
from tests.test_speculative import greedy_reference, random_target_config, target_and_drafter

PROMPTS = [[5, 17, 42, 99, 3], [8], list(range(60, 70))]
DOMAINS = ["code", "prose", "code"]


@pytest.fixture(scope="module")
def target():
    return target_and_drafter(random_target_config())[0]


def brute_force(target, prompt: list[int], answer: list[int]) -> list[tuple[float, float]]:
    """(entropy in bits, top-1 probability) of the target's distribution over each answer token, one
    forward of the growing prefix per token."""
    values = []
    for k in range(len(answer)):
        with torch.no_grad():
            logits = target.model(input_ids=torch.tensor([prompt + answer[:k]])).logits[0, -1]
        probs = logits.double().softmax(-1)
        values.append((float(-(probs * probs.log2()).sum()), float(probs.max())))
    return values


def test_each_answer_token_s_entropy_and_top1_pooled_per_domain_equal_the_brute_force(target):
    answers = [greedy_reference(target, prompt, 7, None) for prompt in PROMPTS]
    answers[1] = answers[1][:3]  # answers of different lengths weigh by their tokens
    table = answer_predictability(target, PROMPTS, answers, DOMAINS)
    per_token = [brute_force(target, p, a) for p, a in zip(PROMPTS, answers, strict=True)]
    for name, members in {"all": [0, 1, 2], "code": [0, 2], "prose": [1]}.items():
        pooled = [value for i in members for value in per_token[i]]
        row = table[name]
        assert row["tokens"] == len(pooled)
        assert row["entropy_bits"] == pytest.approx(math.fsum(e for e, _ in pooled) / len(pooled), rel=1e-4)
        assert row["top1_prob"] == pytest.approx(math.fsum(p for _, p in pooled) / len(pooled), rel=1e-4)
        assert row["sure"] == sum(p >= SURE for _, p in pooled) / len(pooled)
        assert row["unsure"] == sum(p < UNSURE for _, p in pooled) / len(pooled)
    assert list(table) == ["all", "code", "prose"]
    assert describe_predictability(table)[2].startswith("target's answers, prose: 3 tokens, entropy ")


def test_an_empty_answer_adds_no_token_and_no_domains_pool_into_all(target):
    answer = greedy_reference(target, PROMPTS[0], 4, None)
    table = answer_predictability(target, PROMPTS[:2], [answer, []])
    assert list(table) == ["all"] and table["all"]["tokens"] == 4


def test_sure_counts_a_top1_of_0_9_and_unsure_one_under_0_5_and_each_domain_prints_one_line():
    table = {"all": _summary([1.0, 0.5, 3.0, 1.5], [SURE, 0.95, UNSURE, 0.49])}
    assert table["all"] == {
        "tokens": 4,
        "entropy_bits": 1.5,
        "top1_prob": (SURE + 0.95 + UNSURE + 0.49) / 4,
        "sure": 0.5,
        "unsure": 0.25,
    }
    table["code"] = _summary([2.0], [0.6])
    assert describe_predictability(table) == [
        "target's answers, all: 4 tokens, entropy 1.50 bits/token, top-1 probability 0.71; sure (>= 0.9) "
        "of 50%, unsure (< 0.5) of 25%",
        "target's answers, code: 1 tokens, entropy 2.00 bits/token, top-1 probability 0.60; sure (>= 0.9) "
        "of 0%, unsure (< 0.5) of 0%",
    ]


def test_an_empty_answer_between_others_is_passed_over_and_an_unnamed_domain_pools_only_into_all(target):
    answers = [greedy_reference(target, prompt, 3, None) for prompt in PROMPTS]
    table = answer_predictability(target, PROMPTS, [answers[0], [], answers[2]], ["", "prose", "code"])
    assert list(table) == ["all", "code"] and table["all"]["tokens"] == 6 and table["code"]["tokens"] == 3


def test_the_target_runs_under_the_asked_autocast(target):
    answers = [greedy_reference(target, prompt, 4, None) for prompt in PROMPTS]
    plain = answer_predictability(target, PROMPTS, answers)
    half = answer_predictability(target, PROMPTS, answers, autocast_dtype=torch.bfloat16)
    assert half["all"]["tokens"] == plain["all"]["tokens"]
    assert half["all"]["entropy_bits"] != plain["all"]["entropy_bits"]
    assert half["all"]["entropy_bits"] == pytest.approx(plain["all"]["entropy_bits"], rel=0.05)
