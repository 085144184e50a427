"""The two batch shapes of the flow: padded target batches in, fixed-shape drafter rows out.

One target batch becomes exactly one drafter row: its real tokens (at most `token_budget`) are
packed end to end and padded to `token_budget`, so every drafter step has the same shapes
(one compile, no recompiles, flat memory). The target side may be padded and length-bucketed;
only real tokens' features travel to the drafter.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class TargetBatch:
    """Sequences for one target forward, right-padded to one of the run's fixed shapes
    (`app.data.shapes`); rows past the batch's samples are all padding."""

    input_ids: torch.Tensor
    """[b, L] int64 token ids; padding is `pad_token_id`."""

    attention_mask: torch.Tensor
    """[b, L] int64, 1 on real tokens."""

    loss_mask: torch.Tensor
    """[b, L] bool, True on supervised (assistant) tokens."""

    sample_ids: torch.Tensor
    """[b] int64 index of each sequence in the tokenized dataset (epoch accounting, debugging); -1 on
    padding rows."""

    def to(self, device: torch.device | str) -> TargetBatch:
        return TargetBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


@dataclass
class DrafterRow:
    """One packed, fixed-shape drafter input: `T = token_budget` context tokens and `A = anchors` blocks."""

    input_ids: torch.Tensor
    """[T] int64 context token ids, sequences end to end, then padding."""

    position_ids: torch.Tensor
    """[T] int64 position of each token inside its own sequence (0 on padding)."""

    document_ids: torch.Tensor
    """[T] int32 index of the sequence each token belongs to; -1 on padding."""

    loss_mask: torch.Tensor
    """[T] bool, True on supervised tokens (never on padding)."""

    anchor_positions: torch.Tensor
    """[A] int64 row index of each block's anchor token, sorted; 0 on unused slots."""

    anchor_valid: torch.Tensor
    """[A] bool, False on unused slots (they see nothing and carry no loss)."""

    def to(self, device: torch.device | str, non_blocking: bool = False) -> DrafterRow:
        return DrafterRow(
            **{f.name: getattr(self, f.name).to(device, non_blocking=non_blocking) for f in fields(self)}
        )


@dataclass
class FeatureBatch:
    """What crosses the target -> drafter seam: a drafter row and the target's features for it."""

    row: DrafterRow
    """Packed row metadata (computed on the data side, independent of the target)."""

    features: torch.Tensor
    """[T, K*H] target hidden states of the K configured layers, concatenated; zeros on padding."""

    target_hidden: torch.Tensor | None = None
    """[T, H] the target's final-normed hidden states (its LM head's input) with `train.soft_targets`;
    None otherwise."""

    def to(self, device: torch.device | str) -> FeatureBatch:
        hidden = self.target_hidden.to(device) if self.target_hidden is not None else None
        return FeatureBatch(row=self.row.to(device), features=self.features.to(device), target_hidden=hidden)

    @classmethod
    def split(cls, row: DrafterRow, packed: torch.Tensor, feature_size: int) -> FeatureBatch:
        """A producer's packed `[T, K*H (+ H)]`: the drafter's features, then the target's final hidden
        states when the producer computed them (`TargetModel.features(final_hidden=True)`)."""
        hidden = packed[:, feature_size:] if packed.shape[-1] > feature_size else None
        return cls(row=row, features=packed[:, :feature_size], target_hidden=hidden)
