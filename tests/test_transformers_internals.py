"""The private transformers state the decoder relies on (`app.generate.transformers_internals`): each
test fails, naming what moved, on a transformers version that renames or stops reading it."""

from __future__ import annotations

import pytest
import torch

from app.generate.transformers_internals import (
    attention_implementation,
    plain_attention_cache,
    static_cache,
    wrap_write_position,
)
from tests.test_speculative import HYBRID_LINEAR, random_target_config, target_and_drafter


@pytest.fixture(scope="module")
def target():
    return target_and_drafter(random_target_config())[0]


def test_every_attention_layer_runs_the_implementation_switched_in_and_its_own_after(target):
    """`_attn_implementation` on the config is what each attention layer reads at every forward."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    calls = []

    def counted(module, query, *args, **kwargs):
        calls.append(query.shape[2])
        return sdpa_attention_forward(module, query, *args, **kwargs)

    ids = torch.tensor([[5, 6, 7]])
    with torch.inference_mode():
        with attention_implementation(target.model, "counted_attention", counted):
            target.model(input_ids=ids)
        assert calls == [3] * target.text_config.num_hidden_layers, "config._attn_implementation is not read"
        target.model(input_ids=ids)
    assert len(calls) == target.text_config.num_hidden_layers
    assert target.model.config._attn_implementation == "sdpa"


def test_wrapping_the_write_position_moves_the_static_cache_s_next_write(target):
    """A static cache's layers write at their `cumulative_length`: taken modulo a ring of 2 after three
    tokens, the next token goes to slot 1, the slots 0 and 2 keep theirs and slot 3 stays empty."""
    cache = static_cache(target.model, 4)
    slots = torch.arange(4)
    with torch.inference_mode():
        target.model(input_ids=torch.tensor([[5, 6, 7]]), cache=cache, use_cache=True)
        before = [layer.keys.clone() for layer in cache.layers]
        wrap_write_position(cache, 2)
        target.model(
            input_ids=torch.tensor([[8]]),
            position_ids=torch.tensor([[3]]),
            attention_mask=(slots < 3)[None, None, None, :],
            cache=cache,
            use_cache=True,
        )
    for layer, old in zip(cache.layers, before, strict=True):
        assert not torch.equal(layer.keys[:, :, 1], old[:, :, 1]), "cumulative_length is not the write slot"
        assert torch.equal(layer.keys[:, :, [0, 2]], old[:, :, [0, 2]])
        assert not layer.keys[:, :, 3].any()


def test_only_a_plain_attention_target_counts_as_a_plain_static_cache(target):
    hybrid = target_and_drafter(random_target_config("qwen3_5_text", **HYBRID_LINEAR))[0]
    assert plain_attention_cache(target.model) and not plain_attention_cache(hybrid.model)


def test_sliding_window_layers_and_a_layer_type_with_no_static_cache_layer_are_not_plain(target):
    """A sliding-window layer has a static cache layer of its own (one mask over every slot would be
    wrong for it); a layer type transformers allows but has no static cache layer for
    (`window_attention`) fails the probe cache's making: neither target is a plain attention one."""
    import copy

    from transformers import AutoModelForCausalLM

    def with_layers(layer_type, **settings):
        config = copy.deepcopy(target.model.config)
        config.layer_types = [layer_type] * config.num_hidden_layers
        for name, value in settings.items():
            setattr(config, name, value)
        return AutoModelForCausalLM.from_config(config)

    sliding = with_layers("sliding_attention", sliding_window=4)
    assert type(static_cache(sliding, 8).layers[0]) is not type(static_cache(target.model, 8).layers[0])
    assert not plain_attention_cache(sliding)
    windowed = with_layers("window_attention")
    with pytest.raises(KeyError):
        static_cache(windowed, 4)
    assert not plain_attention_cache(windowed)
