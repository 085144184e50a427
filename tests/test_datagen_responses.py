"""Response bodies -> assistant turns (`app.datagen.responses`): what a server's body holds in each of
the forms servers return thinking in, each way a body is garbage with its message, and where
`datagen.reasoning` puts the thinking."""

from __future__ import annotations

import re
from typing import Any

import pytest

from app.datagen.responses import Completion, GarbageResponse, parse_completion, place_reasoning, split_think


def body(message: Any, finish_reason: Any = "stop", usage: Any = None, **choice: Any) -> dict[str, Any]:
    payload: dict[str, Any] = {"choices": [{"message": message, "finish_reason": finish_reason, **choice}]}
    if usage is not None:
        payload["usage"] = usage
    return payload


def garbage(payload: Any) -> str:
    with pytest.raises(GarbageResponse) as refused:
        parse_completion(payload)
    return str(refused.value)


def test_a_plain_answer() -> None:
    completion = parse_completion(
        body({"role": "assistant", "content": "the answer"}, usage={"completion_tokens": 7})
    )
    assert completion == Completion(
        content="the answer", reasoning=None, finish_reason="stop", completion_tokens=7
    )


def test_only_the_first_choice_is_read() -> None:
    payload = body({"content": "first"}, finish_reason="length")
    payload["choices"].append({"message": {"content": "second"}, "finish_reason": "stop"})
    assert parse_completion(payload) == Completion("first", None, "length", 0)


def test_reasoning_in_its_own_field_under_either_name() -> None:
    sglang = parse_completion(body({"content": "answer", "reasoning_content": "plan"}))
    vllm = parse_completion(body({"content": "answer", "reasoning": "plan"}))
    assert sglang == vllm == Completion("answer", "plan", "stop", 0)
    # an empty reasoning_content gives way to `reasoning`
    assert (
        parse_completion(body({"content": "a", "reasoning_content": "", "reasoning": "p"})).reasoning == "p"
    )


def test_a_separate_reasoning_leaves_think_tags_in_the_text_alone() -> None:
    completion = parse_completion(body({"content": "<think>x</think>y", "reasoning_content": "plan"}))
    assert (completion.reasoning, completion.content) == ("plan", "<think>x</think>y")


def test_only_reasoning_with_no_content_is_a_turn_with_empty_text() -> None:
    for content in (None, ""):
        completion = parse_completion(body({"content": content, "reasoning_content": "plan"}, "length"))
        assert completion == Completion("", "plan", "length", 0)


def test_thinking_in_the_text_is_split_out() -> None:
    completion = parse_completion(body({"content": "<think>plan</think>\nanswer"}))
    assert (completion.reasoning, completion.content) == ("plan", "answer")
    cut = parse_completion(body({"content": "<think>cut off"}, "length"))
    assert (cut.reasoning, cut.content, cut.finish_reason) == ("cut off", "", "length")


def test_an_empty_think_block_is_no_reasoning() -> None:
    completion = parse_completion(body({"content": "<think></think>answer"}))
    assert completion.reasoning is None and completion.content == "answer"


def test_odd_finish_reasons_and_usage_are_left_out() -> None:
    for finish, usage in [(None, {"completion_tokens": "7"}), (3, [7]), ("stop", {"prompt_tokens": 3})]:
        completion = parse_completion(body({"content": "a"}, finish, usage))
        assert completion.finish_reason == (finish if isinstance(finish, str) else None)
        assert completion.completion_tokens == 0


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ([1, 2], "response is a JSON list, not an object"),
        ("text", "response is a JSON str, not an object"),
        ({}, "response has no `choices` (keys: [])"),
        ({"choices": []}, "response has no `choices` (keys: ['choices'])"),
        ({"choices": {"0": {}}}, "response has no `choices` (keys: ['choices'])"),
        (
            {key: 1 for key in "abcdefghij"},
            "response has no `choices` (keys: ['a', 'b', 'c', 'd', 'e', 'f', 'g', 'h'])",
        ),
        ({"choices": ["text"]}, "response choices[0] has no `message` object"),
        ({"choices": [{"text": "legacy completion"}]}, "response choices[0] has no `message` object"),
        (body("text"), "response choices[0] has no `message` object"),
        (body({"content": ["a", "b"]}), "response message content is a list, not text"),
        (body({"content": "a", "reasoning_content": 5}), "response reasoning is a int, not text"),
        (body({"content": "a", "reasoning": ["x"]}), "response reasoning is a list, not text"),
        (body({"content": None}), "empty response (finish_reason='stop')"),
        (body({"content": " \n"}, "length"), "empty response (finish_reason='length')"),
        (body({"content": "<think> </think> "}), "empty response (finish_reason='stop')"),
        (body({"content": "", "reasoning_content": "  "}, None), "empty response (finish_reason=None)"),
    ],
)
def test_garbage_bodies_are_named(payload: Any, message: str) -> None:
    assert garbage(payload) == message


def test_split_think_forms() -> None:
    assert split_think("  \n<think>\n plan \n</think>\n\n answer ") == ("plan", "answer ")
    assert split_think("plan </think>\n answer") == ("plan", "answer")  # the template opened the block
    assert split_think("<think> cut off at max_tok ") == ("cut off at max_tok", "")
    assert split_think("no thinking here ") == (None, "no thinking here ")
    # the first close ends the block; what follows stays in the answer
    assert split_think("<think>a</think>b</think>c") == ("a", "b</think>c")
    assert split_think("a</think>b</think>c") == ("a", "b</think>c")
    # a close before an open in the text is not a template-opened block
    assert split_think("x</think>y<think>z") == (None, "x</think>y<think>z")
    assert split_think("answer <think>aside</think> more") == (None, "answer <think>aside</think> more")


@pytest.mark.parametrize(
    ("policy", "kept", "separate"), [("keep", "plan", None), ("separate", None, "plan"), ("drop", None, None)]
)
def test_place_reasoning_by_policy(policy: str, kept: str | None, separate: str | None) -> None:
    message, column = place_reasoning(Completion("answer", "plan", "stop", 3), policy)
    assert message == {"role": "assistant", "content": "answer", "reasoning_content": kept}
    assert column == separate


def test_only_reasoning_is_garbage_when_it_is_dropped_only() -> None:
    thinking_only = Completion(" \n", "plan", "length", 3)
    with pytest.raises(
        GarbageResponse,
        match=re.escape(
            "response holds only reasoning, which datagen.reasoning = drop discards (finish_reason='length')"
        ),
    ):
        place_reasoning(thinking_only, "drop")
    assert place_reasoning(thinking_only, "keep")[0]["reasoning_content"] == "plan"
    assert place_reasoning(thinking_only, "separate")[1] == "plan"
