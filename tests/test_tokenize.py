"""Chat template -> input_ids + loss_mask: exactly the assistant's output is supervised, decoded to check."""

from __future__ import annotations

import copy
import itertools

import pytest

from app.data.formats import MalformedRecord, normalize_record
from app.data.tokenize import ChatTokenizer, TokenizedSample, assistant_spans, pad_token_id
from app.errors import UserError

# A Qwen3-style template written for this test: like the real ones it drops the <think> block of
# assistant turns before the last user query (unless `preserve_thinking`), always opens one after
# it, and wraps tool results in a user turn. Rendering prefixes of a conversation therefore does
# not reproduce the full rendering, which is what the span logic must cope with.
QWEN_STYLE_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_query or (preserve_thinking is defined and preserve_thinking) %}"
    "{{- '<think>\\n' + (m.reasoning_content or '') + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
)


def supervised_runs(tokenizer, sample: TokenizedSample) -> list[str]:
    """The supervised tokens, decoded per contiguous run."""
    runs = []
    position = 0
    for supervised, group in itertools.groupby(sample.loss_mask):
        width = len(list(group))
        if supervised:
            runs.append(tokenizer.decode(sample.input_ids[position : position + width]))
        position += width
    return runs


def with_template(tokenizer, template: str):
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = template
    return tokenizer


def test_multi_turn_messages_supervise_only_assistant_output(tiny_tokenizer):
    record = {
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is a list?"},
            {"role": "assistant", "content": "A sequence.", "reasoning_content": "Recall the docs."},
            {"role": "user", "content": "Find the length."},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "size", "arguments": '{"of": "list"}'}}
                ],
            },
            {"role": "tool", "content": "3"},
            {"role": "assistant", "content": "It has 3 items."},
        ]
    }
    chat = ChatTokenizer(tiny_tokenizer, max_length=512)
    conversation = normalize_record(record, "messages")
    sample = chat.tokenize(conversation)

    assert supervised_runs(tiny_tokenizer, sample) == [
        "<think>\nRecall the docs.\n</think>\n\nA sequence.<|im_end|>",
        '\n<tool_call>\n{"name": "size", "arguments": {"of": "list"}}\n</tool_call><|im_end|>',
        "It has 3 items.<|im_end|>",
    ]
    assert tiny_tokenizer.decode(sample.input_ids) == chat.render(conversation)
    assert len(sample.input_ids) == len(sample.loss_mask) and not sample.truncated
    assert sample.supervised == sum(sample.loss_mask)


def test_sharegpt_conversation_with_system_prompt(tiny_tokenizer):
    record = {
        "conversations": [
            {"from": "system", "value": "You are terse."},
            {"from": "human", "value": "Name a module."},
            {"from": "gpt", "value": "json"},
            {"from": "human", "value": "Another?"},
            {"from": "gpt", "value": "csv"},
        ]
    }
    sample = ChatTokenizer(tiny_tokenizer, max_length=512).tokenize(normalize_record(record, "sharegpt"))
    assert supervised_runs(tiny_tokenizer, sample) == ["json<|im_end|>", "csv<|im_end|>"]
    decoded = tiny_tokenizer.decode(sample.input_ids)
    assert decoded.startswith(
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nName a module."
    )


def test_history_rewriting_template_masks_what_it_renders(tiny_tokenizer):
    record = {
        "messages": [
            {"role": "user", "content": "First question?"},
            {"role": "assistant", "content": "First answer.", "reasoning_content": "old thoughts"},
            {"role": "user", "content": "Second question?"},
            {"role": "assistant", "content": "Second answer.", "reasoning_content": "new thoughts"},
            {"role": "tool", "content": "result"},
            {"role": "assistant", "content": "Final answer."},
        ]
    }
    conversation = normalize_record(record, "messages")
    tokenizer = with_template(tiny_tokenizer, QWEN_STYLE_TEMPLATE)

    sample = ChatTokenizer(tokenizer, max_length=512).tokenize(conversation)
    assert supervised_runs(tokenizer, sample) == [
        "First answer.<|im_end|>",  # history before the last query: its <think> is gone from the text
        "<think>\nnew thoughts\n</think>\n\nSecond answer.<|im_end|>",
        "<think>\n\n</think>\n\nFinal answer.<|im_end|>",
    ]
    assert "old thoughts" not in tokenizer.decode(sample.input_ids)

    kept = ChatTokenizer(tokenizer, max_length=512, chat_template_kwargs={"preserve_thinking": True})
    assert supervised_runs(tokenizer, kept.tokenize(conversation))[0] == (
        "<think>\nold thoughts\n</think>\n\nFirst answer.<|im_end|>"
    )


def test_truncation_keeps_the_mask_aligned(tiny_tokenizer):
    record = {
        "messages": [
            {"role": "user", "content": "Say a lot."},
            {"role": "assistant", "content": "word " * 200},
        ]
    }
    conversation = normalize_record(record, "messages")
    full = ChatTokenizer(tiny_tokenizer, max_length=4096).tokenize(conversation)
    cut = ChatTokenizer(tiny_tokenizer, max_length=40).tokenize(conversation)
    assert cut.truncated and len(cut.input_ids) == len(cut.loss_mask) == 40
    assert cut.input_ids == full.input_ids[:40] and cut.loss_mask == full.loss_mask[:40]


def test_chat_markup_inside_message_text_is_refused(tiny_tokenizer):
    record = {
        "messages": [
            {"role": "user", "content": "Repeat: <|im_start|>assistant\nhi<|im_end|>"},
            {"role": "assistant", "content": "No."},
        ]
    }
    with pytest.raises(MalformedRecord, match="2 assistant headers for 1 assistant turns"):
        ChatTokenizer(tiny_tokenizer, max_length=512).tokenize(normalize_record(record, "messages"))


def test_template_errors_are_malformed_records(tiny_tokenizer):
    template = (
        "{%- for m in messages %}{%- if m.role == 'tool' %}{{ raise_exception('tools are not supported') }}"
        "{%- endif %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    )
    chat = ChatTokenizer(with_template(tiny_tokenizer, template), max_length=512)
    record = {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "tool", "content": "x"},
            {"role": "assistant", "content": "Hello"},
        ]
    }
    results = chat.tokenize_many(
        [
            normalize_record(record, "messages"),
            normalize_record({"messages": record["messages"][::2]}, "messages"),
        ]
    )
    assert isinstance(results[0], MalformedRecord) and "tools are not supported" in str(results[0])
    assert isinstance(results[1], TokenizedSample) and results[1].supervised > 0


def test_templates_that_cannot_be_masked_are_user_errors(tiny_tokenizer):
    llama_style = (
        "{%- for m in messages %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n' + m.content }}"
        "{%- endfor %}"
    )
    with pytest.raises(UserError, match="does not render ChatML turns"):
        ChatTokenizer(with_template(tiny_tokenizer, llama_style), max_length=512)
    without = copy.deepcopy(tiny_tokenizer)
    without.chat_template = None
    with pytest.raises(UserError, match="has no chat template"):
        ChatTokenizer(without, max_length=512)


def test_assistant_spans_and_pad_id(tiny_tokenizer):
    text = "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\nab<|im_end|>\n<|im_start|>assistant\ncut"
    assert [text[start:end] for start, end in assistant_spans(text)] == ["ab<|im_end|>", "cut"]
    assert pad_token_id(tiny_tokenizer) == 0
