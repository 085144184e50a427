"""Target batch -> one fixed-shape drafter row: real tokens end to end, padded to `token_budget`.

The row's metadata (ids, positions, document ids, loss mask, anchors) depends only on the
`TargetBatch` and (seed, epoch, batch index), so a drafter rank rebuilds it bit for bit from the
same batch while only the features cross the wire: the real tokens' features in row order,
padded with zeros to the row's fixed shape (`packed_features`, the same gather on both roles).

Anchors are the block starts the drafter trains on: `anchors` slots sampled uniformly without
replacement among positions p where p and p + 1 are supervised and in the same document, sorted;
slots beyond the number of such positions are marked invalid. The generator is a local CPU
`torch.Generator` seeded from (seed, epoch, index), never the global RNG, so every rank and device
draws the same anchors and each epoch draws new ones.
"""

from __future__ import annotations

import hashlib

import numpy as np
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
    """The packed drafter row of target batch `index` of `epoch` (CPU tensors).

    Built in numpy: torch's CPU boolean indexing and `repeat_interleave` made this 8-11 ms a batch at
    16K tokens, a tenth of a small target's training step (BENCHMARKS.md, 2026-12-04, the training
    loop's parts)."""
    real = batch.attention_mask.cpu().numpy().astype(bool)
    lengths = real.sum(axis=1)
    tokens = int(lengths.sum())
    if tokens > token_budget:
        raise ValueError(f"target batch has {tokens} real tokens, more than token_budget={token_budget}")
    # right-padded rows: a row's real tokens are its first `length` positions
    positions = np.arange(real.shape[1])[None, :].repeat(len(lengths), axis=0)[real]

    input_ids = np.full(token_budget, pad_token_id, dtype=np.int64)
    input_ids[:tokens] = batch.input_ids.cpu().numpy()[real]
    position_ids = np.zeros(token_budget, dtype=np.int64)
    position_ids[:tokens] = positions
    document_ids = np.full(token_budget, -1, dtype=np.int32)
    document_ids[:tokens] = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
    loss_mask = np.zeros(token_budget, dtype=bool)
    loss_mask[:tokens] = batch.loss_mask.cpu().numpy()[real]

    document, supervised = torch.from_numpy(document_ids), torch.from_numpy(loss_mask)
    anchor_positions, anchor_valid = sample_anchors(
        document, supervised, anchors, anchor_generator(seed, epoch, index)
    )
    return DrafterRow(
        input_ids=torch.from_numpy(input_ids),
        position_ids=torch.from_numpy(position_ids),
        document_ids=document,
        loss_mask=supervised,
        anchor_positions=anchor_positions,
        anchor_valid=anchor_valid,
    )


def token_index(batch: TargetBatch, token_budget: int) -> torch.Tensor:
    """`[token_budget]` int64: for each position of the packed row, its place in the target batch's
    flattened `[rows * length]` tokens (0 past the real tokens, whose features `packed_features` zeroes).
    A fixed-shape gather instead of a boolean mask: no host sync, and capturable in a CUDA graph."""
    flat = np.flatnonzero(batch.attention_mask.cpu().numpy().reshape(-1))
    if len(flat) > token_budget:
        raise ValueError(f"target batch has {len(flat)} real tokens, more than token_budget={token_budget}")
    index = np.zeros(token_budget, dtype=np.int64)
    index[: len(flat)] = flat
    return torch.from_numpy(index)


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


def packed_features(features: torch.Tensor, index: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """`[token_budget, K*H]`: the target's features `[b, L, K*H]` of the packed row's tokens in row order
    (`index`, from `token_index`), zeros on the row's padding (`document_ids` -1). Fixed shapes, no host
    sync: what a target rank sends and what a colocated rank trains on."""
    if features.dim() != 3:
        raise ValueError(f"features {tuple(features.shape)}: expected [rows, length, K*H]")
    gathered = features.reshape(-1, features.shape[-1]).index_select(0, index)
    return gathered.masked_fill((document_ids < 0).unsqueeze(-1), 0)


def pack_features(batch: TargetBatch, features: torch.Tensor, row: DrafterRow) -> FeatureBatch:
    """Target features `[b, L, K*H]` of `batch` placed on its packed `row` (all on one device)."""
    index = token_index(batch, len(row.input_ids)).to(features.device)
    return FeatureBatch(row=row, features=packed_features(features, index, row.document_ids))
