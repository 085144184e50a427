"""Eval's prompts (`app.evaluate.prompts`): a conversation file's turns before the first reply rendered
with the target's chat template, a tokenized dataset's tokens before the first supervised one, and the
first `limit` of each domain (in-process, the tiny tokenizer)."""

from __future__ import annotations

import json

import datasets
import pytest

from app.data.dataset import DataSummary, TokenizedDataset
from app.errors import UserError
from app.evaluate.prompts import first_per_domain, prompts_from_dataset, prompts_from_file


def dataset(ids: list[list[int]], masks: list[list[bool]], domains: list[str] | None) -> TokenizedDataset:
    columns = {
        "input_ids": ids,
        "loss_mask": masks,
        "length": [len(i) for i in ids],
        "supervised": [sum(m) for m in masks],
    }
    if domains is not None:
        columns["domain"] = domains
    return TokenizedDataset(
        datasets.Dataset.from_dict(columns), DataSummary(files=[], min_supervised_tokens=0)
    )


def write_records(path, records) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def conversation(text: str, domain: str | None = None) -> dict:
    record: dict = {
        "messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "reply"}]
    }
    if domain is not None:
        record["domain"] = domain
    return record


def test_first_per_domain_takes_the_first_limit_of_each_domain_in_order():
    assert first_per_domain(["a", "b", "a", "a", "b", "c"], 2) == [0, 1, 2, 4, 5]
    assert first_per_domain(["a", "b", "a"], 1) == [0, 1]
    assert first_per_domain(["a", "", "", "a"], 1) == [0, 1]  # "" is a domain of its own once any has one
    assert first_per_domain(["a", "a"], 0) == []
    assert first_per_domain(["", "", ""], 2) == [0, 1]
    assert first_per_domain(["", ""], 5) == [0, 1]
    assert first_per_domain([], 3) == []


def test_a_dataset_prompt_is_the_tokens_before_the_first_supervised_one():
    ids = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [10, 11, 12], [13, 14], [15, 16, 17]]
    masks = [
        [False, False, True, True],
        [True, True],  # supervised from its first token: no prompt, passed over
        [False, False, False],  # nothing supervised: passed over
        [False, True, False],
        [False, True],
        [False, False, True],
    ]
    prompts = prompts_from_dataset(dataset(ids, masks, ["code", "code", "prose", "prose", "code", "code"]), 2)
    # code: samples 0 and 4 (1 is unusable; 5 is the third usable); prose: sample 3 (2 is unusable)
    assert prompts.ids == [[1, 2], [10], [13]] and prompts.domains == ["code", "prose", "code"]
    assert all(type(token) is int for prompt in prompts.ids for token in prompt)
    unlabelled = prompts_from_dataset(dataset(ids, masks, None), 3)
    assert unlabelled.ids == [[1, 2], [10], [13]] and unlabelled.domains == ["", "", ""]
    assert prompts_from_dataset(dataset(ids, masks, None), 4).ids == [[1, 2], [10], [13], [15, 16]]
    with pytest.raises(UserError) as caught:
        prompts_from_dataset(dataset(ids[1:3], masks[1:3], None), 4)
    assert str(caught.value) == (
        "eval: none of the held-out samples has a prompt before its first assistant turn"
    )


def test_a_file_prompt_is_rendered_up_to_the_first_reply_and_limited_per_domain(tmp_path, tiny_tokenizer):
    records = [
        conversation("item 0", "code"),
        conversation("item 1", "code"),
        conversation("item 2", "code"),
        conversation("item 3"),
        conversation("item 4", "prose"),
    ]
    path = write_records(tmp_path / "eval.JSONL", records)  # the suffix in any case
    prompts = prompts_from_file(path, tiny_tokenizer, limit=2)
    assert prompts.domains == ["code", "code", "", "prose"]
    texts = [tiny_tokenizer.decode(ids) for ids in prompts.ids]
    assert texts == [f"<|im_start|>user\nitem {i}<|im_end|>\n<|im_start|>assistant\n" for i in (0, 1, 3, 4)]
    assert prompts_from_file(str(path), tiny_tokenizer, limit=1).domains == ["code", "", "prose"]


def test_chat_template_kwargs_reach_the_template_and_its_errors_name_the_record(tmp_path, tiny_tokenizer):
    path = write_records(tmp_path / "eval.jsonl", [conversation("hello")])
    template = "{{ greeting }}:{% for m in messages %}{{ m.content }}{% endfor %}"
    prompts = prompts_from_file(path, tiny_tokenizer, 5, {"chat_template": template, "greeting": "say"})
    assert tiny_tokenizer.decode(prompts.ids[0]) == "say:hello"
    with pytest.raises(UserError) as caught:
        prompts_from_file(path, tiny_tokenizer, 5, {"chat_template": "{{ raise_exception('no system') }}"})
    assert str(caught.value) == f"--data: {path}:1: the chat template rejected it (no system)"


def test_a_file_that_is_missing_of_another_kind_or_without_a_conversation_is_refused(
    tmp_path, tiny_tokenizer
):
    with pytest.raises(UserError) as caught:
        prompts_from_file(tmp_path / "missing.jsonl", tiny_tokenizer, 5)
    assert str(caught.value) == f"--data: {tmp_path / 'missing.jsonl'}: file not found"
    text = tmp_path / "eval.txt"
    text.write_text("hello\n")
    with pytest.raises(UserError) as caught:
        prompts_from_file(text, tiny_tokenizer, 5)
    assert str(caught.value) == f"--data: {text}: expected a .jsonl, .json, .parquet file of conversations"
    bad = write_records(tmp_path / "bad.jsonl", [{"messages": "nope"}, {"messages": [1]}])
    with pytest.raises(UserError) as caught:
        prompts_from_file(bad, tiny_tokenizer, 5)
    assert str(caught.value) == (
        f"--data: {bad}: no usable conversation among 2 records (first: {bad}:1: expected a `messages` or "
        "`conversations` list); expected OpenAI `messages` or ShareGPT `conversations` records with a user turn"
    )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(UserError) as caught:
        prompts_from_file(empty, tiny_tokenizer, 5)
    assert str(caught.value) == (
        f"--data: {empty}: no usable conversation among 0 records; expected OpenAI `messages` or ShareGPT "
        "`conversations` records with a user turn"
    )


def test_the_rendered_prompt_gets_no_second_bos_from_a_tokenizer_that_adds_one(tmp_path, tiny_tokenizer_dir):
    """A Llama-style tokenizer prepends its BOS when asked for special tokens; the chat template already
    wrote every special token the prompt has, so tokenizing adds none (as serving engines do)."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    bos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    tokenizer._tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)]
    )
    assert tokenizer("hello")["input_ids"][0] == bos  # the tokenizer does add it when asked
    path = write_records(tmp_path / "eval.jsonl", [conversation("hello")])
    (ids,) = prompts_from_file(path, tokenizer, 5).ids
    assert bos not in ids
    assert tokenizer.decode(ids) == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


def test_records_without_a_domain_share_no_limit_with_any_named_domain(tmp_path, tiny_tokenizer):
    # whatever a domain is called, the unlabelled records are counted apart from it: "XXXX" is the
    # name a slip in the sentinel for "unlabelled" would give them (mutmut's string mutation of "")
    records = [conversation("a", "XXXX"), conversation("b"), conversation("c", "XXXX"), conversation("d")]
    path = write_records(tmp_path / "eval.jsonl", records)
    assert prompts_from_file(path, tiny_tokenizer, 1).domains == ["XXXX", ""]
