"""The one evaluator (`app.evaluate.evaluator`): its settings from the config or the caller, the
target's greedy answers decoded once, the replay, the predictability table and the lossless check
run with the evaluator's prompts, budget, stop tokens and precision, and the drafter's training mode
kept. A small random target and an untrained drafter on the CPU, in this process."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import AutoTokenizer

from app.config import validate_config
from app.errors import UserError
from app.evaluate import evaluator as evaluator_module
from app.evaluate import replay
from app.evaluate.evaluator import Evaluator, decoding
from app.evaluate.predictability import answer_predictability
from app.evaluate.replay import evaluate_replay
from app.model.target import load_target
from tests.test_replay import Clock
from tests.test_speculative import AutocastWitness, greedy_reference, random_target_config, target_and_drafter

PROMPTS = [[5, 9, 11], list(range(40, 47))]
DOMAINS = ["code", "prose"]


def settings(**train) -> dict:
    raw = random_target_config()
    raw["train"].update(train)
    return raw


@pytest.fixture(scope="module")
def model():
    return target_and_drafter(random_target_config())


def test_the_settings_come_from_the_config_unless_given(model, tiny_tokenizer):
    target, _ = model
    config = validate_config(settings(eval_max_new_tokens=9, eval_tree_budget=24, eval_tree_top_k=3))
    prompts = [tuple(prompt) for prompt in PROMPTS]
    defaults = Evaluator(config, target, tiny_tokenizer, prompts, domains=tuple(DOMAINS))
    assert defaults.prompts == PROMPTS and defaults.domains == DOMAINS
    assert (defaults.max_new_tokens, defaults.tree_budgets, defaults.tree_top_k) == (9, [24], 3)
    assert defaults.stop_token_ids == [tiny_tokenizer.eos_token_id]
    assert defaults.pad_token_id == tiny_tokenizer.pad_token_id
    assert defaults.autocast_dtype is None  # bf16 training on the CPU: eval in fp32, as training ran
    assert defaults.progress is None

    given = Evaluator(config, target, tiny_tokenizer, prompts, 5, (4, 16), 2)
    assert (given.max_new_tokens, given.tree_budgets, given.tree_top_k, given.domains) == (
        5,
        [4, 16],
        2,
        None,
    )
    assert Evaluator(config, target, tiny_tokenizer, prompts, tree_budgets=[]).tree_budgets == []
    no_tree = validate_config(settings(eval_tree_budget=0))
    assert Evaluator(no_tree, target, tiny_tokenizer, prompts).tree_budgets == []

    other = AutoTokenizer.from_pretrained(tiny_tokenizer.name_or_path)
    other.pad_token = other.eos_token
    assert Evaluator(config, target, other, prompts).pad_token_id == other.eos_token_id != 0
    other.pad_token = None
    assert Evaluator(config, target, other, prompts).pad_token_id == 0


def test_a_bf16_run_on_cuda_evaluates_its_drafter_under_bf16_autocast(tiny_tokenizer):
    """The target's weights as fake CUDA tensors (no GPU here): only where the evaluator reads the
    target's device."""
    raw = random_target_config()
    target = load_target(validate_config(raw), "cpu")
    with FakeTensorMode():
        target.embed_tokens.weight = torch.nn.Parameter(torch.empty(300, 64, device="cuda"), False)
    assert target.device.type == "cuda"
    for precision, dtype in [("bf16", torch.bfloat16), ("fp32", None)]:
        config = validate_config(settings(precision=precision))
        assert Evaluator(config, target, tiny_tokenizer, PROMPTS).autocast_dtype == dtype, precision


def test_no_prompts_or_a_domain_per_prompt_missing_are_refused(model, tiny_tokenizer):
    target, _ = model
    config = validate_config(random_target_config())
    with pytest.raises(UserError) as refused:
        Evaluator(config, target, tiny_tokenizer, [])
    assert str(refused.value) == "eval: no prompts to evaluate"
    with pytest.raises(ValueError) as refused:
        Evaluator(config, target, tiny_tokenizer, PROMPTS, domains=["code"])
    assert str(refused.value) == "eval: 1 domains for 2 prompts"


def test_the_answers_are_the_target_s_greedy_decode_cut_at_the_first_stop_and_decoded_once(
    model, tiny_tokenizer, monkeypatch
):
    target, _ = model
    free = [greedy_reference(target, prompt, 8, None) for prompt in PROMPTS]
    stop = free[1][2]
    configured = target.model.generation_config.eos_token_id
    target.model.generation_config.eos_token_id = stop
    heard: list[str] = []
    monkeypatch.setattr(evaluator_module, "time", Clock(0.5))  # the decode takes 0.5 s
    try:
        evaluator = Evaluator(
            validate_config(random_target_config()), target, tiny_tokenizer, PROMPTS, 8, progress=heard.append
        )
        answers = evaluator.answers
    finally:
        target.model.generation_config.eos_token_id = configured
    assert stop in evaluator.stop_token_ids
    cut = [reference[: reference.index(stop) + 1] if stop in reference else reference for reference in free]
    assert answers == cut
    assert heard[0] == "eval: the target answers 2 prompts (up to 8 tokens each)"
    tokens = sum(map(len, cut))
    assert heard[1] == f"eval: {tokens} answer tokens in 0.5s ({2 * tokens} tok/s)"
    assert evaluator.answers is answers and len(heard) == 2  # decoded once


def test_a_call_replays_the_rounds_with_the_evaluator_s_settings_and_keeps_the_training_mode(
    model, tiny_tokenizer, monkeypatch
):
    target, drafter = model
    config = validate_config(settings(eval_tree_top_k=3))
    heard: list[str] = []
    evaluator = Evaluator(
        config, target, tiny_tokenizer, PROMPTS, 8, [4, 16], domains=DOMAINS, progress=heard.append
    )
    answers = evaluator.answers
    monkeypatch.setattr(replay, "PROGRESS_EVERY_S", -1.0)  # a progress line after every prompt
    drafter.train()
    result = evaluator(drafter)
    assert drafter.training
    expected = evaluate_replay(target, drafter.eval(), PROMPTS, answers, [4, 16], 3, None, DOMAINS)
    drafter.train()
    assert result.report() == expected.report() and list(result.by_domain()) == DOMAINS
    assert [tree.top_k for tree in result.trees] == [3, 3]
    assert heard[2:] == [f"eval: replayed the rounds of {n}/2 prompts" for n in (1, 2)]

    witness = AutocastWitness(drafter.arch)
    evaluator.autocast_dtype = torch.bfloat16  # as on a bf16 CUDA run
    evaluator(witness)
    assert witness.seen == {torch.bfloat16}


def test_the_predictability_is_of_the_evaluator_s_answers_per_domain_in_its_precision(model, tiny_tokenizer):
    target, _ = model
    config = validate_config(random_target_config())
    evaluator = Evaluator(config, target, tiny_tokenizer, PROMPTS, 6, domains=DOMAINS)
    table = evaluator.predictability
    assert table == answer_predictability(target, PROMPTS, evaluator.answers, DOMAINS)
    assert list(table) == ["all", *DOMAINS]
    half = Evaluator(config, target, tiny_tokenizer, PROMPTS, 6, domains=DOMAINS)
    half.autocast_dtype = torch.bfloat16
    in_bf16 = half.predictability
    assert in_bf16 == answer_predictability(target, PROMPTS, half.answers, DOMAINS, torch.bfloat16)
    assert in_bf16["all"]["entropy_bits"] != table["all"]["entropy_bits"]


def test_the_lossless_check_decodes_with_the_evaluator_s_budget_stop_tokens_and_precision(
    model, tiny_tokenizer
):
    target, drafter = model
    free = greedy_reference(target, PROMPTS[1], 8, None)
    configured = target.model.generation_config.eos_token_id
    target.model.generation_config.eos_token_id = free[3]
    try:
        evaluator = Evaluator(
            validate_config(random_target_config()), target, tiny_tokenizer, PROMPTS, 8, [8], 2
        )
        drafter.train()
        result = evaluator(drafter)
        check = evaluator.check_lossless(drafter, result)
        assert drafter.training
        assert check.ok and (check.prompts, check.chain_equal, check.tree_equal, check.tree_budget) == (
            2,
            2,
            2,
            8,
        )
        assert result.per_prompt[1].tokens == free[: free.index(free[3]) + 1]
        witness = AutocastWitness(drafter.arch)
        evaluator.autocast_dtype = torch.bfloat16
        evaluator.check_lossless(witness, result)
        assert witness.seen == {torch.bfloat16}
    finally:
        target.model.generation_config.eos_token_id = configured


def test_decoding_runs_the_drafter_in_eval_mode_eagerly_and_restores_its_mode(model):
    _, drafter = model
    for training in (True, False):
        drafter.train(training)
        with decoding(drafter):
            assert not drafter.training
        assert drafter.training is training
    drafter.train()
    with pytest.raises(RuntimeError, match="inside"), decoding(drafter):
        raise RuntimeError("inside")
    assert drafter.training
