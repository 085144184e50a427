"""How predictable the target's own answers are: what bounds any drafter's acceptance on them.

Greedy verification accepts a draft only where it is the target's argmax. Where the target is sure of
its next token (top-1 probability near 1) that token follows from the context; where it hesitates
between near-equal choices, its argmax turns on details only the whole target computes, and a drafter
that reads a few of its layers and runs two or three of its own errs there most. Per answer token this
measures the entropy of the target's next-token distribution and its top-1 probability, per domain: a
low acceptance on a domain whose answers are mostly unsure says the target, not the recipe, limits it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from app.model.target import TargetModel

SURE = 0.9
"""A top-1 probability at or above this: the target is sure of its token."""
UNSURE = 0.5
"""A top-1 probability under this: another token is about as likely as the argmax."""


@torch.inference_mode()
def answer_predictability(
    target: TargetModel,
    prompts: Sequence[Sequence[int]],
    answers: Sequence[Sequence[int]],
    domains: Sequence[str] | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> dict[str, dict[str, Any]]:
    """Per domain (and "all"): answer tokens, mean entropy in bits of the target's distribution over
    each, mean top-1 probability, and the shares of tokens it is sure / unsure of (one target forward
    per prompt and answer)."""
    entropies: dict[str, list[float]] = {"all": []}
    top1: dict[str, list[float]] = {"all": []}
    for index, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
        if not answer:
            continue
        sequence = torch.tensor([[*prompt, *answer]], dtype=torch.long, device=target.device)
        with torch.autocast(target.device.type, autocast_dtype, enabled=autocast_dtype is not None):
            logits = target.model(input_ids=sequence).logits[0]
        # position i predicts token i + 1: the answer's tokens from the prompt's last position on
        probs = logits[len(prompt) - 1 : len(prompt) + len(answer) - 1].float().softmax(-1)
        entropy = -(probs * probs.clamp(min=1e-30).log2()).sum(-1)
        names = ["all"] + ([domains[index]] if domains is not None and domains[index] else [])
        for name in names:
            entropies.setdefault(name, []).extend(entropy.tolist())
            top1.setdefault(name, []).extend(probs.max(-1).values.tolist())
    return {name: _summary(entropies[name], top1[name]) for name in entropies if entropies[name]}


def _summary(entropy: list[float], top1: list[float]) -> dict[str, Any]:
    count = len(entropy)
    return {
        "tokens": count,
        "entropy_bits": math.fsum(entropy) / count,
        "top1_prob": math.fsum(top1) / count,
        "sure": sum(p >= SURE for p in top1) / count,
        "unsure": sum(p < UNSURE for p in top1) / count,
    }


def describe_predictability(table: dict[str, dict[str, Any]]) -> list[str]:
    """One line per domain: what the target's own answers allow."""
    return [
        f"target's answers, {name}: {row['tokens']} tokens, entropy {row['entropy_bits']:.2f} bits/token, "
        f"top-1 probability {row['top1_prob']:.2f}; sure (>= {SURE}) of {row['sure']:.0%}, "
        f"unsure (< {UNSURE}) of {row['unsure']:.0%}"
        for name, row in table.items()
    ]
