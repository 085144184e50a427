"""Target batch -> one fixed-shape drafter row: real tokens end to end, padded to `token_budget`.

The row's metadata (ids, positions, document ids, loss mask, anchors) depends only on the
`TargetBatch` and (seed, epoch, batch index), so a drafter rank rebuilds it bit for bit from the
same batch while only the real tokens' features cross the wire (`real_token_features` on the
target side, `pad_features` on the drafter side).

Anchors are the block starts the drafter trains on: `anchors` slots sampled uniformly without
replacement among positions p where p and p + 1 are supervised and in the same document, sorted;
slots beyond the number of such positions are marked invalid. The generator is a local CPU
`torch.Generator` seeded from (seed, epoch, index), never the global RNG, so every rank and device
draws the same anchors and each epoch draws new ones.
"""

from __future__ import annotations

import hashlib

import torch

from app.data.batch import DrafterRow, FeatureBatch, TargetBatch


def pack_row(
    batch: TargetBatch,
    *,
    token_budget: int,
    anchors: int,
    pad_token_id: int,
    seed: int,
    epoch: int,
    index: int,
) -> DrafterRow:
    """The packed drafter row of target batch `index` of `epoch` (CPU tensors)."""
    real = batch.attention_mask.cpu().bool()
    tokens = int(real.sum())
    if tokens > token_budget:
        raise ValueError(f"target batch has {tokens} real tokens, more than token_budget={token_budget}")
    lengths = real.sum(dim=1)

    input_ids = torch.full((token_budget,), pad_token_id, dtype=torch.int64)
    input_ids[:tokens] = batch.input_ids.cpu()[real]
    position_ids = torch.zeros(token_budget, dtype=torch.int64)
    position_ids[:tokens] = (real.cumsum(dim=1) - 1)[real]
    document_ids = torch.full((token_budget,), -1, dtype=torch.int32)
    document_ids[:tokens] = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), lengths)
    loss_mask = torch.zeros(token_budget, dtype=torch.bool)
    loss_mask[:tokens] = batch.loss_mask.cpu()[real]

    anchor_positions, anchor_valid = sample_anchors(
        document_ids, loss_mask, anchors, anchor_generator(seed, epoch, index)
    )
    return DrafterRow(
        input_ids=input_ids,
        position_ids=position_ids,
        document_ids=document_ids,
        loss_mask=loss_mask,
        anchor_positions=anchor_positions,
        anchor_valid=anchor_valid,
    )


def anchor_candidates(document_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Row positions p where p and p + 1 are supervised and in one document: a block can start there."""
    same_document = (document_ids[:-1] == document_ids[1:]) & (document_ids[:-1] >= 0)
    return torch.nonzero(loss_mask[:-1] & loss_mask[1:] & same_document).flatten()


def sample_anchors(
    document_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """`anchors` sorted positions drawn without replacement from the candidates, and their validity."""
    candidates = anchor_candidates(document_ids, loss_mask)
    if len(candidates) > anchors:
        chosen = torch.randperm(len(candidates), generator=generator)[:anchors]
        candidates = candidates[chosen].sort().values
    positions = torch.zeros(anchors, dtype=torch.int64)
    valid = torch.zeros(anchors, dtype=torch.bool)
    positions[: len(candidates)] = candidates
    valid[: len(candidates)] = True
    return positions, valid


def anchor_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A CPU generator whose state depends only on (seed, epoch, index)."""
    digest = hashlib.blake2b(f"anchors:{seed}:{epoch}:{index}".encode(), digest_size=8).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest, "little") >> 1)


def real_token_features(batch: TargetBatch, features: torch.Tensor) -> torch.Tensor:
    """Target side: the `[n_real, K*H]` features of the real tokens, in row order (what travels)."""
    if features.shape[:2] != batch.input_ids.shape:
        raise ValueError(
            f"features {tuple(features.shape)} do not match the batch's tokens {tuple(batch.input_ids.shape)}"
        )
    return features[batch.attention_mask.to(features.device).bool()]


def pad_features(real_features: torch.Tensor, token_budget: int) -> torch.Tensor:
    """Drafter side: `[token_budget, K*H]` with the real tokens' features first and zeros after."""
    tokens, width = real_features.shape
    if tokens > token_budget:
        raise ValueError(f"{tokens} feature rows do not fit token_budget={token_budget}")
    padded = real_features.new_zeros((token_budget, width))
    padded[:tokens] = real_features
    return padded


def pack_features(batch: TargetBatch, features: torch.Tensor, row: DrafterRow) -> FeatureBatch:
    """Colocated shortcut: target features `[b, L, K*H]` of `batch` placed on the packed `row`."""
    return FeatureBatch(
        row=row, features=pad_features(real_token_features(batch, features), len(row.input_ids))
    )
