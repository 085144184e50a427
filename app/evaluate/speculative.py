"""Speculative decoding with a DFlash drafter and its acceptance length tau (docs/architecture.md, Data flow).

The target prefills the prompt and emits its next token. Then every round:

1. the drafter appends the context features of the tokens accepted since the last round (the
   target's K tapped hidden states, from the target forward that verified them) to its context
   cache, and drafts B-1 tokens for the block `[last token, MASK...]` in one forward (argmaxes);
2. the target verifies the whole block `[last token, drafts]` in one forward;
3. the longest prefix of drafts equal to the target's own argmaxes is accepted, plus the target's
   token after it (at the first mismatch, or the bonus token after the last slot).

Greedy verification is lossless: every emitted token is the target's argmax given everything
before it, so the output is the target's greedy decode, however bad the drafter is.

A round's acceptance length is the number of tokens it emitted (accepted drafts + 1), after the
output is cut at `max_new_tokens` or at an end-of-sequence token, as a serving engine counts it;
tau is its mean over all rounds (1 <= tau <= block_size). The token emitted by the prefill is
not a round.

Target state between rounds: pure attention targets keep one HF `DynamicCache` and crop it back
to the accepted tokens after each verification (`kv-cache`). Caches that cannot be rolled back
(linear-attention layers of hybrid models such as Qwen3.5/3.6, sliding windows) are not trusted:
the target re-runs over the whole accepted sequence plus the block every round (`recompute`),
slower but exact. `EvalResult.target_cache` says which one ran.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from app.errors import UserError
from app.evaluate.result import EvalResult, GenerationResult, TargetCacheMode
from app.model.drafter import DFlashDrafter
from app.model.target import TargetModel


def evaluate_tau(
    target: TargetModel,
    drafter: DFlashDrafter,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> EvalResult:
    """Speculative-decode every prompt and pool the acceptance lengths of all rounds into tau."""
    if not prompts:
        raise UserError("eval: no prompts to evaluate")
    results = [
        speculative_generate(target, drafter, prompt, max_new_tokens, eos_token_id, autocast_dtype)
        for prompt in prompts
    ]
    return EvalResult.pooled(results, drafter.arch.block_size)


@torch.inference_mode()
def speculative_generate(
    target: TargetModel,
    drafter: DFlashDrafter,
    prompt: Sequence[int],
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> GenerationResult:
    """Greedy speculative decode of one prompt: the target's greedy output and each round's acceptance.

    `autocast_dtype` runs the drafter under autocast (bf16 on GPU, as it was trained); the target
    always runs in its own dtype.
    """
    _check_compatible(target, drafter)
    if max_new_tokens < 1:
        raise UserError(f"eval: max_new_tokens must be >= 1, got {max_new_tokens}")
    prompt_ids = _prompt_tensor(prompt, target)
    stop_ids = _stop_ids(eos_token_id)
    block_size = drafter.arch.block_size
    drafter_precision = functools.partial(drafter_autocast, drafter, autocast_dtype)
    session = _open_session(target)

    logits, features = session.forward(prompt_ids, logits_for=1)
    session.commit(len(prompt_ids))
    last_token = logits[-1].argmax()
    context = drafter.new_cache()
    with drafter_precision():
        drafter.extend_context(features, torch.arange(len(prompt_ids), device=prompt_ids.device), context)
    tokens = [int(last_token)]
    acceptance_lengths: list[int] = []

    while len(tokens) < max_new_tokens and tokens[-1] not in stop_ids:
        position = len(prompt_ids) + len(tokens) - 1  # of the last token: the block's anchor
        with drafter_precision():
            draft = drafter.draft(context, last_token, position, target.embed_tokens, target.lm_head)
        block = torch.cat([last_token.view(1), draft])
        logits, features = session.forward(block, logits_for=block_size)
        verified = logits.argmax(dim=-1)  # the target's token after each block position
        accepted = (draft == verified[:-1]).int().cumprod(dim=0).sum()
        # One host sync per round: the accepted count and the target's tokens travel together.
        accepted_count, *target_tokens = torch.cat([accepted.view(1), verified]).tolist()
        emitted = cut_round(target_tokens[: accepted_count + 1], max_new_tokens - len(tokens), stop_ids)
        tokens += emitted
        acceptance_lengths.append(len(emitted))
        # The target and the drafter now hold the block's first len(emitted) tokens (the old last
        # token and the accepted drafts); the newest token is the next round's anchor.
        session.commit(len(emitted))
        with drafter_precision():
            drafter.extend_context(
                features[: len(emitted)],
                torch.arange(position, position + len(emitted), device=block.device),
                context,
            )
        last_token = verified[len(emitted) - 1]
    return GenerationResult(tokens=tokens, acceptance_lengths=acceptance_lengths, target_cache=session.mode)


def cut_round(emitted: list[int], room: int, stop_ids: frozenset[int]) -> list[int]:
    """The round's tokens, cut to the remaining budget and just after the first end-of-sequence token."""
    emitted = emitted[:room]
    for index, token in enumerate(emitted):
        if token in stop_ids:
            return emitted[: index + 1]
    return emitted


# ---- the target between rounds ----------------------------------------------------------------------


class CachedTarget:
    """Pure attention target: one KV cache, cropped back to the accepted tokens after each verify."""

    mode: TargetCacheMode = "kv-cache"

    def __init__(self, target: TargetModel, cache: DynamicCache):
        self.target = target
        self.cache = cache
        self.pending = 0
        # transformers 5.2x renamed `past_key_values` to `cache` (the old name warns); 5.1x only has the old one.
        self.cache_argument = (
            "cache" if "cache" in inspect.signature(target.model.forward).parameters else "past_key_values"
        )

    def forward(
        self,
        tokens: torch.Tensor,
        logits_for: int,
        bias: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits of the last `logits_for` tokens `[logits_for, V]` and features of all `tokens` `[n, K*H]`;
        `bias [n, cached + n]` and `positions [n]` replace the causal mask and the next positions (a
        tree's verification, `app.evaluate.tree.tree_verification_inputs`)."""
        output = self.target.model(
            input_ids=tokens[None],
            attention_mask=None if bias is None else bias[None, None],
            position_ids=None if positions is None else positions[None],
            use_cache=True,
            output_hidden_states=True,
            logits_to_keep=logits_for,
            **{self.cache_argument: self.cache},
        )
        self.pending = len(tokens)
        return output.logits[0], tapped_features(self.target, output.hidden_states)

    def commit(self, kept: int) -> None:
        """Keep the first `kept` tokens of the last forward in the cache, drop the rest."""
        dropped = self.pending - kept
        if dropped:
            self.cache.crop(-dropped)
        self.pending = 0


class _RecomputedTarget:
    """Target whose cache cannot be rolled back: every forward re-runs the whole accepted sequence."""

    mode: TargetCacheMode = "recompute"

    def __init__(self, target: TargetModel):
        self.target = target
        self.accepted = torch.empty(0, dtype=torch.long, device=target.device)
        self.pending = self.accepted

    def forward(self, tokens: torch.Tensor, logits_for: int) -> tuple[torch.Tensor, torch.Tensor]:
        output = self.target.model(
            input_ids=torch.cat([self.accepted, tokens])[None],
            use_cache=False,
            output_hidden_states=True,
            logits_to_keep=logits_for,
        )
        self.pending = tokens
        return output.logits[0], tapped_features(self.target, output.hidden_states)[-len(tokens) :]

    def commit(self, kept: int) -> None:
        self.accepted = torch.cat([self.accepted, self.pending[:kept]])


def _open_session(target: TargetModel) -> CachedTarget | _RecomputedTarget:
    """A KV-cached session when every layer's cache is a plain, croppable attention cache."""
    layer_types = getattr(target.text_config, "layer_types", None) or []
    if any(layer_type != "full_attention" for layer_type in layer_types):
        return _RecomputedTarget(target)
    cache = DynamicCache(config=target.model.config)
    if all(type(layer) is DynamicLayer for layer in cache.layers):
        return CachedTarget(target, cache)
    return _RecomputedTarget(target)


def tapped_features(target: TargetModel, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """`[n, K*H]`: the configured layers' outputs (HF `hidden_states[i + 1]`), as `TargetModel.features`."""
    return torch.cat([hidden_states[layer + 1][0] for layer in target.layer_ids], dim=-1)


# ---- checks -----------------------------------------------------------------------------------------


def _check_compatible(target: TargetModel, drafter: DFlashDrafter) -> None:
    arch = drafter.arch
    if list(arch.target_layer_ids) != target.layer_ids:
        raise UserError(
            f"eval: the drafter reads target layers {list(arch.target_layer_ids)} but the target taps {target.layer_ids}"
        )
    if arch.target_hidden_size != target.hidden_size or arch.num_target_layers != target.num_layers:
        raise UserError(
            f"eval: the drafter was built for a {arch.num_target_layers}-layer target of hidden size "
            f"{arch.target_hidden_size}, the target has {target.num_layers} layers of hidden size {target.hidden_size}"
        )
    if arch.vocab_size > target.embed_tokens.num_embeddings:
        raise UserError(
            f"eval: the drafter predicts over {arch.vocab_size} tokens, the target embedding has "
            f"{target.embed_tokens.num_embeddings} rows"
        )
    if drafter.fc.weight.device != target.device:
        raise ValueError(
            f"eval: drafter on {drafter.fc.weight.device}, target on {target.device}: put them together"
        )


def _prompt_tensor(prompt: Sequence[int], target: TargetModel) -> torch.Tensor:
    if len(prompt) == 0:
        raise UserError("eval: a prompt has no tokens")
    vocab = target.embed_tokens.num_embeddings
    bad = [token for token in prompt if not 0 <= token < vocab]
    if bad:
        raise UserError(f"eval: prompt token ids {bad[:5]} are outside the target vocabulary [0, {vocab})")
    return torch.tensor(list(prompt), dtype=torch.long, device=target.device)


def _stop_ids(eos_token_id: int | Sequence[int] | None) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset([eos_token_id])
    return frozenset(int(token) for token in eos_token_id)


def drafter_autocast(
    drafter: DFlashDrafter, dtype: torch.dtype | None
) -> contextlib.AbstractContextManager[object]:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(drafter.fc.weight.device.type, dtype=dtype)
