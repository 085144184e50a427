"""The objective: labels, decayed weights, chunked LM head + CE (values, gradients, memory), metrics, noise."""

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from app.config import ConfigError, default_gamma, validate_config
from app.config.schema import TrainConfig
from app.data.batch import FeatureBatch, TargetBatch
from app.data.formats import Conversation
from app.data.packing import anchor_candidates, pack_row
from app.data.tokenize import ChatTokenizer
from app.errors import UserError
from app.model.acceptance import SlotObjective
from app.model.objective import (
    TreeSample,
    block_labels,
    block_metrics,
    chunked_lm_head_ce,
    drafter_loss,
    feature_noise_std,
    slot_weights,
    tree_streak,
    weighted_ce_chunk,
)
from tests.helpers import dflash
from tests.objective_helpers import BLOCK, HIDDEN, VOCAB, drafter_setup, make_row, reference_labels


@pytest.mark.parametrize("padding", [0, 7])
def test_block_labels_follow_the_rule(padding):
    # anchors near the row's end and at document ends make every exclusion happen; without padding the
    # last document runs to the row's end, where a block's slots fall off the row
    row = make_row(0, anchors=40, valid=36, padding=padding)
    labels, supervised = block_labels(row, BLOCK)
    expected_labels, expected_supervised = reference_labels(row, BLOCK)
    assert torch.equal(supervised, expected_supervised)
    assert torch.equal(labels, expected_labels)
    assert not supervised[~row.anchor_valid].any()


def test_block_labels_skip_the_user_turn_inside_a_multi_turn_document(tiny_tokenizer):
    """A block anchored near the end of the first answer runs into the next user turn: those tokens are
    in the anchor's document but unsupervised, so they carry no label; the second answer's do."""
    words = " ".join(["the", "tensor", "is", "a", "matrix"] * 3)
    messages = [
        {"role": "user", "content": "what is a tensor"},
        {"role": "assistant", "content": words},
        {"role": "user", "content": "and then"},
        {"role": "assistant", "content": words},
    ]
    sample = ChatTokenizer(tiny_tokenizer, max_length=512).tokenize(Conversation(messages=messages))
    length = len(sample.input_ids)
    batch = TargetBatch(
        input_ids=torch.tensor([sample.input_ids]),
        attention_mask=torch.ones(1, length, dtype=torch.int64),
        loss_mask=torch.tensor([sample.loss_mask]),
        sample_ids=torch.tensor([0]),
    )
    row = pack_row(batch, token_budget=length + 8, anchors=1, pad_token_id=0, seed=0, epoch=0, index=0)
    row.anchor_positions = anchor_candidates(row.document_ids, row.loss_mask)  # every possible block
    row.anchor_valid = torch.ones(len(row.anchor_positions), dtype=torch.bool)
    gap = length // 2  # a block long enough to cross the user turn between the answers
    labels, supervised = block_labels(row, gap)
    expected_labels, expected_supervised = reference_labels(row, gap)
    assert torch.equal(supervised, expected_supervised) and torch.equal(labels, expected_labels)
    index = row.anchor_positions[:, None] + torch.arange(1, gap)
    inside = index < length
    in_gap = inside & ~row.loss_mask[index.clamp(max=length - 1)]
    assert in_gap.any() and not supervised[in_gap].any()  # the user turn: same document, no labels
    after_gap = in_gap.int().cummax(dim=1).values.bool() & ~in_gap & inside
    assert supervised[after_gap].any()  # the second answer, past the gap, is supervised again


def test_slot_weights_decay_from_the_first_predicted_slot():
    weights = slot_weights(BLOCK, 2.0, "cpu")
    assert torch.allclose(weights, torch.tensor([math.exp(-k / 2.0) for k in range(BLOCK - 1)]))
    assert weights[0] == 1.0


def naive_weighted_ce(hidden, lm_head, labels, weights):
    logits = lm_head(hidden)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    return (ce * weights.reshape(-1)).sum(), logits.argmax(-1)


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_ce_equals_the_full_logits_computation(chunk_size, bias):
    generator = torch.Generator().manual_seed(chunk_size)
    lm_head = nn.Linear(HIDDEN, VOCAB, bias=bias).requires_grad_(False)
    hidden = torch.randn(7, BLOCK - 1, HIDDEN, generator=generator, requires_grad=True)
    labels = torch.randint(0, VOCAB, (7, BLOCK - 1), generator=generator)
    weights = torch.rand(7, BLOCK - 1, generator=generator) * (
        torch.rand(7, BLOCK - 1, generator=generator) > 0.3
    )
    loss, predictions = chunked_lm_head_ce(hidden, lm_head, labels, weights, chunk_size)
    (2.5 * loss).backward()
    chunked_grad, hidden.grad = hidden.grad, None
    expected, expected_predictions = naive_weighted_ce(hidden, lm_head, labels, weights)
    (2.5 * expected).backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(chunked_grad, hidden.grad)
    assert torch.equal(predictions, expected_predictions)
    assert lm_head.weight.grad is None


TRITON_CE_SCRIPT = """
import sys, torch
from torch import nn
import app.model.ce_kernel as kernel
from app.model.acceptance import SlotObjective
from app.model.objective import chunked_lm_head_ce, weighted_ce_chunk
kernel.BLOCK = 64  # vocab 257: four whole loop iterations and a last one of a single logit
generator = torch.Generator().manual_seed(0)
logits = 4 * torch.randn(6, 257, generator=generator)
logits[1, [3, 67, 200]] = 30.0  # a tie, 3 and 67 in one lane: the argmax is the first
logits[2, 256] = 30.0  # the largest logit in the last, partial iteration
labels = torch.tensor([0, 3, 256, 17, 100, 5])
weights = torch.tensor([1.0, 0.5, 2.0, 0.0, 0.25, 1.0])
spent = {dtype: logits.to(dtype, copy=True) for dtype in (torch.float32, torch.bfloat16)}  # written over
direct = {dtype: kernel.triton_ce_chunk(copy, labels, weights) for dtype, copy in spent.items()}
lm_head = nn.Linear(32, 257, bias=False).requires_grad_(False)
hidden = torch.randn(7, 4, 32, generator=generator, requires_grad=True)
row_labels = torch.randint(0, 257, (7, 4), generator=generator)
row_weights = torch.rand(7, 4, generator=generator)
loss, predictions = chunked_lm_head_ce(hidden, lm_head, row_labels, row_weights, 3, kernel.triton_ce_chunk)
loss.backward()
grad = hidden.grad
rows = {}  # each row's CE written by the kernel and by the CPU's chunk: (kernel, cpu)
for dtype in (torch.float32, torch.bfloat16):
    for name, each in (("weighted", weights), ("unit", torch.ones(6))):
        pair = torch.full((6,), -1.0), torch.full((6,), -1.0)
        kernel.triton_ce_chunk(logits.to(dtype, copy=True), labels, each, pair[0])
        weighted_ce_chunk(logits.to(dtype, copy=True), labels, each, pair[1])
        rows[f"{dtype}-{name}"] = pair
supervised = torch.rand(7, 4, generator=generator) > 0.25
objectives = {}  # the objectives through the kernel and through the CPU's chunk: (loss, d/d hidden)
for objective in ("ce+tv", "ce+acceptance"):
    for name, chunk in (("kernel", kernel.triton_ce_chunk), ("cpu", None)):
        hidden.grad = None
        terms = SlotObjective.build(objective, 0.7, supervised, tree_top_k=1)
        loss_, _ = chunked_lm_head_ce(hidden, lm_head, row_labels, row_weights * supervised, 3, chunk, terms)
        loss_.backward()
        objectives[f"{objective}-{name}"] = loss_.detach(), hidden.grad
torch.save({"logits": logits, "labels": labels, "weights": weights, "direct": direct,
            "lm_head": lm_head.weight, "hidden": hidden.detach(), "row_labels": row_labels,
            "row_weights": row_weights, "loss": loss.detach(), "predictions": predictions, "grad": grad,
            "rows": rows, "objectives": objectives}, sys.argv[1])
"""


@pytest.fixture(scope="module")
def triton_interpreted(tmp_path_factory):
    """TRITON_CE_SCRIPT's results: the CE kernel run by Triton's interpreter on the CPU (one process)."""
    out = tmp_path_factory.mktemp("triton") / "results.pt"
    environment = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", TRITON_CE_SCRIPT, str(out)], env=environment, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out)


def test_the_cuda_ce_kernel_equals_cross_entropy_in_triton_s_interpreter(triton_interpreted):
    """The loss's Triton kernel (CUDA's CE chunk), run by Triton's interpreter on the CPU: the weighted
    CE sum, its gradient written over the logits and the first argmax equal cross_entropy's, for a
    vocab that ends in a partial loop iteration, a tie, a zero weight; and the chunked loss over it
    (the gradient read back from the spent logits) equals the full computation."""
    got = triton_interpreted
    logits, labels, weights = got["logits"], got["labels"], got["weights"]
    for dtype, (loss, grad, predictions) in got["direct"].items():
        reference = logits.to(dtype).float().detach().requires_grad_()
        expected = (F.cross_entropy(reference, labels, reduction="none") * weights).sum()
        expected.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
        assert grad.dtype == dtype
        torch.testing.assert_close(
            grad.float(), reference.grad, rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=1e-6
        )
        assert predictions.tolist() == logits.to(dtype).argmax(-1).tolist() and predictions[1:3].tolist() == [
            3,
            256,
        ]
    lm_head = nn.Linear(32, VOCAB, bias=False).requires_grad_(False)
    lm_head.weight.copy_(got["lm_head"])
    hidden = got["hidden"].requires_grad_()
    expected, expected_predictions = naive_weighted_ce(hidden, lm_head, got["row_labels"], got["row_weights"])
    expected.backward()
    torch.testing.assert_close(got["loss"], expected)
    torch.testing.assert_close(got["grad"], hidden.grad)
    assert torch.equal(got["predictions"], expected_predictions)


def test_the_cuda_ce_kernel_s_rows_and_objectives_equal_the_cpu_chunk_s(triton_interpreted):
    """The kernel's per-row output (`row_ce`, what the acceptance objectives read) equals
    `weighted_ce_chunk`'s, with weights and with unit weights (each row's CE), in both logits dtypes;
    each objective's loss and hidden gradient through the kernel equal the CPU chunk's."""
    got = triton_interpreted
    assert len(got["rows"]) == 4
    for name, (kernel_rows, cpu_rows) in got["rows"].items():
        torch.testing.assert_close(kernel_rows, cpu_rows, msg=name)
    unit = F.cross_entropy(got["logits"], got["labels"], reduction="none")
    torch.testing.assert_close(got["rows"]["torch.float32-unit"][0], unit)
    for objective in ("ce+tv", "ce+acceptance"):
        (kernel_loss, kernel_grad), (cpu_loss, cpu_grad) = (
            got["objectives"][f"{objective}-{name}"] for name in ("kernel", "cpu")
        )
        torch.testing.assert_close(kernel_loss, cpu_loss)
        torch.testing.assert_close(kernel_grad, cpu_grad)


def test_the_lm_head_must_be_frozen():
    with pytest.raises(ValueError, match="must be frozen"):
        chunked_lm_head_ce(
            torch.zeros(2, 3, HIDDEN), nn.Linear(HIDDEN, VOCAB), torch.zeros(2, 3).long(), torch.ones(2, 3), 1
        )


@pytest.fixture(scope="module")
def setup():
    return drafter_setup()


def test_drafter_loss_is_the_decayed_block_ce(setup):
    drafter, embed_tokens, lm_head, batch = setup
    output = drafter_loss(drafter, batch, embed_tokens, lm_head, gamma=3.0, chunk_size=5)
    output.loss.backward()
    grads = {name: parameter.grad.clone() for name, parameter in drafter.named_parameters()}
    drafter.zero_grad(set_to_none=True)

    labels, supervised = reference_labels(batch.row, BLOCK)
    decay = torch.tensor([math.exp(-(k - 1) / 3.0) for k in range(1, BLOCK)])
    logits = lm_head(drafter(batch.features, batch.row, embed_tokens)[:, 1:])
    ce = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none").view_as(labels)
    weights = supervised * decay
    expected = (ce * weights).sum() / weights.sum()
    expected.backward()
    torch.testing.assert_close(output.loss, expected)
    for name, parameter in drafter.named_parameters():
        torch.testing.assert_close(grads[name], parameter.grad, msg=name)
    drafter.zero_grad(set_to_none=True)

    predictions = logits.argmax(-1)
    correct = (predictions == labels) & supervised
    assert output.acc.item() == pytest.approx(correct.sum().item() / supervised.sum().item())
    streaks = []
    for block in range(labels.shape[0]):
        if not batch.row.anchor_valid[block]:
            continue
        streak = 0
        while streak < BLOCK - 1 and correct[block, streak]:
            streak += 1
        streaks.append(streak)
    assert output.streak.item() == pytest.approx(sum(streaks) / len(streaks))
    assert output.supervised_tokens.item() == supervised.sum().item()
    assert output.noise == 0.0 and output.acc.grad_fn is None


OBJECTIVE_VOCAB = 50
OBJECTIVE_SUPERVISED = torch.tensor(
    [[1, 1, 1, 1], [1, 0, 1, 1], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 1]], dtype=torch.bool
)
"""Six blocks of four slots: whole, a gap mid-block, an unsupervised end, an invalid anchor, a cut at
the third slot, an unsupervised first slot (nothing of it is accepted, however likely the rest)."""


TREE_TOP_K = 3
"""Candidates per depth of the "ce+tree" objective in these tests."""


def brute_force_loss(log_p, supervised, decay, objective, weight):
    """CE + weight x the objective from the labels' log-probabilities `log_p [A, S]`, by definition
    ("ce+tree": a slot accepted when its label is among `TREE_TOP_K` draws from the drafter)."""
    slot_weights_ = supervised * decay
    loss = -(log_p * slot_weights_).sum() / slot_weights_.sum()
    if objective == "ce+tv":  # 1 - p: the TV distance to the target's one-hot, weighed like the CE
        return loss + weight * (slot_weights_ * (1 - log_p.exp())).sum() / slot_weights_.sum()
    if objective in ("ce+acceptance", "ce+tree"):  # per block: sum over k of P(drafts 1..k accepted)
        candidates = TREE_TOP_K if objective == "ce+tree" else 1
        expected = []
        for block in range(log_p.shape[0]):
            chance, accepted = 1.0, 0.0
            for slot in range(log_p.shape[1]):
                if not supervised[block, slot]:
                    break  # no known target token: no draft past it is accepted
                chance = chance * (1 - (1 - log_p[block, slot].exp()) ** candidates)
                accepted = accepted + chance
            expected.append(accepted)
        return loss - weight * sum(expected) / int(supervised[:, 0].sum())
    return loss


@pytest.mark.parametrize("chunk_size", [1, 2, 6])
@pytest.mark.parametrize("objective", ["ce", "ce+tv", "ce+acceptance", "ce+tree"])
def test_each_objective_equals_autograd_through_the_full_logits(objective, chunk_size):
    """The chunked loss with an objective (its gradient a per-row scale of the CE's, applied after the
    LM head's matmul) equals autograd through the full logits: value and d/d hidden, at every chunk
    size, with a bias and labels likely enough (p 0.04-0.49) that every product matters."""
    generator = torch.Generator().manual_seed(5)
    lm_head = nn.Linear(HIDDEN, OBJECTIVE_VOCAB).requires_grad_(False)
    lm_head.weight.copy_(torch.randn(OBJECTIVE_VOCAB, HIDDEN, generator=generator) / HIDDEN**0.5)
    labels = torch.randint(0, OBJECTIVE_VOCAB, (6, 4), generator=generator)
    hidden = 0.5 * torch.randn(6, 4, HIDDEN, generator=generator) + 3 * lm_head.weight[labels]
    hidden.requires_grad_()
    labels = labels * OBJECTIVE_SUPERVISED  # 0 where unsupervised, as block_labels makes them
    decay = slot_weights(BLOCK, 2.0, "cpu")
    weights = OBJECTIVE_SUPERVISED * decay
    terms = SlotObjective.build(objective, 0.7, OBJECTIVE_SUPERVISED, tree_top_k=TREE_TOP_K)
    loss, _ = chunked_lm_head_ce(
        hidden, lm_head, labels, weights / weights.sum(), chunk_size, objective=terms
    )
    (2.5 * loss).backward()
    chunked_grad, hidden.grad = hidden.grad, None
    log_p = torch.log_softmax(lm_head(hidden), dim=-1).gather(-1, labels[..., None]).squeeze(-1)
    expected = brute_force_loss(log_p, OBJECTIVE_SUPERVISED, decay, objective, 0.7)
    (2.5 * expected).backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(chunked_grad, hidden.grad)


@pytest.mark.parametrize("objective", ["ce+tv", "ce+acceptance", "ce+tree"])
def test_drafter_loss_adds_the_objective(setup, objective):
    """Through `drafter_loss` (labels, supervision and weights from the row, the normaliser over the
    whole batch): the loss and every drafter gradient equal autograd through the full logits."""
    drafter, embed_tokens, lm_head, batch = setup
    parameters = list(drafter.parameters())  # gradients by autograd.grad: none left on the shared drafter
    output = drafter_loss(
        drafter,
        batch,
        embed_tokens,
        lm_head,
        gamma=3.0,
        chunk_size=5,
        objective=objective,
        objective_weight=0.7,
        tree_top_k=TREE_TOP_K,
    )
    labels, supervised = reference_labels(batch.row, BLOCK)
    logits = lm_head(drafter(batch.features, batch.row, embed_tokens)[:, 1:])
    log_p = torch.log_softmax(logits, dim=-1).gather(-1, labels[..., None]).squeeze(-1)
    decay = torch.tensor([math.exp(-(k - 1) / 3.0) for k in range(1, BLOCK)])
    expected = brute_force_loss(log_p, supervised, decay, objective, 0.7)
    torch.testing.assert_close(output.loss, expected)
    got, want = torch.autograd.grad(output.loss, parameters), torch.autograd.grad(expected, parameters)
    for name, got_grad, want_grad in zip(dict(drafter.named_parameters()), got, want, strict=True):
        torch.testing.assert_close(got_grad, want_grad, msg=name)


def test_the_ce_objective_is_the_ce_only_call_bit_for_bit(setup):
    """objective "ce" (the default) runs the chunk as the CE always did, with its weights and no
    per-row buffer, and gives the CE-only `chunked_lm_head_ce` call's loss and gradients to the bit."""
    drafter, embed_tokens, lm_head, batch = setup
    buffers = []

    def spy(logits, labels, weights, row_ce=None):
        buffers.append(row_ce)
        return weighted_ce_chunk(logits, labels, weights, row_ce)

    parameters = list(drafter.parameters())
    output = drafter_loss(drafter, batch, embed_tokens, lm_head, chunk_size=5, ce_chunk=spy, objective="ce")
    assert buffers == [None, None, None]  # 12 anchors in chunks of 5
    labels, supervised = block_labels(batch.row, BLOCK)
    weights = supervised * slot_weights(BLOCK, default_gamma(BLOCK), "cpu")
    hidden = drafter(batch.features, batch.row, embed_tokens)[:, 1:]
    loss, _ = chunked_lm_head_ce(hidden, lm_head, labels, weights / weights.sum(), 5)
    assert torch.equal(output.loss, loss)
    got, want = torch.autograd.grad(output.loss, parameters), torch.autograd.grad(loss, parameters)
    assert all(torch.equal(got_grad, want_grad) for got_grad, want_grad in zip(got, want, strict=True))


def test_the_objective_fields_validate_and_are_listed(capsys, monkeypatch):
    """`train.objective` and `train.objective_weight`: defaults "ce" and 1.0, a bad value is the one-line
    config error naming the field, and `dflash config schema` lists both with the values they take."""
    raw = {"target": {"builtin": "tiny-lm"}, "drafter": {"mask_token_id": 3}}
    train = validate_config({**raw, "train": {"objective": "ce+acceptance", "objective_weight": 0.5}}).train
    assert (train.objective, train.objective_weight) == ("ce+acceptance", 0.5)
    assert (TrainConfig().objective, TrainConfig().objective_weight) == ("ce", 1.0)
    for bad, message in [
        (
            {"objective": "tv"},
            "train.objective: must be one of 'ce', 'ce+tv', 'ce+acceptance' or 'ce+tree', got 'tv'",
        ),
        ({"objective_weight": -1}, "train.objective_weight: must be >= 0.0, got -1"),
    ]:
        with pytest.raises(ConfigError) as error:
            validate_config({**raw, "train": bad})
        assert str(error.value) == f"<config>: {message}"
    with pytest.raises(UserError) as error:
        SlotObjective.build(
            "tv", 1.0, OBJECTIVE_SUPERVISED, tree_top_k=1
        )  # drafter_loss called with no config
    assert (
        str(error.value)
        == "train.objective: must be one of 'ce', 'ce+tv', 'ce+acceptance' or 'ce+tree', got 'tv'"
    )
    done = dflash(capsys, monkeypatch, "config", "schema")
    assert done.returncode == 0, done.stderr
    rows = {
        line.split("│")[1].strip(): line.split("│")[2].strip()
        for line in done.stdout.splitlines()
        if line.count("│") >= 4
    }
    assert (
        rows["objective"] == '"ce" | "ce+tv" | "ce+acceptance" | "ce+tree"'
        and rows["objective_weight"] == "float"
    )


def test_acc_and_streak_by_hand():
    labels = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4], [9, 9, 9, 9]])
    predictions = torch.tensor([[5, 6, 0, 8], [1, 0, 3, 4], [9, 9, 9, 9]])
    supervised = torch.tensor([[1, 1, 1, 1], [1, 0, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    anchor_valid = torch.tensor([True, True, False])
    acc, streak = block_metrics(predictions, labels, supervised, anchor_valid)
    assert acc.item() == pytest.approx(6 / 7)  # 3 of 4 in block 0, all 3 supervised ones in block 1
    # block 0 stops at its first wrong slot (2), block 1 at its first unsupervised one (1); block 2 is unused
    assert streak.item() == pytest.approx((2 + 1) / 2)


def test_the_tree_streak_is_the_leading_slots_on_a_path_of_the_tree():
    """By hand, logits = the hidden states (identity head): block 0's true tokens are the top-1 at
    slots 1-2 and the second at slot 3; block 1's true slot 1 is the second and its slot 3 is not
    supervised (its label 0 is the top-1 there: it must not count); block 2 has no supervised slot."""
    vocab = 6
    head = nn.Linear(vocab, vocab, bias=False).requires_grad_(False)
    head.weight.copy_(torch.eye(vocab))
    labels = torch.tensor([[1, 2, 3], [4, 5, 0], [0, 0, 0]])
    supervised = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    ranks = [[0, 0, 1], [1, 0, 0], [0, 0, 0]]  # of each slot's label in its logits
    hidden = torch.zeros(3, 3, vocab)
    for block in range(3):
        for slot in range(3):
            order = [labels[block, slot].item()] + [t for t in range(vocab) if t != labels[block, slot]]
            order.insert(ranks[block][slot], order.pop(0))
            hidden[block, slot, torch.tensor(order)] = -torch.arange(vocab, dtype=torch.float)
    chain = tree_streak(hidden, head, labels, supervised, TreeSample(budget=3, top_k=1, blocks=8))
    assert [value.item() for value in chain] == [2 + 0, 2]  # the top-1 chain: block 0 stops at slot 3
    tree = tree_streak(hidden, head, labels, supervised, TreeSample(budget=16, top_k=3, blocks=8))
    assert [value.item() for value in tree] == [3 + 2, 2]  # ... a tree holds block 0's rank-1 slot 3 too
    one = tree_streak(hidden, head, labels, supervised, TreeSample(budget=16, top_k=3, blocks=1))
    assert [value.item() for value in one] == [3, 1]  # a sample of one: the first block


def test_a_log_step_measures_the_tree_streak_on_a_sample(setup):
    drafter, embed_tokens, lm_head, batch = setup
    plain = drafter_loss(drafter, batch, embed_tokens, lm_head, chunk_size=4)
    sample = TreeSample(budget=BLOCK - 1, top_k=1, blocks=100)
    measured = drafter_loss(drafter, batch, embed_tokens, lm_head, chunk_size=4, tree_sample=sample)
    assert plain.tree_streak is None
    accepted, blocks = measured.tree_streak
    # top-1 with budget B-1 is the chain: over every block with a supervised first slot, the streak
    _, supervised = reference_labels(batch.row, BLOCK)
    assert blocks.item() == int(supervised[:, 0].sum())
    assert accepted.item() == pytest.approx(measured.streak.item() * int(batch.row.anchor_valid.sum()))
    for name in ("loss", "acc", "streak"):  # measuring the tree changes no other metric
        assert torch.equal(getattr(measured, name), getattr(plain, name)), name


def test_gamma_defaults_by_block_size(setup):
    drafter, embed_tokens, lm_head, batch = setup
    default = drafter_loss(drafter, batch, embed_tokens, lm_head, chunk_size=4).loss
    explicit = drafter_loss(
        drafter, batch, embed_tokens, lm_head, gamma=default_gamma(BLOCK), chunk_size=4
    ).loss
    other = drafter_loss(drafter, batch, embed_tokens, lm_head, gamma=0.5, chunk_size=4).loss
    assert default.item() == explicit.item() and default.item() != other.item()


def test_nothing_supervised_gives_zero_loss_and_zero_gradients(setup):
    drafter, embed_tokens, lm_head, batch = setup
    row = make_row(1, valid=0)
    output = drafter_loss(drafter, FeatureBatch(row, batch.features), embed_tokens, lm_head, chunk_size=4)
    output.loss.backward()
    assert output.loss.item() == 0.0 and output.supervised_tokens.item() == 0
    assert output.acc.item() == 0.0 and output.streak.item() == 0.0
    assert all(torch.count_nonzero(parameter.grad) == 0 for parameter in drafter.parameters())
    drafter.zero_grad(set_to_none=True)


def test_feature_noise_schedule_and_replay(setup):
    constant = TrainConfig(feature_noise_std=0.2)
    decaying = TrainConfig(feature_noise_std=0.2, feature_noise_decay_steps=100)
    assert feature_noise_std(constant, 0) == feature_noise_std(constant, 10_000) == 0.2
    assert [feature_noise_std(decaying, step) for step in (0, 50, 100, 150)] == pytest.approx(
        [0.2, 0.1, 0.0, 0.0]
    )

    drafter, embed_tokens, lm_head, batch = setup

    def loss(noise_std, seed):
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            return drafter_loss(
                drafter, batch, embed_tokens, lm_head, chunk_size=4, noise_std=noise_std, generator=generator
            )

    clean, noisy, replay, other = loss(0.0, 0), loss(0.5, 0), loss(0.5, 0), loss(0.5, 1)
    assert noisy.noise == 0.5
    assert noisy.loss.item() == replay.loss.item()  # the same generator state replays the same noise
    assert len({clean.loss.item(), noisy.loss.item(), other.loss.item()}) == 3


class LargestTensor(TorchDispatchMode):
    """Records the largest storage any op allocates (CPU-only memory accounting)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(output)[0]:
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.untyped_storage().nbytes())
        return output


def largest_loss_allocation(anchors, chunk_size, vocab=4096, hidden_size=16):
    generator = torch.Generator().manual_seed(0)
    lm_head = nn.Linear(hidden_size, vocab, bias=False).requires_grad_(False)
    hidden = torch.randn(anchors, BLOCK - 1, hidden_size, generator=generator, requires_grad=True)
    labels = torch.randint(0, vocab, (anchors, BLOCK - 1), generator=generator)
    weights = torch.ones(anchors, BLOCK - 1) / (anchors * (BLOCK - 1))
    with LargestTensor() as probe:
        loss, _ = chunked_lm_head_ce(hidden, lm_head, labels, weights, chunk_size)
        loss.backward()
    return probe.largest


def test_loss_memory_grows_with_the_chunk_not_with_the_anchors():
    chunk_logits = 4 * (BLOCK - 1) * 4096 * 4  # 4 anchors x 4 slots x vocab, fp32
    assert largest_loss_allocation(anchors=16, chunk_size=4) == chunk_logits
    assert largest_loss_allocation(anchors=64, chunk_size=4) == chunk_logits  # 4x the anchors: same peak
    assert largest_loss_allocation(anchors=64, chunk_size=8) == 2 * chunk_logits  # 2x the chunk: 2x the peak
    assert largest_loss_allocation(anchors=64, chunk_size=64) == 16 * chunk_logits  # unchunked, for contrast
