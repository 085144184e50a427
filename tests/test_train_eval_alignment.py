"""Training and eval see the same thing: a round of eval that starts at position p accepts exactly the
drafts that the training forward counts as leading-correct for an anchor at p.

The training metric `streak` and eval's acceptance are two readings of one drafter: the first from the
training forward over a packed row (`DFlashDrafter.forward`, the training mask of
app/model/attention.py, `block_labels`, `chunked_lm_head_ce`, `leading_correct`), the second from
eval's replay over a context cache (`DFlashDrafter.blocks_logits`, `app.evaluate.replay`) and from the
real speculative loops (`speculative_generate`, `verified_tree_decode`: features from the verification
forwards, the cache grown round by round). Any off-by-one between them (the block's position ids, the
context the block sees, the anchor token, the tapped layers, the sliding window) would cap what a
trained drafter reaches at serving time while its training metric looks fine, so it is pinned here per
round, and the drafter's logits per slot to float tolerance, in fp32 on CPU (no argmax ties).

The drafter is trained for 20 steps on the target's own greedy answers, so that rounds accept
0 to B-1 drafts (a random drafter accepts none, and nothing would be compared). The row packs two
documents, so the second's row indices are not its positions (packing's offsets are in the path).
"""

from __future__ import annotations

import pytest
import torch

from app.config import validate_config
from app.data.batch import FeatureBatch
from app.data.packing import pack_features, pack_row
from app.evaluate.replay import replay_prompt
from app.evaluate.speculative import speculative_generate
from app.evaluate.tree import verified_tree_decode
from app.model.drafter import DFlashDrafter, DrafterArch
from app.model.objective import block_labels, chunked_lm_head_ce, drafter_loss, leading_correct, tree_accepted
from app.model.target import TargetModel, load_target
from tests.test_speculative import answers_batch, random_target_config

BLOCK = 6
PROMPTS = [[11, 42, 7, 99, 150, 23, 5], [200, 3, 77, 18, 260, 41, 9, 132, 64]]
ANSWER_TOKENS = 40
BUDGET, TOP_K = 12, 3
TRAIN_STEPS = 20


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """One intra-op thread: these models are tiny, and OpenMP barriers between threads on a shared
    machine cost more than the ops (tests/test_speculative.py)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def raw_config(**drafter) -> dict:
    """A small random Qwen3 target (fp32 on CPU) and a 2-layer drafter over its layers 1 and 5."""
    # logits as peaked as a trained model's: greedy answers that are not one repeated token
    raw = random_target_config(initializer_range=0.2)
    raw["drafter"].update(block_size=BLOCK, **drafter)
    raw["train"]["anchors"] = 128
    return raw


def greedy_answer(target: TargetModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The target's greedy continuation (HF generate, no stop token): what every eval round replays."""
    output = target.model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return output[0, len(prompt) :].tolist()


def training_batch(
    target: TargetModel, sequences: list[tuple[list[int], list[int]]], anchors: int
) -> FeatureBatch:
    """The documents `(prompt, answer)` packed into one drafter row as the trainer packs them (answers
    supervised, every candidate anchor taken when `anchors` covers them), with the target's features."""
    batch = answers_batch(sequences)
    row = pack_row(batch, token_budget=128, anchors=anchors, pad_token_id=0, seed=0, epoch=0, index=0)
    return pack_features(batch, target.features(batch.input_ids), row)


def trained_drafter(target: TargetModel, config, batch: FeatureBatch) -> DFlashDrafter:
    """A drafter fitted for a few AdamW steps of the DFlash loss to the row (not to convergence: its
    rounds must accept anywhere from 0 to B-1 drafts)."""
    drafter = DFlashDrafter(DrafterArch.from_config(config, target), seed=0)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3, betas=(0.9, 0.95))
    for _ in range(TRAIN_STEPS):
        drafter_loss(drafter, batch, target.embed_tokens, target.lm_head).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return drafter.eval()


class Setup:
    """The target, the trained drafter, each document's prompt and greedy answer, and the training
    forward's reading of every anchor of the packed row."""

    def __init__(self, **drafter_fields) -> None:
        config = validate_config(raw_config(**drafter_fields))
        self.target = load_target(config, "cpu")
        self.sequences = [(p, greedy_answer(self.target, p, ANSWER_TOKENS)) for p in PROMPTS]
        self.batch = training_batch(self.target, self.sequences, config.train.anchors)
        self.drafter = trained_drafter(self.target, config, self.batch)
        self.training_forward()

    @torch.no_grad()
    def training_forward(self) -> None:
        """The training step's own path (`drafter_loss`'s pieces, no noise): per anchor the logits of
        slots 1..B-1, the leading-correct count and the tree's accepted count."""
        row, head = self.batch.row, self.target.lm_head
        hidden = self.drafter(self.batch.features, row, self.target.embed_tokens)[:, 1:]
        labels, supervised = block_labels(row, BLOCK)
        weights = supervised.float()
        _, predictions = chunked_lm_head_ce(hidden, head, labels, weights, 32)
        self.logits = head(hidden)
        self.leading = leading_correct(predictions, labels, supervised).tolist()
        every = torch.arange(len(row.anchor_positions))
        self.tree = tree_accepted(hidden, head, labels, supervised, every, BUDGET, TOP_K)
        self.streak = drafter_loss(self.drafter, self.batch, self.target.embed_tokens, head).streak
        self.anchor_of = {int(a): i for i, a in enumerate(row.anchor_positions.tolist())}

    def anchor(self, document: int, position: int) -> int:
        """The training row's anchor slot for `position` of `document` (row index = its start + position)."""
        start = sum(len(p) + len(a) for p, a in self.sequences[:document])
        assert int(self.batch.row.position_ids[start + position]) == position
        return self.anchor_of[start + position]


def rounds_from_training(counts: list[int], prompt_length: int, answer_length: int) -> list[tuple[int, int]]:
    """(position, emitted tokens) of every round that the training counts predict: a round at the
    answer's last emitted token p emits `counts[p] + 1` tokens (the drafts, then the target's), cut
    where the answer ends, and the next one starts after them."""
    rounds, emitted = [], 1  # the prefill emits the answer's first token
    while emitted < answer_length:
        position = prompt_length + emitted - 1
        rounds.append((position, min(counts[position] + 1, answer_length - emitted)))
        emitted += rounds[-1][1]
    return rounds


def leading_zeros(ranks: list[int]) -> int:
    """Drafts a chain round accepted: its depths whose target token was the drafter's argmax, in a row."""
    count = 0
    while count < len(ranks) and ranks[count] == 0:
        count += 1
    return count


class RecordingDrafter(DFlashDrafter):
    """The trained drafter, recording the logits of every round the real speculative loop drafts."""

    def __init__(self, trained: DFlashDrafter) -> None:
        super().__init__(trained.arch)
        self.load_state_dict(trained.state_dict())
        self.eval()
        self.rounds: list[tuple[int, torch.Tensor]] = []

    def draft_logits(self, cache, last_token_id, position, embed_tokens, lm_head):
        logits = super().draft_logits(cache, last_token_id, position, embed_tokens, lm_head)
        self.rounds.append((position, logits))
        return logits


@pytest.fixture(scope="module", params=[{}, {"sliding_window": 4, "sliding_window_layers": [0]}])
def setup(request) -> Setup:
    return Setup(**request.param)


def per_position(setup: Setup, document: int, values: list) -> dict[int, object]:
    """The training forward's `values` (per anchor slot) of `document`, keyed by position."""
    prompt, answer = setup.sequences[document]
    return {p: values[setup.anchor(document, p)] for p in range(len(prompt), len(prompt) + len(answer) - 1)}


@pytest.mark.parametrize("document", [0, 1])
def test_each_replayed_round_accepts_the_training_forwards_leading_count(setup: Setup, document: int):
    prompt, answer = setup.sequences[document]
    leading = per_position(setup, document, setup.leading)
    tree = per_position(setup, document, setup.tree)
    replayed = replay_prompt(setup.target, setup.drafter, prompt, answer, [BUDGET], TOP_K)
    expected = rounds_from_training(leading, len(prompt), len(answer))
    assert replayed.chain.acceptance_lengths == [length for _, length in expected]
    for (position, _), ranks in zip(expected, replayed.depth_ranks, strict=True):
        assert leading_zeros(ranks) == leading[position], position
    expected_tree = rounds_from_training(tree, len(prompt), len(answer))
    assert replayed.trees[BUDGET] == [length for _, length in expected_tree]
    # the check has teeth: rounds accept from none to several drafts, and the tree more than the chain
    counts = set(leading.values())
    assert len(counts) >= 4 and min(counts) <= 1 and max(counts) >= 4, sorted(leading.values())
    assert sum(tree.values()) > sum(leading.values())


def test_the_replays_logits_equal_the_training_forwards_at_every_anchor(setup: Setup):
    for document, (prompt, answer) in enumerate(setup.sequences):
        sequence = torch.tensor(prompt + answer)
        cache = setup.drafter.new_cache()
        positions = torch.arange(len(sequence))
        setup.drafter.extend_context(setup.target.features(sequence[None])[0], positions, cache)
        anchors = positions[len(prompt) : -1]
        logits = setup.drafter.blocks_logits(
            cache, sequence[anchors], anchors, setup.target.embed_tokens, setup.target.lm_head
        )
        training = torch.stack([setup.logits[setup.anchor(document, int(p))] for p in anchors])
        torch.testing.assert_close(logits, training, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("document", [0, 1])
def test_the_real_loops_rounds_and_logits_follow_the_training_forward(setup: Setup, document: int):
    """The speculative loop (features from the verification forwards, the context cache grown round by
    round) and the real tree verification against the training forward: the same rounds, the same
    logits at each round's anchor."""
    prompt, answer = setup.sequences[document]
    recording = RecordingDrafter(setup.drafter)
    result = speculative_generate(setup.target, recording, prompt, len(answer))
    assert result.tokens == answer
    leading = per_position(setup, document, setup.leading)
    expected = rounds_from_training(leading, len(prompt), len(answer))
    assert [(p, n) for (p, _), n in zip(recording.rounds, result.acceptance_lengths, strict=True)] == expected
    for position, logits in recording.rounds:
        training = setup.logits[setup.anchor(document, position)]
        torch.testing.assert_close(logits, training, rtol=1e-4, atol=1e-4)
    tokens, lengths = verified_tree_decode(
        setup.target, setup.drafter, prompt, len(answer), frozenset(), BUDGET, TOP_K
    )
    tree = per_position(setup, document, setup.tree)
    assert tokens == answer
    assert lengths == [length for _, length in rounds_from_training(tree, len(prompt), len(answer))]


def test_the_training_streak_is_the_uniform_anchor_mean_of_the_rounds_acceptance(setup: Setup):
    """`streak` (what training logs) is the mean over every anchor of the drafts a round there would
    accept; eval's per-round mean weighs the anchors its rounds land on. Both from the same counts."""
    every = [
        count
        for document in range(len(PROMPTS))
        for count in per_position(setup, document, setup.leading).values()
    ]
    assert float(setup.streak) == pytest.approx(sum(every) / len(every))
