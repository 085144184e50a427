"""The private parts of transformers the decoder depends on, behind one small surface.

The decoder switches a model's attention implementation for a call (the config's
`_attn_implementation`, which every attention layer reads at each forward) and keeps a static cache's
write position on its ring (each `StaticLayer`'s `cumulative_length`). Neither is public API, so a
transformers upgrade may move them; `tests/test_transformers_internals.py` fails then, naming which.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from transformers import AttentionInterface, PreTrainedModel, StaticCache
from transformers.cache_utils import StaticLayer


@contextlib.contextmanager
def attention_implementation(
    model: PreTrainedModel, name: str, function: Callable[..., object]
) -> Iterator[None]:
    """`model` runs `function` as its attention inside (registered as `name`), its own implementation
    after."""
    AttentionInterface.register(name, function)
    text = model.config.get_text_config()
    configs = [model.config] if text is model.config else [model.config, text]
    before = [config._attn_implementation for config in configs]
    for config in configs:
        config._attn_implementation = name
    try:
        yield
    finally:
        for config, implementation in zip(configs, before, strict=True):
            config._attn_implementation = implementation


def static_cache(model: PreTrainedModel, slots: int) -> StaticCache:
    """A static KV cache of `slots` positions per row for `model`."""
    return StaticCache(config=model.config, max_cache_len=slots)


def wrap_write_position(cache: StaticCache, ring: int) -> None:
    """Each layer's next write position (its count of tokens written) taken modulo `ring`, so that
    the cache writes step t at slot `t % ring`."""
    for layer in cache.layers:
        layer.cumulative_length.remainder_(ring)


def plain_attention_cache(model: PreTrainedModel) -> bool:
    """Whether every layer of the model's static cache is a plain full-attention layer (no linear
    attention, no sliding window), so that one mask over all its slots is right for every layer."""
    try:
        cache = static_cache(model, 1)
    except (ValueError, KeyError, NotImplementedError):
        # a layer type transformers has no static cache for (its mapping has no key for it): not plain
        return False
    return all(type(layer) is StaticLayer for layer in cache.layers)
