"""DDTree verified for real: the target's forward over the accepted sequence plus the tree under its
ancestor mask (`app.model.tree`).

Greedy tree verification is lossless, so a round accepts exactly the longest prefix of the target's
own greedy continuation that is a path of the tree: eval computes tree acceptance that way, from the
greedy decode (`app.evaluate.replay`), which needs no tree-masked target forward and so covers hybrid
targets, whose linear-attention layers take no ancestor mask. `verified_tree_decode` runs the real
verification on an attention-only target; the two agree round for round (tests/test_tree.py), and
`dflash eval --check-lossless` runs it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from app.errors import UserError
from app.evaluate.speculative import cut_round, drafter_autocast, tapped_features
from app.model.drafter import DFlashDrafter
from app.model.target import TargetModel
from app.model.tree import DraftTree, build_tree


@torch.inference_mode()
def verified_tree_decode(
    target: TargetModel,
    drafter: DFlashDrafter,
    prompt: Sequence[int],
    max_new_tokens: int,
    stop_ids: frozenset[int],
    budget: int,
    top_k: int,
    autocast_dtype: torch.dtype | None = None,
) -> tuple[list[int], list[int]]:
    """The real thing on an attention-only target: each round one target forward over the accepted
    sequence plus the tree under its ancestor mask. Returns the generated tokens and each round's
    acceptance length."""
    if any(kind != "full_attention" for kind in getattr(target.text_config, "layer_types", None) or []):
        raise UserError("tree verification forward: the target has layers that take no ancestor mask")
    device = target.device
    accepted = torch.tensor(list(prompt), dtype=torch.long, device=device)
    logits, features = _masked_forward(target, accepted, None)
    context = drafter.new_cache()
    with drafter_autocast(drafter, autocast_dtype):
        drafter.extend_context(features, torch.arange(len(prompt), device=device), context)
    tokens, lengths = [int(logits[-1].argmax())], []
    while len(tokens) < max_new_tokens and tokens[-1] not in stop_ids:
        position = len(accepted)  # the root: the last emitted token
        root = torch.tensor([tokens[-1]], device=device)
        with drafter_autocast(drafter, autocast_dtype):
            logits = drafter.draft_logits(context, root[0], position, target.embed_tokens, target.lm_head)
        tree = build_tree(logits, budget, top_k)
        block = torch.cat([root, torch.tensor(tree.tokens, dtype=torch.long, device=device)])
        logits, features = _masked_forward(target, accepted, tree, block)
        predicted = logits.argmax(dim=-1).tolist()  # the target's token after the root and each node
        path = tree.walk(lambda node, depth, predicted=predicted: predicted[node + 1])
        emitted = [tree.tokens[node] for node in path] + [predicted[path[-1] + 1 if path else 0]]
        emitted = cut_round(emitted, max_new_tokens - len(tokens), stop_ids)
        kept = torch.tensor([0, *[node + 1 for node in path]][: len(emitted)], device=device)
        with drafter_autocast(drafter, autocast_dtype):
            drafter.extend_context(
                features[kept], position + torch.arange(len(emitted), device=device), context
            )
        accepted = torch.cat([accepted, block[kept]])
        tokens += emitted
        lengths.append(len(emitted))
    return tokens, lengths


def _masked_forward(
    target: TargetModel, accepted: torch.Tensor, tree: DraftTree | None, block: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits `[n, V]` and tapped features `[n, K*H]` of `block` (or of `accepted` when there is no
    tree) after the accepted sequence, each block token seeing the sequence and its own ancestors, at
    position len(accepted) + its depth."""
    if tree is None:
        output = target.model(input_ids=accepted[None], use_cache=False, output_hidden_states=True)
        return output.logits[0], tapped_features(target, output.hidden_states)
    past, device = len(accepted), accepted.device
    block_bias, block_positions = tree_verification_inputs(tree, past, target.dtype, device)
    causal = torch.ones(past, past, dtype=torch.bool, device=device).tril()
    context_bias = torch.zeros(past, past + len(block), dtype=target.dtype, device=device)
    context_bias[:, :past].masked_fill_(~causal, torch.finfo(target.dtype).min)
    context_bias[:, past:] = torch.finfo(target.dtype).min
    output = target.model(
        input_ids=torch.cat([accepted, block])[None],
        attention_mask=torch.cat([context_bias, block_bias])[None, None],
        position_ids=torch.cat([torch.arange(past, device=device), block_positions])[None],
        use_cache=False,
        output_hidden_states=True,
    )
    return output.logits[0, past:], tapped_features(target, output.hidden_states)[past:]


def tree_verification_inputs(
    tree: DraftTree, past: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The verification forward's rows for the root and the tree's nodes after `past` accepted
    tokens: the additive attention bias `[1 + N, past + 1 + N]` (each sees the accepted sequence, the
    root and its ancestors) and the positions `[1 + N]` (past + depth)."""
    visible = torch.ones(len(tree.tokens) + 1, past + len(tree.tokens) + 1, dtype=torch.bool, device=device)
    visible[:, past:] = tree.visibility().to(device)
    bias = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(
        ~visible, torch.finfo(dtype).min
    )
    return bias, past + torch.tensor([0, *tree.depths], device=device)
