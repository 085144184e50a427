"""Packing a target batch into one fixed-shape drafter row, its features, and anchor sampling."""

from __future__ import annotations

import json

import pytest
import torch

from app.config.schema import DataConfig
from app.data.batch import TargetBatch
from app.data.batching import BatchPlanner, DataCursor, collate
from app.data.dataset import load_tokenized
from app.data.packing import anchor_candidates, pack_features, pack_row, packed_features, token_index
from app.data.tokenize import pad_token_id

PAD = 0
BUDGET = 32


def target_batch() -> TargetBatch:
    """Three right-padded sequences of 5, 3 and 7 tokens; ids are 10*doc + position + 1."""
    lengths = [5, 3, 7]
    supervised = [[0, 0, 1, 1, 1], [0, 1, 1], [0, 1, 1, 0, 1, 1, 1]]
    width = max(lengths)
    input_ids = torch.full((3, width), PAD, dtype=torch.int64)
    attention_mask = torch.zeros((3, width), dtype=torch.int64)
    loss_mask = torch.zeros((3, width), dtype=torch.bool)
    for row, length in enumerate(lengths):
        input_ids[row, :length] = torch.arange(length) + 10 * row + 1
        attention_mask[row, :length] = 1
        loss_mask[row, :length] = torch.tensor(supervised[row], dtype=torch.bool)
    return TargetBatch(input_ids, attention_mask, loss_mask, sample_ids=torch.tensor([4, 0, 9]))


def pack(batch: TargetBatch, anchors: int = 6, epoch: int = 0, index: int = 0, seed: int = 0):
    return pack_row(
        batch, token_budget=BUDGET, anchors=anchors, pad_token_id=PAD, seed=seed, epoch=epoch, index=index
    )


def test_row_has_exact_shapes_and_dtypes():
    row = pack(target_batch())
    assert [tuple(t.shape) for t in (row.input_ids, row.position_ids, row.document_ids, row.loss_mask)] == [
        (BUDGET,)
    ] * 4
    assert tuple(row.anchor_positions.shape) == tuple(row.anchor_valid.shape) == (6,)
    assert (row.input_ids.dtype, row.position_ids.dtype, row.document_ids.dtype) == (
        torch.int64,
        torch.int64,
        torch.int32,
    )
    assert (row.loss_mask.dtype, row.anchor_positions.dtype, row.anchor_valid.dtype) == (
        torch.bool,
        torch.int64,
        torch.bool,
    )


def test_sequences_are_packed_end_to_end_with_documents_and_positions():
    row = pack(target_batch())
    real = 5 + 3 + 7
    assert row.input_ids[:real].tolist() == [1, 2, 3, 4, 5, 11, 12, 13, 21, 22, 23, 24, 25, 26, 27]
    assert row.document_ids[:real].tolist() == [0] * 5 + [1] * 3 + [2] * 7
    assert row.position_ids[:real].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6]
    assert row.loss_mask[:real].tolist() == [bool(v) for v in [0, 0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 0, 1, 1, 1]]
    # padding: pad id, document -1, position 0, never supervised
    assert row.input_ids[real:].eq(PAD).all() and row.document_ids[real:].eq(-1).all()
    assert row.position_ids[real:].eq(0).all() and not row.loss_mask[real:].any()


def test_features_land_on_their_tokens_and_padding_is_zero():
    batch = target_batch()
    # each feature vector encodes (sequence, position) so misplacement is visible
    b, length = batch.input_ids.shape
    features = torch.stack(
        [
            torch.arange(b).view(b, 1).expand(b, length),
            torch.arange(length).view(1, length).expand(b, length),
        ],
        dim=-1,
    ).float()
    features[~batch.attention_mask.bool()] = 99.0  # padded positions' features must never travel
    row = pack(batch)

    packed = pack_features(batch, features, row)
    assert packed.row is row and tuple(packed.features.shape) == (BUDGET, 2)
    real = int(batch.attention_mask.sum())
    assert packed.features[:real, 0].tolist() == row.document_ids[:real].float().tolist()
    assert packed.features[:real, 1].tolist() == row.position_ids[:real].float().tolist()
    assert packed.features[real:].eq(0).all()
    # the definition: the real tokens' features in row order (a boolean mask), then zeros
    reference = torch.zeros(BUDGET, 2)
    reference[:real] = features[batch.attention_mask.bool()]
    assert torch.equal(packed.features, reference)


def test_token_index_places_each_packed_token_in_the_flattened_batch():
    batch = target_batch()
    index = token_index(batch, BUDGET)
    real = int(batch.attention_mask.sum())
    assert index.dtype == torch.int64 and tuple(index.shape) == (BUDGET,)
    flat_ids = batch.input_ids.reshape(-1)
    assert flat_ids[index[:real]].tolist() == pack(batch).input_ids[:real].tolist()
    assert index[real:].eq(0).all()


def test_packed_features_zero_the_padding_whatever_the_index_points_at():
    features = torch.arange(12.0).view(1, 6, 2) + 1  # no zero feature anywhere
    index = torch.tensor([5, 0, 2, 0])
    document_ids = torch.tensor([0, 0, 0, -1], dtype=torch.int32)
    packed = packed_features(features, index, document_ids)
    assert packed.tolist() == [[11.0, 12.0], [1.0, 2.0], [5.0, 6.0], [0.0, 0.0]]


def test_feature_shape_mismatch_and_overflow_are_refused():
    batch = target_batch()
    with pytest.raises(ValueError, match="expected \\[rows, length, K\\*H\\]"):
        packed_features(
            torch.zeros(6, 4), torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int32)
        )
    with pytest.raises(ValueError, match="more than token_budget=4"):
        token_index(batch, 4)
    with pytest.raises(ValueError, match="more than token_budget=8"):
        pack_row(batch, token_budget=8, anchors=2, pad_token_id=PAD, seed=0, epoch=0, index=0)


def test_anchors_are_valid_sorted_unique_and_within_documents():
    row = pack(target_batch(), anchors=4)
    candidates = set(anchor_candidates(row.document_ids, row.loss_mask).tolist())
    # supervised pairs inside one document: doc0 2,3; doc1 6; doc2 9, 12, 13
    assert candidates == {2, 3, 6, 9, 12, 13}
    chosen = row.anchor_positions[row.anchor_valid].tolist()
    assert row.anchor_valid.all() and len(chosen) == 4
    assert chosen == sorted(set(chosen)) and set(chosen) <= candidates
    for position in chosen:
        assert row.loss_mask[position] and row.loss_mask[position + 1]
        assert row.document_ids[position] == row.document_ids[position + 1] >= 0


def test_supervised_pair_across_a_document_boundary_is_not_an_anchor():
    batch = target_batch()
    batch.loss_mask[0, 4] = batch.loss_mask[1, 0] = True  # doc0's last and doc1's first token
    row = pack(batch)
    assert row.loss_mask[4] and row.loss_mask[5]
    assert 4 not in anchor_candidates(row.document_ids, row.loss_mask).tolist()


def test_fewer_candidates_than_slots_uses_all_and_masks_the_rest():
    row = pack(target_batch(), anchors=10)
    assert row.anchor_valid.tolist() == [True] * 6 + [False] * 4
    assert row.anchor_positions.tolist() == [2, 3, 6, 9, 12, 13, 0, 0, 0, 0]


def test_anchor_sampling_is_deterministic_and_changes_per_epoch_and_batch():
    batch = target_batch()
    torch.manual_seed(123)
    first = pack(batch, anchors=3, epoch=2, index=5).anchor_positions
    torch.manual_seed(456)  # the global RNG must not matter
    assert torch.equal(pack(batch, anchors=3, epoch=2, index=5).anchor_positions, first)
    draws = {
        tuple(pack(batch, anchors=3, epoch=epoch, index=5).anchor_positions.tolist()) for epoch in range(20)
    }
    assert len(draws) > 1
    draws = {
        tuple(pack(batch, anchors=3, epoch=2, index=index).anchor_positions.tolist()) for index in range(20)
    }
    assert len(draws) > 1


def test_every_candidate_becomes_an_anchor_over_many_epochs():
    batch = target_batch()
    seen = set()
    for epoch in range(60):
        row = pack(batch, anchors=2, epoch=epoch)
        seen |= set(row.anchor_positions[row.anchor_valid].tolist())
    assert seen == {2, 3, 6, 9, 12, 13}


def test_packing_real_tokenized_batches(tmp_path, tiny_tokenizer):
    answers = ["the value is returned as a list of strings " * (1 + i % 4) for i in range(12)]
    path = tmp_path / "data.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"Question {i}?"},
                        {"role": "assistant", "content": a},
                    ]
                }
            )
            + "\n"
            for i, a in enumerate(answers)
        )
    )
    data = DataConfig(cache_dir=str(tmp_path / "cache"), max_length=128, token_budget=256, max_batch_size=4)
    dataset = load_tokenized([str(path)], data, tiny_tokenizer, min_supervised_tokens=8)
    planner = BatchPlanner.from_config(dataset.lengths, data, seed=3)
    packed_samples = []
    for planned in planner.batches(DataCursor(), epochs=1):
        batch = collate(dataset, planned.sample_ids, pad_token_id(tiny_tokenizer), planner.shapes)
        row = pack_row(
            batch,
            token_budget=data.token_budget,
            anchors=16,
            pad_token_id=pad_token_id(tiny_tokenizer),
            seed=3,
            epoch=planned.epoch,
            index=planned.index,
        )
        real = int(batch.attention_mask.sum())
        assert real == int(dataset.lengths[planned.sample_ids].sum()) <= data.token_budget
        assert int(row.loss_mask.sum()) == int(batch.loss_mask.sum())
        assert row.document_ids.max() == len(planned.sample_ids) - 1
        packed_samples += planned.sample_ids
    assert sorted(packed_samples) == list(range(len(dataset)))
