"""The objective's edges, each one cheap: one-slot metrics, a drafter that predicts its labels, a DDP-like
wrapper, the exact noise draw and its pinned generators, far-apart logits, a bf16 LM head, the refusals'
messages, the precision rule, and which blocks a tree-streak sample reads."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from app.config.schema import TrainConfig
from app.data.batch import DrafterRow, FeatureBatch
from app.errors import UserError
from app.model.acceptance import SlotObjective
from app.model.objective import (
    SoftLabels,
    TreeSample,
    block_labels,
    block_metrics,
    chunked_lm_head_ce,
    drafter_loss,
    feature_noise_std,
    noise_generator,
    slot_weights,
    soft_ce_chunk,
    training_autocast,
    tree_streak,
    weighted_ce_chunk,
)
from tests.objective_helpers import BLOCK, HIDDEN, VOCAB, drafter_setup, make_row, reference_labels

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def setup():
    return drafter_setup()


def test_block_labels_at_the_row_s_end_by_hand():
    """One document filling the row (no padding): a block's slots past the row's end are unsupervised,
    never the clamped last token's; a block anchored on the last token has no label at all."""
    length = 10
    row = DrafterRow(
        input_ids=torch.arange(length) + 20, position_ids=torch.arange(length),
        document_ids=torch.zeros(length, dtype=torch.int32), loss_mask=torch.ones(length, dtype=torch.bool),
        anchor_positions=torch.tensor([0, 7, 9]), anchor_valid=torch.ones(3, dtype=torch.bool),
    )  # fmt: skip
    labels, supervised = block_labels(row, 4)
    assert labels.tolist() == [[21, 22, 23], [28, 29, 0], [0, 0, 0]]
    assert supervised.tolist() == [[True, True, True], [True, True, False], [False, False, False]]


def test_one_supervised_slot_s_metrics():
    """One valid block with one supervised, correctly predicted slot: acc 1 and streak 1 (a floor of
    the denominators above 1 would halve them); the wrong prediction gives 0 and 0."""
    labels, supervised = torch.tensor([[3, 0]]), torch.tensor([[True, False]])
    valid = torch.tensor([True])
    acc, streak = block_metrics(torch.tensor([[3, 0]]), labels, supervised, valid)
    assert (acc.item(), streak.item()) == (1.0, 1.0)
    acc, streak = block_metrics(torch.tensor([[4, 0]]), labels, supervised, valid)
    assert (acc.item(), streak.item()) == (0.0, 0.0)


def predicting_head(token: int) -> nn.Linear:
    """An LM head whose argmax is `token` whatever the hidden state (zero weights, a bias on it)."""
    head = nn.Linear(HIDDEN, VOCAB).requires_grad_(False)
    head.weight.zero_()
    head.bias.zero_()
    head.bias[token] = 5.0
    return head


def test_a_drafter_predicting_every_label_scores_full_accuracy_and_the_supervised_streak(setup):
    """Every token of the row is 7 and the head always predicts 7: acc is 1, each valid block's streak
    is its leading supervised slots, and the tree streak (top-2, budget B-1) the same over the sampled
    blocks."""
    drafter, embed_tokens, _, batch = setup
    row = DrafterRow(**{**vars(batch.row), "input_ids": torch.full_like(batch.row.input_ids, 7)})
    sample = TreeSample(budget=BLOCK - 1, top_k=2, blocks=100)
    with torch.no_grad():
        output = drafter_loss(
            drafter, FeatureBatch(row, batch.features), embed_tokens, predicting_head(7), chunk_size=5,
            tree_sample=sample,
        )  # fmt: skip
    _, supervised = reference_labels(row, BLOCK)
    leading = torch.cumprod(supervised.int(), dim=1).sum(dim=1)
    valid = row.anchor_valid
    assert 0 < int(supervised.sum()) < supervised.numel() and len(set(leading[valid].tolist())) > 1
    assert output.acc.item() == 1.0
    assert output.streak.item() == pytest.approx(leading[valid].sum().item() / valid.sum().item())
    accepted, blocks = output.tree_streak
    assert (accepted.item(), blocks.item()) == (leading.sum().item(), supervised[:, 0].sum().item())


class Wrapper(nn.Module):
    """What DDP does to the drafter: it is `.module`, and calling the wrapper calls it."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args):
        return self.module(*args)


def test_a_wrapped_drafter_gives_the_drafter_s_loss(setup):
    drafter, embed_tokens, lm_head, batch = setup
    with torch.no_grad():
        plain = drafter_loss(drafter, batch, embed_tokens, lm_head, chunk_size=5)
        wrapped = drafter_loss(Wrapper(drafter), batch, embed_tokens, lm_head, chunk_size=5)
    assert torch.equal(plain.loss, wrapped.loss) and torch.equal(plain.streak, wrapped.streak)


def test_the_noise_is_std_times_a_normal_draw_from_the_generator(setup):
    """noise_std 0.5: the loss of the features plus 0.5 x the generator's next normal draw of their
    shape; noise_std 0 draws nothing (the generator's state is unchanged)."""
    drafter, embed_tokens, lm_head, batch = setup
    with torch.no_grad():
        noisy = drafter_loss(
            drafter, batch, embed_tokens, lm_head, chunk_size=5, noise_std=0.5,
            generator=noise_generator(7, 3, 0, CPU),
        )  # fmt: skip
        draw = torch.randn(batch.features.shape, generator=noise_generator(7, 3, 0, CPU))
        by_hand = FeatureBatch(batch.row, batch.features + 0.5 * draw)
        expected = drafter_loss(drafter, by_hand, embed_tokens, lm_head, chunk_size=5)
        generator = noise_generator(7, 3, 0, CPU)
        state = generator.get_state()
        drafter_loss(drafter, batch, embed_tokens, lm_head, chunk_size=5, noise_std=0.0, generator=generator)
    assert torch.equal(noisy.loss, expected.loss) and noisy.noise == 0.5
    assert torch.equal(generator.get_state(), state)


def test_the_noise_generators_are_pinned():
    """The seeds are part of a run's record: a resumed run must draw what the first one drew, so they
    are pinned (blake2b-8 of "noise:seed:step[:position]", little-endian, halved)."""
    seeds = [noise_generator(*key, CPU).initial_seed() for key in ((7, 3, 0), (7, 3, 2), (0, 0, 0))]
    assert seeds == [1300438745078311253, 1665843381873227696, 7936019389186638151]
    assert noise_generator(7, 3, 0, CPU).device == CPU


def test_far_apart_logits_give_a_finite_exact_ce():
    """Logits thousands apart overflow exp() unless the row's max is taken out first."""
    logits = torch.tensor([[1000.0, 0.0, -1000.0], [0.0, 3000.0, 1.0], [-2000.0, -2001.0, -2000.5]])
    labels, weights = torch.tensor([1, 1, 2]), torch.tensor([1.0, 2.0, 0.5])
    rows = torch.empty(3)
    loss, grad, predictions = weighted_ce_chunk(logits, labels, weights, rows)
    reference = logits.clone().requires_grad_()
    expected = F.cross_entropy(reference, labels, reduction="none") * weights
    expected.sum().backward()
    close = {"rtol": 1e-4, "atol": 1e-4}  # fp32 logits of magnitude 2000 are 1e-4 apart
    torch.testing.assert_close(rows, expected.detach(), **close)
    torch.testing.assert_close(loss, expected.sum().detach(), **close)
    torch.testing.assert_close(grad, reference.grad, **close)
    assert predictions.tolist() == [0, 1, 0]


def test_a_bf16_lm_head_takes_fp32_hidden_states():
    """The training step's bf16 head: the chunks' hidden states are cast to its dtype, the gradient
    w.r.t. the fp32 hidden states comes back fp32, predictions are int64, and the tree streak reads the
    same head."""
    generator = torch.Generator().manual_seed(0)
    head = nn.Linear(HIDDEN, VOCAB, bias=True).to(torch.bfloat16).requires_grad_(False)
    hidden = torch.randn(5, BLOCK - 1, HIDDEN, generator=generator, requires_grad=True)
    labels = torch.randint(0, VOCAB, (5, BLOCK - 1), generator=generator)
    weights = torch.rand(5, BLOCK - 1, generator=generator)
    loss, predictions = chunked_lm_head_ce(hidden, head, labels, weights, 2)
    loss.backward()
    leaf = hidden.detach().clone().requires_grad_()
    logits = (leaf.to(torch.bfloat16) @ head.weight.t() + head.bias).float()  # the chunk's rounding
    expected = (
        F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none") * weights.reshape(-1)
    ).sum()
    expected.backward()
    assert loss.dtype == torch.float32 and predictions.dtype == torch.int64
    torch.testing.assert_close(loss, expected.detach())
    assert hidden.grad.dtype == torch.float32
    torch.testing.assert_close(hidden.grad, leaf.grad, rtol=2e-2, atol=2e-3)
    assert torch.equal(predictions, logits.argmax(-1))
    supervised = torch.ones(5, BLOCK - 1, dtype=torch.bool)
    accepted, blocks = tree_streak(hidden.detach(), head, labels, supervised, TreeSample(4, 2, 5))
    assert blocks.item() == 5 and 0 <= accepted.item() <= 5 * (BLOCK - 1)


@pytest.mark.parametrize("chunk", [weighted_ce_chunk, soft_ce_chunk])
def test_a_chunk_s_gradient_comes_back_in_the_logits_dtype(chunk):
    logits = torch.randn(4, 9, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    labels, weights = torch.tensor([0, 3, 8, 2]), torch.ones(4)
    extra = (torch.zeros(4, 9), 0.25) if chunk is soft_ce_chunk else ()
    loss, grad, predictions = chunk(logits, labels, weights, *extra)
    assert (loss.dtype, grad.dtype, predictions.dtype) == (torch.float32, torch.bfloat16, torch.int64)


@pytest.mark.parametrize("chunk_size", [0, -2])
def test_a_chunk_size_below_one_is_refused(chunk_size):
    head = nn.Linear(HIDDEN, VOCAB).requires_grad_(False)
    with pytest.raises(UserError) as error:
        chunked_lm_head_ce(
            torch.zeros(2, 3, HIDDEN), head, torch.zeros(2, 3).long(), torch.ones(2, 3), chunk_size
        )
    assert str(error.value) == f"train.loss_chunk_size: must be >= 1, got {chunk_size}"


@pytest.mark.parametrize("gamma", [0.0, -1.5])
def test_a_gamma_not_above_zero_is_refused(gamma):
    with pytest.raises(UserError) as error:
        slot_weights(BLOCK, gamma, "cpu")
    assert str(error.value) == f"train.gamma: must be > 0, got {gamma}"


def autocast_requested(train: TrainConfig, device: torch.device) -> torch.autocast:
    """`training_autocast`, and whether it asked for autocast: on a machine without CUDA, torch turns a
    CUDA autocast off with a warning, which only an enabled request draws."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autocast = training_autocast(train, device)
    requested = autocast._enabled or any("Disabling autocast" in str(w.message) for w in caught)
    return autocast, requested


def test_the_precision_rule_autocasts_bf16_on_cuda_only():
    cases = {
        ("cpu", "bf16"): False,  # fp32 on the CPU whatever train.precision says
        ("cpu", "fp32"): False,
        ("cuda", "fp32"): False,
        ("cuda", "bf16"): True,
    }
    for (device, precision), enabled in cases.items():
        autocast, requested = autocast_requested(TrainConfig(precision=precision), torch.device(device))
        assert (autocast.device, autocast.fast_dtype, requested) == (device, torch.bfloat16, enabled)


def test_a_tree_sample_follows_the_eval_s_tree():
    train = TrainConfig(eval_tree_budget=16, eval_tree_top_k=3)
    assert TreeSample.from_config(train, 5) == TreeSample(budget=16, top_k=3, blocks=5)
    assert TreeSample.from_config(train, 0) is None
    assert TreeSample.from_config(TrainConfig(eval_tree_budget=0), 5) is None


def ranked_hidden(labels: torch.Tensor, ranks: list[list[int]], vocab: int) -> torch.Tensor:
    """Hidden states that, through an identity head, rank each slot's label at `ranks[block][slot]`."""
    hidden = torch.zeros(*labels.shape, vocab)
    for block in range(labels.shape[0]):
        for slot in range(labels.shape[1]):
            order = [labels[block, slot].item()] + [t for t in range(vocab) if t != labels[block, slot]]
            order.insert(ranks[block][slot], order.pop(0))
            hidden[block, slot, torch.tensor(order)] = -torch.arange(vocab, dtype=torch.float)
    return hidden


def test_the_tree_streak_samples_blocks_evenly_over_those_with_a_supervised_first_slot():
    """Six blocks, chain trees (top-1): block 1's first slot is unsupervised, so the candidates are
    blocks 0, 2, 3, 4, 5, accepting 1, 0, 3, 0, 2. Three samples read candidates 0, 2, 4 (blocks 0, 3,
    5); four read 0, 1, 3, 4 (rounded from 0, 1.33, 2.67, 4: blocks 0, 2, 4, 5); nothing supervised
    reads nothing."""
    vocab = 6
    head = nn.Linear(vocab, vocab, bias=False).requires_grad_(False)
    head.weight.copy_(torch.eye(vocab))
    labels = torch.tensor([[1, 2, 3], [0, 4, 5], [1, 2, 3], [4, 5, 1], [2, 3, 4], [5, 1, 2]])
    supervised = torch.ones(6, 3, dtype=torch.bool)
    supervised[1, 0] = False
    ranks = [[0, 1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0], [2, 0, 0], [0, 0, 1]]
    hidden = ranked_hidden(labels, ranks, vocab)
    counts = {}
    for blocks in (3, 4, 100):
        accepted, sampled = tree_streak(hidden, head, labels, supervised, TreeSample(3, 1, blocks))
        counts[blocks] = (accepted.item(), sampled.item())
    assert counts == {3: (1 + 3 + 2, 3), 4: (1 + 0 + 0 + 2, 4), 100: (1 + 0 + 3 + 0 + 2, 5)}
    nothing = torch.zeros_like(supervised)
    assert [v.item() for v in tree_streak(hidden, head, labels, nothing, TreeSample(3, 1, 4))] == [0, 0]


def test_the_objective_s_defaults_are_weight_one_and_one_candidate(setup):
    drafter, embed_tokens, lm_head, batch = setup
    with torch.no_grad():
        tv = [
            drafter_loss(
                drafter, batch, embed_tokens, lm_head, chunk_size=5, objective="ce+tv", **weight
            ).loss
            for weight in ({}, {"objective_weight": 1.0}, {"objective_weight": 2.0})
        ]
        tree = [
            drafter_loss(
                drafter, batch, embed_tokens, lm_head, chunk_size=5, objective="ce+tree", **top_k
            ).loss
            for top_k in ({}, {"tree_top_k": 1}, {"tree_top_k": 3})
        ]
    assert torch.equal(tv[0], tv[1]) and not torch.equal(tv[0], tv[2])
    assert torch.equal(tree[0], tree[1]) and not torch.equal(tree[0], tree[2])


def test_the_noise_is_drawn_in_the_features_dtype(setup):
    """bf16 features get bf16 noise: the noisy features stay bf16 sums, as the generator draws them."""
    drafter, embed_tokens, lm_head, batch = setup
    features = batch.features.to(torch.bfloat16)
    with torch.no_grad():
        noisy = drafter_loss(
            drafter, FeatureBatch(batch.row, features), embed_tokens, lm_head, chunk_size=5, noise_std=0.5,
            generator=noise_generator(7, 3, 0, CPU),
        )  # fmt: skip
        draw = torch.randn(features.shape, generator=noise_generator(7, 3, 0, CPU), dtype=torch.bfloat16)
        by_hand = FeatureBatch(batch.row, features + 0.5 * draw)
        expected = drafter_loss(drafter, by_hand, embed_tokens, lm_head, chunk_size=5)
    assert torch.equal(noisy.loss, expected.loss)


def test_a_noise_decay_over_one_step_is_off_from_the_first_step():
    decaying = TrainConfig(feature_noise_std=0.2, feature_noise_decay_steps=1)
    assert [feature_noise_std(decaying, step) for step in (0, 1, 2)] == [0.2, 0.0, 0.0]


def test_the_loss_chunks_128_anchors_by_default(setup):
    """130 anchors: the default `chunk_size` runs the CE over 128 anchors, then 2 (rows of B-1 slots)."""
    drafter, embed_tokens, lm_head, _ = setup
    generator = torch.Generator().manual_seed(4)
    row = make_row(2, token_budget=256, anchors=130, valid=130)
    batch = FeatureBatch(row, torch.randn(256, HIDDEN, generator=generator))
    rows = []

    def spy(logits, labels, weights, row_ce=None):
        rows.append(logits.shape[0])
        return weighted_ce_chunk(logits, labels, weights, row_ce)

    with torch.no_grad():
        drafter_loss(drafter, batch, embed_tokens, lm_head, ce_chunk=spy)
    assert rows == [128 * (BLOCK - 1), 2 * (BLOCK - 1)]


def test_soft_targets_through_the_drafter_loss_are_the_mixed_label_ce(setup):
    """`soft_targets` 0.4: each supervised slot's CE against 0.6 one-hot + 0.4 softmax of the LM head on
    the target's final hidden state one position before the slot's token, decayed and normalised as the
    hard CE; the batch's `target_hidden` is what it reads."""
    drafter, embed_tokens, lm_head, batch = setup
    generator = torch.Generator().manual_seed(6)
    length = batch.row.input_ids.shape[0]
    target_hidden = torch.randn(length, HIDDEN, generator=generator)
    soft_batch = FeatureBatch(batch.row, batch.features, target_hidden=target_hidden)
    with torch.no_grad():
        output = drafter_loss(
            drafter, soft_batch, embed_tokens, lm_head, gamma=3.0, chunk_size=5, soft_targets=0.4
        )
        logits = lm_head(drafter(batch.features, batch.row, embed_tokens)[:, 1:])
    labels, supervised = reference_labels(batch.row, BLOCK)
    before = (batch.row.anchor_positions[:, None] + torch.arange(BLOCK - 1)).clamp(max=length - 1)
    mixed = 0.6 * F.one_hot(labels, VOCAB) + 0.4 * lm_head(target_hidden[before]).softmax(-1)
    ce = F.cross_entropy(logits.reshape(-1, VOCAB), mixed.reshape(-1, VOCAB), reduction="none").view_as(
        labels
    )
    weights = supervised * slot_weights(BLOCK, 3.0, "cpu")
    torch.testing.assert_close(output.loss, (ce * weights).sum() / weights.sum())


def test_soft_labels_under_a_bf16_head_read_fp32_target_states():
    """The target's fp32 final hidden states go through the bf16 head in its dtype, as the drafter's do."""
    generator = torch.Generator().manual_seed(2)
    head = nn.Linear(HIDDEN, VOCAB).to(torch.bfloat16).requires_grad_(False)
    hidden = torch.randn(3, BLOCK - 1, HIDDEN, generator=generator)
    target = torch.randn(3, BLOCK - 1, HIDDEN, generator=generator)
    labels = torch.randint(0, VOCAB, (3, BLOCK - 1), generator=generator)
    weights = torch.ones(3, BLOCK - 1)
    loss, _ = chunked_lm_head_ce(hidden, head, labels, weights, 2, soft=SoftLabels(target, 0.5))
    logits = (hidden.to(torch.bfloat16) @ head.weight.t() + head.bias).float().reshape(-1, VOCAB)
    target_logits = (target.to(torch.bfloat16) @ head.weight.t() + head.bias).float().reshape(-1, VOCAB)
    mixed = 0.5 * F.one_hot(labels.reshape(-1), VOCAB) + 0.5 * target_logits.softmax(-1)
    torch.testing.assert_close(loss, F.cross_entropy(logits, mixed, reduction="sum"))


META = torch.device("meta")


def test_the_loss_makes_every_tensor_on_its_inputs_device():
    """On the meta device (shapes only; it stands for CUDA here): labels, slot weights, soft labels and
    the chunked loss with each kind of chunk make their tensors where the inputs are, a tensor made on
    the CPU instead fails there; so does the loss of an empty batch, which no chunk touches."""
    row = make_row(0).to(META)
    labels, supervised = block_labels(row, BLOCK)
    weights = supervised * slot_weights(BLOCK, 2.0, META)
    head = nn.Linear(HIDDEN, VOCAB, device=META).requires_grad_(False)
    hidden = torch.empty(12, BLOCK - 1, HIDDEN, device=META, requires_grad=True)
    target = torch.empty(128, HIDDEN, device=META)
    soft = SoftLabels.of(FeatureBatch(row, torch.empty(128, HIDDEN, device=META), target), BLOCK, 0.3)
    objective = SlotObjective.build("ce+tv", 0.5, supervised, tree_top_k=1)
    devices = [labels.device, supervised.device, weights.device, soft.hidden.device]
    for extra in ({}, {"objective": objective}, {"soft": soft}):
        loss, predictions = chunked_lm_head_ce(hidden, head, labels, weights, 5, **extra)
        loss.backward()
        devices += [loss.device, predictions.device, hidden.grad.device]
    empty, _ = chunked_lm_head_ce(hidden[:0], head, labels[:0], weights[:0], 5)
    assert {*devices, empty.device} == {META}


def test_soft_targets_without_target_states_are_refused_by_name():
    row = make_row(0)
    with pytest.raises(ValueError) as error:
        SoftLabels.of(FeatureBatch(row, torch.zeros(128, HIDDEN)), BLOCK, 0.5)
    assert str(error.value) == "train.soft_targets: the batch carries no target final hidden states"


class Shapes(TorchDispatchMode):
    """Records the shape of every tensor an op makes."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
        return output


def test_hidden_states_without_a_gradient_get_no_gradient_buffer():
    """An evaluation's call (hidden states that need no gradient) makes no `[A, S, H]` buffer for one;
    a training call makes exactly one."""
    head = nn.Linear(HIDDEN, VOCAB).requires_grad_(False)
    hidden = torch.randn(6, BLOCK - 1, HIDDEN, generator=torch.Generator().manual_seed(0))
    labels, weights = torch.zeros(6, BLOCK - 1, dtype=torch.long), torch.ones(6, BLOCK - 1)
    made = {}
    for needs_grad in (False, True):
        leaf = hidden.clone().requires_grad_(needs_grad)
        with Shapes() as probe:
            chunked_lm_head_ce(leaf, head, labels, weights, 2)
        made[needs_grad] = probe.shapes.count(tuple(hidden.shape))
    assert made == {False: 0, True: 1}


def test_a_trainable_lm_head_is_refused_by_name():
    with pytest.raises(ValueError) as error:
        chunked_lm_head_ce(
            torch.zeros(2, 3, HIDDEN), nn.Linear(HIDDEN, VOCAB), torch.zeros(2, 3).long(), torch.ones(2, 3), 1
        )
    assert str(error.value) == "chunked_lm_head_ce: the LM head must be frozen (requires_grad=False)"
