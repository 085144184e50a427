"""Target batch plans: the fixed shape set, budgets, every sample once per epoch, determinism,
resumable cursor, collation."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pytest
import torch

from app.config.schema import DataConfig
from app.data.batching import BatchPlanner, DataCursor, collate, plan_epoch, plan_stats
from app.data.dataset import DataSummary, TokenizedDataset
from app.data.shapes import TargetShapes, length_ladder
from app.errors import UserError

BUDGET, MAX_ROWS, WINDOW = 1024, 16, 64
SHAPES = TargetShapes(length_ladder(512, 32, 8), BUDGET, MAX_ROWS)


@pytest.fixture(scope="module")
def lengths() -> np.ndarray:
    return np.random.default_rng(0).integers(1, 513, size=600)


def planner(lengths, seed=0, window=WINDOW) -> BatchPlanner:
    return BatchPlanner(lengths, shapes=SHAPES, bucket_window=window, seed=seed)


def test_batches_respect_token_budget_and_row_limit(lengths):
    plan = planner(lengths).plan(0)
    for batch in plan:
        rows, length = SHAPES.shape_for(int(lengths[batch].max()))
        assert 1 <= len(batch) <= rows <= MAX_ROWS
        assert rows * length <= BUDGET


def test_the_length_ladder_is_geometric_in_multiples_ending_at_max_length():
    assert length_ladder(2048, 128, 4) == (128, 256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048)
    assert length_ladder(1000, 128, 2) == (128, 256, 384, 512, 768, 1000)
    assert length_ladder(64, 128, 8) == (64,)  # max_length below the multiple: one rung
    shapes = TargetShapes(length_ladder(2048, 128, 4), token_budget=4096, max_batch_size=8)
    assert shapes.shape_for(1) == (8, 128) and shapes.shape_for(129) == (8, 256)
    assert shapes.shape_for(1025) == (3, 1280) and shapes.shape_for(2048) == (2, 2048)
    with pytest.raises(ValueError, match=r"longer than data\.max_length=2048"):
        shapes.shape_for(2049)


def test_every_batch_of_every_epoch_has_one_of_the_shapes_known_at_start(lengths):
    """What build-cache bakes is all a run meets: the set is fixed before any batch is planned, and a
    month of epochs never leaves it; collate gives each batch exactly its shape."""
    known = set(SHAPES.all)
    seen = {
        SHAPES.shape_for(int(lengths[batch].max()))
        for epoch in range(5)
        for batch in planner(lengths).plan(epoch)
    }
    assert seen <= known and len(seen) > 3
    dataset = TokenizedDataset(
        datasets.Dataset.from_dict({"input_ids": [[1] * int(n) for n in lengths], "loss_mask": [[True] * int(n) for n in lengths],
                                    "length": lengths.tolist(), "supervised": lengths.tolist()}),
        DataSummary(files=[], min_supervised_tokens=0),
    )  # fmt: skip
    for batch in planner(lengths).plan(0)[:20]:
        collated = collate(dataset, batch, 0, SHAPES)
        assert tuple(collated.input_ids.shape) in known
        assert int(collated.attention_mask.sum()) == int(lengths[batch].sum())


def test_every_sample_exactly_once_per_epoch(lengths):
    for epoch in range(3):
        samples = [index for batch in planner(lengths).plan(epoch) for index in batch]
        assert sorted(samples) == list(range(len(lengths)))


def test_plan_is_deterministic_per_seed_and_epoch_and_changes_across_them(lengths):
    first, again = planner(lengths).plan(1), planner(lengths).plan(1)
    assert first == again
    assert planner(lengths).plan(2) != first
    assert planner(lengths, seed=7).plan(1) != first
    # not only the batch order: the grouping of samples changes too
    assert {tuple(sorted(b)) for b in planner(lengths).plan(2)} != {tuple(sorted(b)) for b in first}


def test_length_bucketing_pads_less_than_random_batches(lengths):
    bucketed = plan_stats(planner(lengths).plan(0), lengths, SHAPES)
    shuffled = np.random.default_rng(0).permutation(len(lengths))
    random_batches, batch = [], []
    for index in shuffled:  # same budget rules, no length sorting
        if len(batch) >= SHAPES.shape_for(int(max(lengths[[*batch, index]])))[0]:
            random_batches.append(batch)
            batch = []
        batch.append(int(index))
    unsorted = plan_stats([*random_batches, batch], lengths, SHAPES)
    assert bucketed.padding_overhead < 0.15 < 0.5 < unsorted.padding_overhead
    assert bucketed.samples == unsorted.samples == len(lengths)
    assert f"in {bucketed.shapes} target shapes: padding overhead" in bucketed.describe()


def test_plan_stats_by_hand():
    shapes = TargetShapes((2, 4), token_budget=8, max_batch_size=4)  # shapes (4, 2) and (2, 4)
    stats = plan_stats([[0, 1], [2]], np.array([4, 2, 3]), shapes)
    assert (stats.batches, stats.samples, stats.real_tokens, stats.padded_tokens) == (2, 3, 9, 16)
    assert stats.shapes == 1  # both batches pad to (2, 4)
    assert stats.padding_overhead == pytest.approx(16 / 9 - 1)
    assert stats.row_fill == pytest.approx(9 / 16)


def test_resuming_from_a_saved_cursor_yields_exactly_the_remaining_batches(lengths):
    epochs = 3
    everything = [(b.epoch, b.index, b.sample_ids) for b in planner(lengths).batches(DataCursor(), epochs)]
    assert len(everything) == planner(lengths).total_batches(epochs)
    stop = len(planner(lengths).plan(0)) + 5  # somewhere inside epoch 1
    seen = []
    for batch in planner(lengths).batches(DataCursor(), epochs):
        seen.append((batch.epoch, batch.index, batch.sample_ids))
        if len(seen) == stop:
            saved = json.dumps(batch.next_cursor.state_dict())
            break
    resumed = DataCursor.from_state_dict(json.loads(saved))
    rest = [(b.epoch, b.index, b.sample_ids) for b in planner(lengths).batches(resumed, epochs)]
    assert seen + rest == everything


def test_cursor_at_end_of_an_epoch_continues_with_the_next(lengths):
    end_of_first = DataCursor(0, len(planner(lengths).plan(0)))
    first = next(planner(lengths).batches(end_of_first, epochs=2))
    assert (first.epoch, first.index) == (1, 0)
    assert list(planner(lengths).batches(DataCursor(2, 0), epochs=2)) == []


@pytest.mark.parametrize("state", [{"epoch": 1}, {"epoch": -1, "batch": 0}, {"epoch": "1", "batch": 0}, None])
def test_bad_cursor_state_is_a_user_error(state):
    with pytest.raises(UserError, match="data cursor"):
        DataCursor.from_state_dict(state)


def test_samples_longer_than_max_length_are_refused():
    with pytest.raises(ValueError, match="max_length=8"):
        plan_epoch(np.array([4, 9]), shapes=TargetShapes((4, 8), 8, 4), bucket_window=4, seed=0, epoch=0)


def test_planner_from_config(lengths):
    data = DataConfig(token_budget=BUDGET, max_length=512, max_batch_size=MAX_ROWS, bucket_window=WINDOW,
                      length_multiple=32, lengths_per_octave=8)  # fmt: skip
    assert BatchPlanner.from_config(lengths, data, seed=0).plan(0) == planner(lengths).plan(0)
    other = data.model_copy(update={"lengths_per_octave": 4})
    assert BatchPlanner.from_config(lengths, other, seed=0).fingerprint != planner(lengths).fingerprint


def test_collate_pads_to_the_batch_shape_with_the_pad_id():
    ids = [[5, 6, 7], [8], [9, 10]]
    masks = [[False, True, True], [True], [False, False]]
    rows = datasets.Dataset.from_dict(
        {
            "input_ids": ids,
            "loss_mask": masks,
            "length": [len(i) for i in ids],
            "supervised": [sum(m) for m in masks],
        }
    )
    dataset = TokenizedDataset(rows, DataSummary(files=[], min_supervised_tokens=0))
    shapes = TargetShapes((2, 4), token_budget=12, max_batch_size=6)  # (6, 2) and (3, 4)
    batch = collate(dataset, [2, 0], pad_token_id=99, shapes=shapes)
    assert batch.input_ids.tolist() == [[9, 10, 99, 99], [5, 6, 7, 99], [99] * 4]
    assert batch.attention_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [0] * 4]
    assert batch.loss_mask.tolist() == [[False] * 4, [False, True, True, False], [False] * 4]
    assert batch.sample_ids.tolist() == [2, 0, -1]
    assert (batch.input_ids.dtype, batch.attention_mask.dtype, batch.loss_mask.dtype) == (
        torch.int64,
        torch.int64,
        torch.bool,
    )


def test_planner_fingerprint_identifies_data_and_settings(lengths):
    assert planner(lengths).fingerprint == planner(lengths.copy()).fingerprint
    assert planner(lengths, seed=1).fingerprint != planner(lengths).fingerprint
    assert planner(lengths[:-1]).fingerprint != planner(lengths).fingerprint
