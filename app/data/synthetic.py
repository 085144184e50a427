"""Synthetic packed drafter rows: the real row layout (documents, padding, anchors) with random tokens."""

from __future__ import annotations

import itertools

import torch

from app.data.batch import DrafterRow
from app.data.packing import sample_anchors


def synthetic_row(
    token_budget: int,
    anchors: int,
    vocab_size: int,
    *,
    num_documents: int = 4,
    document_length: int | None = None,
    padding: int = 0,
    valid_anchors: int | None = None,
    prompt_fraction: float = 0.25,
    generator: torch.Generator | None = None,
) -> DrafterRow:
    """A row of `num_documents` documents packed into `token_budget - padding` tokens, then padding.

    `document_length` set: documents of exactly that many tokens instead (the last holds the
    remainder), as a full batch of a run's longest samples packs: the most attention work a real
    row of that `data.max_length` can hold. Random cuts can make one document longer than any real
    sample (the peers' step benchmarks feed sequences of one length, too).

    Each document's first `prompt_fraction` is unsupervised (the prompt); anchors are sampled by the data
    pipeline's own `sample_anchors`; `valid_anchors` (default: all `anchors`) caps how many
    slots are used, the rest are dead (anchor 0, invalid).
    """
    real = token_budget - padding
    bounds = _document_bounds(real, num_documents, document_length, generator)
    input_ids = torch.randint(0, vocab_size, (token_budget,), generator=generator)
    position_ids = torch.zeros(token_budget, dtype=torch.long)
    document_ids = torch.full((token_budget,), -1, dtype=torch.int32)
    loss_mask = torch.zeros(token_budget, dtype=torch.bool)
    for document, (start, stop) in enumerate(itertools.pairwise(bounds)):
        position_ids[start:stop] = torch.arange(stop - start)
        document_ids[start:stop] = document
        loss_mask[start + int((stop - start) * prompt_fraction) : stop] = True
    input_ids[real:] = 0

    wanted = anchors if valid_anchors is None else min(valid_anchors, anchors)
    chosen, chosen_valid = sample_anchors(document_ids, loss_mask, wanted, generator)
    anchor_positions = torch.zeros(anchors, dtype=torch.long)
    anchor_positions[:wanted] = chosen
    anchor_valid = torch.zeros(anchors, dtype=torch.bool)
    anchor_valid[:wanted] = chosen_valid
    return DrafterRow(
        input_ids=input_ids,
        position_ids=position_ids,
        document_ids=document_ids,
        loss_mask=loss_mask,
        anchor_positions=anchor_positions,
        anchor_valid=anchor_valid,
    )


def _document_bounds(
    real: int, num_documents: int, document_length: int | None, generator: torch.Generator | None
) -> list[int]:
    """Where the documents of a row's `real` tokens begin, and its end: every `document_length`
    tokens, or `num_documents` at random cuts."""
    if document_length is not None:
        if document_length < 2:
            raise ValueError(f"synthetic_row: document_length must be >= 2, got {document_length}")
        return [*range(0, real, document_length), real]
    if num_documents < 1 or real < 2 * num_documents:
        raise ValueError(f"synthetic_row: {num_documents} documents do not fit in {real} tokens")
    cuts = torch.randperm(real - 1, generator=generator)[: num_documents - 1].sort().values + 1
    return [0, *cuts.tolist(), real]
