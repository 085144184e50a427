"""Losslessness, checked rather than assumed (`dflash eval --check-lossless`).

Greedy verification must emit exactly the target's own greedy decode, chain or tree, and eval's tau
rests on it: it replays the rounds from the greedy decode (`app.evaluate.replay`). The check decodes
every prompt plainly with the target (Hugging Face `generate`, greedy, one prompt at a time, the same
stop tokens and budget), runs the real speculative loop (`speculative_generate`, one target forward
per round) and requires the loop's output and the replay's answer to equal it and the loop's
acceptance lengths to equal the replayed ones. On an attention-only target it also runs the real
tree-verification forward (`verified_tree_decode`) at the first tree budget and compares its output
with the greedy decode and its acceptance lengths with the replayed tree's. A hybrid target takes no
ancestor mask, so there the tree's acceptance rests on the chain's.

On a GPU in bf16 an incremental decode and a block verification round differently, so a mismatch
there can be numerics rather than a bug: the check counts, names the first differing prompt of the
chain and of the tree, and leaves the verdict to the caller.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from app.evaluate.result import EvalResult
from app.evaluate.speculative import speculative_generate
from app.evaluate.tree import verified_tree_decode
from app.model.drafter import DFlashDrafter
from app.model.target import TargetModel


@dataclass
class LosslessCheck:
    """How many prompts decoded exactly as the target's plain greedy decode."""

    prompts: int
    chain_equal: int
    tree_budget: int | None
    """The budget the real tree-verification forward ran at; None when it did not run."""
    tree_equal: int = 0
    """Prompts whose real tree-verified decode equals the greedy decode and tree tau's acceptance."""
    first_mismatch: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        tree_ok = self.tree_budget is None or self.tree_equal == self.prompts
        return self.chain_equal == self.prompts and tree_ok

    def describe(self) -> str:
        line = (
            f"lossless: the speculative loop's output equals the target's greedy decode, and its rounds the "
            f"replayed ones, on {self.chain_equal}/{self.prompts} prompts"
        )
        if self.tree_budget is None:
            line += "; tree: not verified by a real forward (the target's layers take no ancestor mask)"
        else:
            line += (
                f"; the real tree-verification forward (budget {self.tree_budget}) equals it and tree tau's "
                f"acceptance on {self.tree_equal}/{self.prompts}"
            )
        return line + (f" (first mismatch: {'; '.join(self.first_mismatch)})" if self.first_mismatch else "")


def greedy_decode(
    target: TargetModel, prompt: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int]
) -> list[int]:
    """The target's own greedy continuation, cut just after the first stop token."""
    input_ids = torch.tensor([list(prompt)], device=target.device)
    output = target.model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=list(stop_ids) or None,
        pad_token_id=0,
    )
    return output[0, len(prompt) :].tolist()  # one row: generate stops right after its first stop token


@torch.inference_mode()
def check_lossless(
    target: TargetModel,
    drafter: DFlashDrafter,
    prompts: Sequence[Sequence[int]],
    result: EvalResult,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    autocast_dtype: torch.dtype | None = None,
) -> LosslessCheck:
    """Compare `result`'s decodes of `prompts` with the target's plain greedy decode (module docstring)."""
    layer_types = getattr(target.text_config, "layer_types", None) or []
    tree = result.trees[0] if result.trees and all(kind == "full_attention" for kind in layer_types) else None
    check = LosslessCheck(len(prompts), 0, tree.budget if tree else None)
    chain_differs: list[int] = []
    tree_differs: list[int] = []
    for index, (prompt, decoded) in enumerate(zip(prompts, result.per_prompt, strict=True)):
        greedy = greedy_decode(target, prompt, max_new_tokens, stop_ids)
        loop = speculative_generate(target, drafter, prompt, max_new_tokens, stop_ids, autocast_dtype)
        equal = (
            loop.tokens == greedy == decoded.tokens and loop.acceptance_lengths == decoded.acceptance_lengths
        )
        check.chain_equal += equal
        if not equal:
            chain_differs.append(index)
        if tree is None:
            continue
        tokens, lengths = verified_tree_decode(
            target,
            drafter,
            prompt,
            max_new_tokens,
            frozenset(stop_ids),
            tree.budget,
            tree.top_k,
            autocast_dtype,
        )
        equal = tokens == greedy and lengths == tree.acceptance_lengths[index]
        check.tree_equal += equal
        if not equal:
            tree_differs.append(index)
    # the first differing prompt of each kind: a chain mismatch after a tree mismatch is still named
    check.first_mismatch += [
        f"prompt {index}: the chain's output or rounds differ from the greedy decode or the loop"
        for index in chain_differs[:1]
    ]
    check.first_mismatch += [f"prompt {index}: tree verification differs" for index in tree_differs[:1]]
    return check
