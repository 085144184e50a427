"""Speculative decoding and tau: lossless against the target's own greedy decode, exact acceptance
accounting, both target-state paths (KV cache cropped, recompute for hybrid targets), a trained
drafter accepting clearly more than an untrained one, prompts, and the `dflash eval` CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from app.config import BUILTIN_TARGETS, validate_config
from app.data.batch import TargetBatch
from app.data.packing import pack_features, pack_row
from app.errors import UserError
from app.evaluate import EvalResult, evaluate_tau, prompts_from_file, speculative_generate
from app.evaluate.evaluator import Evaluator
from app.evaluate.speculative import _open_session, _RecomputedTarget, _stop_ids, cut_round
from app.evaluate.tree import verified_tree_decode
from app.model.drafter import DFlashDrafter, DrafterArch
from app.model.objective import drafter_loss
from app.model.target import TargetModel, load_target
from app.model.tiny_lm import chat_sample
from app.model.tiny_tokenizer import MASK_TOKEN_ID, corpus_paragraphs
from tests.helpers import dflash

EOS = 2  # <|im_end|> of the tiny tokenizer


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """One intra-op thread: on a shared 2-core machine, OpenMP barriers between two threads cost
    milliseconds per op whenever another process holds the other core, and these models are tiny
    (measured: a drafter training step 0.45 s on 1 thread, 1.1 to 4.5 s on 2)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def random_target_config(model_type: str = "qwen3", **extra) -> dict:
    return {
        "target": {
            "architecture": {
                "model_type": model_type,
                "vocab_size": 300,
                "hidden_size": 64,
                "intermediate_size": 96,
                "num_hidden_layers": 8,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                **extra,
            }
        },
        "drafter": {"num_layers": 2, "block_size": 4, "mask_token_id": 7},
        "data": {"token_budget": 128, "max_length": 64},
        "train": {"anchors": 16, "device": "cpu"},
    }


def answers_batch(sequences: list[tuple[list[int], list[int]]], first_index: int = 0) -> TargetBatch:
    """`(prompt, answer)` pairs as one right-padded target batch, the answers supervised."""
    width = max(len(p) + len(a) for p, a in sequences)
    input_ids = torch.zeros(len(sequences), width, dtype=torch.long)
    attention_mask = torch.zeros(len(sequences), width, dtype=torch.long)
    loss_mask = torch.zeros(len(sequences), width, dtype=torch.bool)
    for row, (prompt, answer) in enumerate(sequences):
        input_ids[row, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        attention_mask[row, : len(prompt) + len(answer)] = 1
        loss_mask[row, len(prompt) : len(prompt) + len(answer)] = True
    indices = torch.arange(first_index, first_index + len(sequences))
    return TargetBatch(input_ids, attention_mask, loss_mask, indices)


HYBRID_LINEAR = {
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}
"""The linear-attention sizes of the small hybrid (Gated DeltaNet + attention) target these tests use."""


def target_and_drafter(raw: dict, seed: int = 0) -> tuple[TargetModel, DFlashDrafter]:
    config = validate_config(raw)
    target = load_target(config, "cpu")
    return target, DFlashDrafter(DrafterArch.from_config(config, target), seed=seed)


def greedy_reference(
    target: TargetModel, prompt: list[int], max_new_tokens: int, eos: int | None
) -> list[int]:
    """The target's own greedy decode (HF generate), stopping after `eos` like the speculative loop."""
    output = target.model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return output[0, len(prompt) :].tolist()


class ScriptedDrafter(DFlashDrafter):
    """The real drafter's context bookkeeping with drafts read from the known greedy continuation:
    the first `correct` slots of every block are right and the rest wrong, so every round must
    emit exactly `correct + 1` tokens. Also checks that the context cache holds exactly the
    tokens before the anchor, at their positions."""

    def __init__(self, arch: DrafterArch, prompt_length: int, continuation: list[int], correct: int):
        super().__init__(arch)
        self.prompt_length, self.continuation, self.correct = prompt_length, continuation, correct

    def draft(self, cache, last_token_id, position, embed_tokens, lm_head):
        device = cache.positions.device
        assert torch.equal(cache.positions, torch.arange(position, device=device)), (
            "context cache out of step"
        )
        start = position + 1 - self.prompt_length  # continuation index of the token at position + 1
        truth = (self.continuation + [0] * self.arch.block_size)[start : start + self.arch.block_size - 1]
        wrong = [(token + 1) % self.arch.vocab_size for token in truth]
        return torch.tensor(truth[: self.correct] + wrong[self.correct :], device=device)


def expected_acceptance(generated: int, correct: int) -> list[int]:
    """Rounds after the prefill token, each emitting correct + 1 tokens, the last one cut to what is left."""
    lengths, emitted = [], 1
    while emitted < generated:
        lengths.append(min(correct + 1, generated - emitted))
        emitted += lengths[-1]
    return lengths


@pytest.fixture(scope="module")
def random_qwen3():
    return target_and_drafter(random_target_config())


def test_untrained_drafter_output_equals_the_targets_greedy_decode(random_qwen3) -> None:
    target, drafter = random_qwen3
    generator = torch.Generator().manual_seed(0)
    for length in (1, 5, 17):
        prompt = torch.randint(0, 300, (length,), generator=generator).tolist()
        result = speculative_generate(target, drafter, prompt, 12)
        assert result.tokens == greedy_reference(target, prompt, 12, None)
        assert result.target_cache == "kv-cache"
        assert sum(result.acceptance_lengths) == 11 and all(1 <= n <= 4 for n in result.acceptance_lengths)


@pytest.fixture(scope="module")
def known_continuation(random_qwen3):
    """A prompt and the random target's greedy continuation of it (23 tokens)."""
    target, _ = random_qwen3
    prompt = list(range(40, 51))
    return prompt, greedy_reference(target, prompt, 23, None)


@pytest.mark.parametrize("correct", [0, 1, 2, 3])
def test_acceptance_is_the_matching_prefix_plus_one_and_the_cache_follows(
    random_qwen3, known_continuation, correct: int
) -> None:
    target, drafter = random_qwen3
    prompt, reference = known_continuation
    scripted = ScriptedDrafter(drafter.arch, len(prompt), reference, correct)
    result = speculative_generate(target, scripted, prompt, 23)
    assert result.tokens == reference
    assert result.acceptance_lengths == expected_acceptance(23, correct)


def test_generation_stops_after_the_first_end_of_sequence_token(random_qwen3) -> None:
    target, drafter = random_qwen3
    prompt = list(range(60, 70))
    free = greedy_reference(target, prompt, 16, None)
    eos = free[9]  # a token the target emits mid-block, possibly inside an accepted run
    reference = greedy_reference(target, prompt, 16, eos)
    scripted = ScriptedDrafter(drafter.arch, len(prompt), free, correct=3)
    unused = next(token for token in range(300) if token not in free)  # a second stop id that never comes
    result = speculative_generate(target, scripted, prompt, 16, eos_token_id=[eos, unused])
    assert result.tokens == reference and result.tokens[-1] == eos and eos not in result.tokens[:-1]
    assert result.acceptance_lengths == expected_acceptance(len(reference), 3)


def test_hybrid_linear_attention_target_recomputes_and_stays_lossless() -> None:
    target, drafter = target_and_drafter(random_target_config("qwen3_5_text", **HYBRID_LINEAR))
    prompt = list(range(20, 32))
    reference = greedy_reference(target, prompt, 9, None)
    result = speculative_generate(
        target, ScriptedDrafter(drafter.arch, len(prompt), reference, correct=2), prompt, 9
    )
    assert result.target_cache == "recompute"
    assert result.tokens == reference and result.acceptance_lengths == [3, 3, 2]


def test_decode_features_equal_the_training_features(random_qwen3) -> None:
    """The drafter must see at eval exactly what it trained on: verify-forward features (KV cache,
    cropped) equal `TargetModel.features` of the whole sequence."""
    target, _ = random_qwen3
    sequence = torch.arange(30, 52)
    session = _open_session(target)
    _, prompt_features = session.forward(sequence[:12], logits_for=1)
    session.commit(12)
    _, block_features = session.forward(sequence[12:16], logits_for=4)
    session.commit(2)  # two of the block's tokens kept, two dropped
    _, next_features = session.forward(sequence[14:22], logits_for=8)
    decoded = torch.cat([prompt_features, block_features[:2], next_features])
    training = target.features(sequence[None, :22])[0]
    torch.testing.assert_close(decoded, training, rtol=1e-4, atol=1e-4)


def test_eval_result_pools_rounds_and_histograms(random_qwen3, known_continuation) -> None:
    target, drafter = random_qwen3
    prompt, reference = known_continuation
    short = list(range(70, 75))
    scripted = [
        speculative_generate(target, ScriptedDrafter(drafter.arch, len(prompt), reference, 3), prompt, 12),
        speculative_generate(
            target, ScriptedDrafter(drafter.arch, 5, greedy_reference(target, short, 12, None), 1), short, 12
        ),
    ]
    assert [r.acceptance_lengths for r in scripted] == [[4, 4, 3], [2, 2, 2, 2, 2, 1]]
    pooled = EvalResult(tau=20 / 9, rounds=9, generated_tokens=24, block_size=4, target_cache="kv-cache")
    pooled.per_prompt = scripted
    assert pooled.histogram == [1, 5, 1, 2]
    assert pooled.tokens_per_target_forward == pytest.approx(24 / 11)  # 9 rounds + 2 prefills
    prompts = [prompt, short]
    untrained = evaluate_tau(target, drafter, prompts, 12)
    assert untrained.rounds == sum(len(r.acceptance_lengths) for r in untrained.per_prompt)
    assert untrained.generated_tokens == 24 and untrained.block_size == 4
    assert sum(untrained.histogram) == untrained.rounds
    assert untrained.tau == pytest.approx(22 / untrained.rounds)
    lines = "\n".join(untrained.describe())
    assert (
        "tau (mean acceptance length, max 4; the serving engines' `accept length`)" in lines
        and "acceptance histogram" in lines
    )


def test_bad_inputs_are_one_line_user_errors(random_qwen3) -> None:
    target, drafter = random_qwen3
    with pytest.raises(UserError, match="a prompt has no tokens"):
        speculative_generate(target, drafter, [], 4)
    with pytest.raises(UserError, match=r"prompt token ids \[300\] are outside the target vocabulary"):
        speculative_generate(target, drafter, [1, 300], 4)
    with pytest.raises(UserError, match="max_new_tokens must be >= 1"):
        speculative_generate(target, drafter, [1, 2], 0)
    other_taps = {
        **random_target_config(),
        "drafter": {"num_layers": 2, "block_size": 4, "mask_token_id": 7, "target_layer_ids": [2, 6]},
    }
    other = DFlashDrafter(DrafterArch.from_config(validate_config(other_taps)))
    with pytest.raises(UserError, match=r"reads target layers \[2, 6\] but the target taps \[1, 5\]"):
        speculative_generate(target, other, [1, 2], 4)
    with pytest.raises(UserError, match="no prompts"):
        evaluate_tau(target, drafter, [], 4)


# ---- the built-in tiny-lm: tau of an untrained vs a trained drafter ------------------------------


def tiny_config():
    return validate_config(
        {
            "target": {"builtin": "tiny-lm"},
            "drafter": {"num_layers": 2, "block_size": 8, "mask_token_id": MASK_TOKEN_ID},
            "data": {"token_budget": 512, "max_length": 512},
            "train": {"anchors": 64, "device": "cpu"},
        }
    )


@pytest.fixture(scope="module")
def tiny(tiny_lm_dir):
    config = tiny_config()
    tokenizer = AutoTokenizer.from_pretrained(tiny_lm_dir)
    paragraphs = [p for p in corpus_paragraphs() if len(p.split()) >= 24]
    prompts = [
        tokenizer.apply_chat_template(chat_sample(p)[:1], tokenize=False, add_generation_prompt=True)
        for p in paragraphs
    ]
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompts]
    return config, load_target(config, "cpu"), ids


def greedy_batch(target: TargetModel, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The target's greedy continuations of many prompts at once (left-padded), cut after <|im_end|>."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    output = target.model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=EOS,
    )
    continuations = []
    for row in output[:, width:].tolist():
        continuations.append(row[: row.index(EOS) + 1] if EOS in row else row)
    return continuations


def train_on_own_outputs(config, target: TargetModel, prompts: list[list[int]], steps: int) -> DFlashDrafter:
    """A few hundred AdamW steps of the DFlash objective on the target's own greedy outputs."""
    answers = greedy_batch(target, prompts, 48)
    sequences = [(p, a) for p, a in zip(prompts, answers, strict=True) if len(a) >= 4]
    per_batch = config.data.token_budget // max(len(p) + len(a) for p, a in sequences)
    batches = []
    for start in range(0, len(sequences), per_batch):
        batch = answers_batch(sequences[start : start + per_batch], first_index=start)
        batches.append((batch, target.features(batch.input_ids)))

    torch.manual_seed(0)
    drafter = DFlashDrafter(DrafterArch.from_config(config, target), seed=0)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3, betas=(0.9, 0.95))
    for step in range(steps):
        index = step % len(batches)
        batch, features = batches[index]
        budget, anchors, epoch = config.data.token_budget, config.train.anchors, step // len(batches)
        row = pack_row(
            batch, token_budget=budget, anchors=anchors, pad_token_id=0, seed=0, epoch=epoch, index=index
        )
        for group in optimizer.param_groups:
            group["lr"] = 3e-3 * min(1.0, (step + 1) / 20) * (1 - step / steps)
        loss = drafter_loss(
            drafter, pack_features(batch, features, row), target.embed_tokens, target.lm_head
        ).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return drafter


@pytest.mark.slow
def test_a_trained_drafter_accepts_clearly_more_and_stays_lossless(tiny, tiny_lm_dir) -> None:
    """Measured (8 held-out prompts x 32 tokens, block 8, 2-layer drafter, 96 training prompts, rows of
    512 tokens with 64 anchors): untrained tau 1.00, trained 200 steps 1.65, 300 steps 2.75 (about 75 s
    on the dev machine). With 1024-token rows and 128 anchors: 200 steps 2.42 here, and 300 steps 2.08
    with the tiny-lm that torch 2.11 builds (it differs per torch version). Hence the margin: trained
    >= 1.5 and >= 0.5 above untrained."""
    config, target, prompts = tiny
    held_out, train = prompts[:8], prompts[8:104]
    untrained = DFlashDrafter(DrafterArch.from_config(config, target), seed=0)
    before = evaluate_tau(target, untrained, held_out, 32, eos_token_id=EOS)
    assert before.tau < 1.3

    trained = train_on_own_outputs(config, target, train, steps=300)
    after = evaluate_tau(target, trained, held_out, 32, eos_token_id=EOS)
    assert after.tau >= 1.5 and after.tau - before.tau >= 0.5, (before.tau, after.tau)
    assert max(length for r in after.per_prompt for length in r.acceptance_lengths) > 3
    for prompt, result in zip(held_out, after.per_prompt, strict=True):
        assert result.tokens == greedy_reference(target, prompt, 32, EOS)

    # eval's replay: the same rounds as the loop, chain and tree, from the batched greedy decode
    evaluator = Evaluator(config, target, AutoTokenizer.from_pretrained(tiny_lm_dir), held_out, 32, [16], 4)
    replayed = evaluator(trained)
    assert [r.tokens for r in replayed.per_prompt] == [r.tokens for r in after.per_prompt]
    assert [r.acceptance_lengths for r in replayed.per_prompt] == [
        r.acceptance_lengths for r in after.per_prompt
    ]
    for prompt, tree_lengths in zip(held_out, replayed.trees[0].acceptance_lengths, strict=True):
        _, verified = verified_tree_decode(target, trained, prompt, 32, frozenset([EOS]), budget=16, top_k=4)
        assert tree_lengths == verified
    assert replayed.trees[0].tau > replayed.tau


# ---- prompts and the CLI ------------------------------------------------------------------------


def write_conversations(path: Path) -> Path:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Continue: The linear layer"},
        {"role": "assistant", "content": "applies"},
    ]
    records = [
        {"messages": messages},
        {"conversations": [{"from": "human", "value": "Continue: Applies a transformation"}]},
        {"messages": "not a list"},
    ]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_prompts_are_the_turns_before_the_first_reply_with_the_generation_prompt(
    tmp_path, tiny_tokenizer
) -> None:
    prompts = prompts_from_file(write_conversations(tmp_path / "eval.jsonl"), tiny_tokenizer, limit=5)
    assert len(prompts.ids) == 2 and prompts.domains == ["", ""]  # the malformed record is skipped
    first = tiny_tokenizer.decode(prompts.ids[0])
    assert first == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nContinue: The linear layer<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert "applies" not in first
    with pytest.raises(UserError, match=r"--data: .*missing\.jsonl: file not found"):
        prompts_from_file(tmp_path / "missing.jsonl", tiny_tokenizer, limit=5)
    (tmp_path / "bad.jsonl").write_text('{"messages": "nope"}\n')
    with pytest.raises(UserError, match="no usable conversation among 1 records"):
        prompts_from_file(tmp_path / "bad.jsonl", tiny_tokenizer, limit=5)


def test_eval_cli_prints_tau_and_the_histogram(tmp_path, tiny_tokenizer_dir, capsys, monkeypatch) -> None:
    """The `dflash` entry point in this process (a new interpreter would add ~10 s of CPU per call and
    test nothing more here), one intra-op thread (`single_thread`)."""
    from app.checkpoint.store import save_checkpoint

    raw = {
        "target": {"architecture": BUILTIN_TARGETS["tiny-lm"], "tokenizer": str(tiny_tokenizer_dir)},
        "drafter": {"num_layers": 1, "block_size": 4, "mask_token_id": MASK_TOKEN_ID},
        "data": {"token_budget": 256, "max_length": 128},
        "train": {"anchors": 16, "device": "cpu"},
    }
    config = validate_config(raw)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(config.model_dump(mode="json")))
    drafter = DFlashDrafter(DrafterArch.from_config(config), seed=0)
    save_checkpoint(run_dir, 3, drafter.state_dict(), {}, {"cpu": torch.get_rng_state()}, {}, keep_last=1)

    data = write_conversations(tmp_path / "c.jsonl")
    command = ["eval", str(run_dir), "--data", str(data), "--prompts", "2", "--max-new-tokens", "6"]
    options = ["--tree-budget", "4,16", "--tree-top-k", "3", "--per-prompt", "--check-lossless"]
    done = dflash(capsys, monkeypatch, *command, *options, "--json", str(tmp_path / "eval.json"))
    assert done.returncode == 0, done.stderr
    assert "eval: step 3" in done.stdout and "2 prompts" in done.stdout
    assert "tau (mean acceptance length, max 4; the serving engines' `accept length`):" in done.stdout
    assert "target state between rounds: replay (the rounds replayed" in done.stdout
    assert "acceptance histogram" in done.stdout and "    1: " in done.stdout
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["step"] == 3 and report["prompts"] == 2
    tokens = report["target_predictability"]["all"]["tokens"]
    assert tokens == report["generated_tokens"] and f"target's answers, all: {tokens} tokens" in done.stdout
    for budget in (4, 16):
        printed = re.search(
            rf"tree tau \(DDTree, budget {budget}, top-3 per depth\): (\d\.\d{{3}}) ", done.stdout
        )
        assert printed and printed[1] == f"{report['trees'][str(budget)]['tau']:.3f}"  # the JSON's number
    assert re.search(
        r"prompt 1: \d+ tokens, chain tau \d\.\d{3}, tree tau \(budget 4\) \d\.\d{3}, tree tau \(budget 16\)",
        done.stdout,
    )

    assert (
        "lossless: the speculative loop's output equals the target's greedy decode, and its rounds the "
        "replayed ones, on 2/2 prompts; the real "
        "tree-verification forward (budget 4) equals it and tree tau's acceptance on 2/2"
    ) in done.stdout

    bad = dflash(capsys, monkeypatch, *command, "--tree-budget", "4,lots")
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "dflash: error: --tree-budget: expected integers >= 0 separated by commas, got '4,lots'"
    )


def test_the_evaluator_stops_at_every_end_token_and_keeps_the_training_mode(tiny_tokenizer):
    """The one stop rule of periodic eval, `dflash eval` and the demo: the tokenizer's end token and
    every end token of the target's generation config (as a serving engine stops)."""
    raw = random_target_config()
    target, drafter = target_and_drafter(raw)
    prompt = [5, 9, 11]
    continuation = greedy_reference(target, prompt, 12, None)
    target.model.generation_config.eos_token_id = [continuation[3]]
    evaluator = Evaluator(validate_config(raw), target, tiny_tokenizer, [prompt], max_new_tokens=12)
    stops = {continuation[3], tiny_tokenizer.eos_token_id}
    assert set(evaluator.stop_token_ids) == stops
    first_stop = next(index for index, token in enumerate(continuation) if token in stops)
    drafter.train()
    result = evaluator(drafter)
    assert result.per_prompt[0].tokens == continuation[: first_stop + 1]
    assert drafter.training


# ---- the checks and settings around the loop ----------------------------------------------------------


def test_a_drafter_for_another_target_or_on_another_device_is_refused_naming_both(random_qwen3) -> None:
    target, drafter = random_qwen3
    taps = {"num_layers": 1, "block_size": 4, "mask_token_id": 7, "target_layer_ids": [1, 5]}
    for extra, message in [
        (
            {"hidden_size": 32},
            "the drafter was built for a 8-layer target of hidden size 32, the target has 8 layers of hidden size 64",
        ),
        (
            {"num_hidden_layers": 7},
            "the drafter was built for a 7-layer target of hidden size 64, the target has 8 layers of hidden size 64",
        ),
        ({"vocab_size": 301}, "the drafter predicts over 301 tokens, the target embedding has 300 rows"),
    ]:
        other = DFlashDrafter(
            DrafterArch.from_config(validate_config({**random_target_config(**extra), "drafter": taps}))
        )
        with pytest.raises(UserError) as refused:
            speculative_generate(target, other, [1, 2], 4)
        assert str(refused.value) == f"eval: {message}"
    elsewhere = DFlashDrafter(drafter.arch).to("meta")
    with pytest.raises(ValueError) as refused:
        speculative_generate(target, elsewhere, [1, 2], 4)
    assert str(refused.value) == "eval: drafter on meta, target on cpu: put them together"
    with pytest.raises(UserError) as refused:
        speculative_generate(target, drafter, [-1, 300, 301, 302, 303, 304, 5], 4)
    assert str(refused.value) == (
        "eval: prompt token ids [-1, 300, 301, 302, 303] are outside the target vocabulary [0, 300)"
    )
    assert speculative_generate(target, drafter, [0, 299], 1).tokens == greedy_reference(
        target, [0, 299], 1, None
    )
    for prompts, message in [([[]], "eval: a prompt has no tokens"), ([], "eval: no prompts to evaluate")]:
        with pytest.raises(UserError) as refused:
            evaluate_tau(target, drafter, prompts, 4)
        assert str(refused.value) == message


def test_evaluate_tau_stops_every_prompt_at_its_end_token(random_qwen3) -> None:
    target, drafter = random_qwen3
    prompts = [list(range(60, 70)), [3, 1, 4, 1, 5]]
    free = [greedy_reference(target, prompt, 12, None) for prompt in prompts]
    stops = [free[0][4], free[1][6]]
    result = evaluate_tau(target, drafter, prompts, 12, eos_token_id=stops)
    for generated, reference in zip(result.per_prompt, free, strict=True):
        first = next(index for index, token in enumerate(reference) if token in stops)
        assert generated.tokens == reference[: first + 1]


def test_stop_ids_come_as_one_id_or_many_and_a_round_is_cut_after_the_first() -> None:
    assert _stop_ids(None) == frozenset()
    assert cut_round([5, 6, 7, 8], 10, frozenset({6, 8})) == [5, 6]  # through the first stop id
    assert cut_round([5, 6, 7], 2, frozenset({9})) == [5, 6]  # to the room left
    assert cut_round([5, 6, 7], 3, frozenset({7})) == [5, 6, 7] and cut_round([4], 1, frozenset({4})) == [4]
    assert _stop_ids(7) == frozenset({7})
    many = _stop_ids(torch.tensor([3, 4]))
    assert many == frozenset({3, 4}) and all(type(token) is int for token in many)


class AutocastWitness(DFlashDrafter):
    """The real drafter, noting the autocast dtype each of its calls ran under (None: no autocast)."""

    def __init__(self, arch: DrafterArch) -> None:
        super().__init__(arch, seed=0)
        self.seen: set[torch.dtype | None] = set()

    def _note(self) -> None:
        self.seen.add(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)

    def extend_context(self, *args, **kwargs):
        self._note()
        return super().extend_context(*args, **kwargs)

    def draft(self, *args, **kwargs):
        self._note()
        return super().draft(*args, **kwargs)


def test_the_drafter_runs_under_the_asked_autocast_and_the_output_stays_the_target_s(random_qwen3) -> None:
    target, drafter = random_qwen3
    prompt = [9, 8, 7, 6, 5]
    witness = AutocastWitness(drafter.arch)
    result = speculative_generate(target, witness, prompt, 10, autocast_dtype=torch.bfloat16)
    assert witness.seen == {torch.bfloat16} and result.tokens == greedy_reference(target, prompt, 10, None)
    plain = AutocastWitness(drafter.arch)
    evaluate_tau(target, plain, [prompt], 10)
    assert plain.seen == {None}
    evaluated = AutocastWitness(drafter.arch)
    evaluate_tau(target, evaluated, [prompt], 10, autocast_dtype=torch.bfloat16)
    assert evaluated.seen == {torch.bfloat16}
    half = AutocastWitness(drafter.arch)  # not the CPU's default autocast dtype (bf16): asked for, so taken
    speculative_generate(target, half, prompt, 10, autocast_dtype=torch.float16)
    assert half.seen == {torch.float16}


def test_a_sliding_window_target_recomputes_and_stays_lossless() -> None:
    raw = random_target_config(use_sliding_window=True, sliding_window=4, max_window_layers=4)
    target, drafter = target_and_drafter(raw)
    assert "sliding_attention" in target.text_config.layer_types
    prompt = list(range(20, 32))
    result = speculative_generate(target, drafter, prompt, 6)
    assert result.target_cache == "recompute" and result.tokens == greedy_reference(target, prompt, 6, None)


def test_a_session_gives_the_logits_asked_for_and_a_commit_with_nothing_pending_keeps_the_state(
    random_qwen3,
) -> None:
    target, _ = random_qwen3
    sequence = torch.arange(30, 40)
    cached, recomputed = _open_session(target), _RecomputedTarget(target)
    for session in (cached, recomputed):
        session.commit(0)  # nothing run yet: nothing to keep
        logits, features = session.forward(sequence[:6], logits_for=1)
        assert tuple(logits.shape) == (1, 300) and tuple(features.shape) == (6, 128)
        session.commit(6)
        session.commit(0)  # nothing pending since: the six stay
        logits, _ = session.forward(sequence[6:9], logits_for=2)
        assert tuple(logits.shape) == (2, 300)
    assert cached.cache.get_seq_length() == 9 and recomputed.accepted.tolist() == list(range(30, 36))
