"""Synthetic packed drafter rows: the real row layout (documents, padding, anchors) with random tokens."""

from __future__ import annotations

import itertools

import torch

from app.data.batch import DrafterRow


def synthetic_row(
    token_budget: int,
    anchors: int,
    vocab_size: int,
    *,
    num_documents: int = 4,
    padding: int = 0,
    valid_anchors: int | None = None,
    prompt_fraction: float = 0.25,
    generator: torch.Generator | None = None,
) -> DrafterRow:
    """A row of `num_documents` documents packed into `token_budget - padding` tokens, then padding.

    Each document's first `prompt_fraction` is unsupervised (the prompt); anchors are sampled like the
    data pipeline does: uniformly without replacement among supervised positions whose next token is
    supervised and in the same document, sorted; `valid_anchors` (default: all `anchors`) caps how many
    slots are used, the rest are dead (anchor 0, invalid).
    """
    real = token_budget - padding
    if num_documents < 1 or real < 2 * num_documents:
        raise ValueError(f"synthetic_row: {num_documents} documents do not fit in {real} tokens")
    cuts = torch.randperm(real - 1, generator=generator)[: num_documents - 1].sort().values + 1
    bounds = [0, *cuts.tolist(), real]
    input_ids = torch.randint(0, vocab_size, (token_budget,), generator=generator)
    position_ids = torch.zeros(token_budget, dtype=torch.long)
    document_ids = torch.full((token_budget,), -1, dtype=torch.int32)
    loss_mask = torch.zeros(token_budget, dtype=torch.bool)
    for document, (start, stop) in enumerate(itertools.pairwise(bounds)):
        position_ids[start:stop] = torch.arange(stop - start)
        document_ids[start:stop] = document
        loss_mask[start + int((stop - start) * prompt_fraction) : stop] = True
    input_ids[real:] = 0

    same_document_next = torch.zeros(token_budget, dtype=torch.bool)
    same_document_next[:-1] = document_ids[:-1] == document_ids[1:]
    eligible_next = torch.zeros(token_budget, dtype=torch.bool)
    eligible_next[:-1] = loss_mask[1:]
    eligible = (loss_mask & eligible_next & same_document_next).nonzero().squeeze(1)
    wanted = min(anchors if valid_anchors is None else valid_anchors, anchors, eligible.numel())
    chosen = eligible[torch.randperm(eligible.numel(), generator=generator)[:wanted]].sort().values
    anchor_positions = torch.zeros(anchors, dtype=torch.long)
    anchor_positions[:wanted] = chosen
    anchor_valid = torch.zeros(anchors, dtype=torch.bool)
    anchor_valid[:wanted] = True
    return DrafterRow(
        input_ids=input_ids,
        position_ids=position_ids,
        document_ids=document_ids,
        loss_mask=loss_mask,
        anchor_positions=anchor_positions,
        anchor_valid=anchor_valid,
    )
