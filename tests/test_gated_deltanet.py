"""The hybrid target's Gated DeltaNet layers on the copy-free layout (`app.model.gated_deltanet`)."""

import inspect
import sys

import pytest
import torch

from app.config import validate_config
from app.model.target import load_target
from tests.test_target import LINEAR_ATTENTION, TEXT

# value heads grouped over key heads (48 over 16 in Qwen3.6-27B), key and value head dims apart
GROUPED = {
    "model_type": "qwen3_5_text",
    **TEXT,
    **LINEAR_ATTENTION,  # layers 0, 2 linear attention; 1, 3 full attention
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
}


@pytest.fixture
def target():
    config = validate_config(
        {"target": {"architecture": GROUPED}, "drafter": {"mask_token_id": 3, "target_layer_ids": [0, 2, 3]}}
    )
    return load_target(config, "cpu")


def linear_attention_layers(target):
    return [layer.linear_attn for layer in target.layers_run if hasattr(layer, "linear_attn")]


def test_features_equal_transformers_and_q_k_v_reach_the_delta_rule_contiguous(target, monkeypatch):
    """Each of q, k and v is projected and convolved on its own (the conv called per part, with the
    part's channels) and reaches the delta rule contiguous, so flash-linear-attention copies
    nothing; the features equal transformers' own forward."""
    layers = linear_attention_layers(target)
    modeling = sys.modules[type(layers[0]).__module__]
    convs, rules = [], []
    conv, rule = modeling.causal_conv1d_fn, modeling.torch_chunk_gated_delta_rule

    def recording_conv(x, weight, *args, **kwargs):
        convs.append(x.shape[1])
        return conv(x, weight, *args, **kwargs)

    def recording_rule(query, key, value, **kwargs):
        rules.append([(tuple(t.shape), t.is_contiguous()) for t in (query, key, value)])
        return rule(query, key, value, **kwargs)

    monkeypatch.setattr(modeling, "causal_conv1d_fn", recording_conv)
    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", recording_rule)
    input_ids = torch.randint(0, 128, (3, 40), generator=torch.Generator().manual_seed(0))
    copy_free = target.features(input_ids)
    assert convs == [2 * 8, 2 * 8, 4 * 16] * len(layers)
    shapes = [((3, 40, 2, 8), True), ((3, 40, 2, 8), True), ((3, 40, 4, 16), True)]
    assert rules == [shapes] * len(layers)
    for layer in layers:
        del layer.forward  # transformers' own forward again
    convs.clear()
    expected = target.features(input_ids)
    assert convs == [2 * 8 + 2 * 8 + 4 * 16] * len(layers)  # the fused layout: one conv per layer
    torch.testing.assert_close(copy_free, expected, rtol=1e-5, atol=1e-5)


def test_cached_decoding_keeps_transformers_forward(target):
    """Eval decodes the target with a cache: those calls carry conv and recurrent state, which only
    transformers' forward updates. A prefix then one cached token gives the logits of the whole row."""
    model = target.model
    row = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(1))
    whole = model(row).logits[:, -1]
    prefix = model(row[:, :-1], use_cache=True)
    cache = (
        "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    )  # 5.2x / 5.1x
    step = model(row[:, -1:], **{cache: prefix.past_key_values}, use_cache=True).logits[:, -1]
    torch.testing.assert_close(step, whole, rtol=1e-4, atol=1e-4)


def test_a_padding_mask_keeps_transformers_forward(target):
    """A masked call (padding states zeroed before the conv) is transformers' own forward (no cache:
    the mask alone routes it)."""
    model = target.model
    input_ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(input_ids)
    mask[1, 10:] = 0
    masked = model(input_ids, attention_mask=mask, use_cache=False).logits
    for layer in linear_attention_layers(target):
        del layer.forward
    torch.testing.assert_close(masked, model(input_ids, attention_mask=mask, use_cache=False).logits)
