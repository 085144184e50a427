"""The target's own predictability on its answers (`app.evaluate.predictability`): each answer token's
entropy and top-1 probability, equal to a token-by-token brute force, pooled per domain."""

from __future__ import annotations

import math

import pytest
import torch

from app.evaluate.predictability import SURE, UNSURE, answer_predictability, describe_predictability
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
