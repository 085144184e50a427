"""The DFlash block-diffusion drafter: training forward and speculative-decoding path.

The drafter reads the target's K tapped hidden states through `fc` (K*H -> H) and `hidden_norm`, then
runs N Qwen3-style decoder layers over blocks `[anchor token, MASK x (B-1)]`. In every layer the
queries are the block's tokens and the keys/values are `[context ; block]`: the context feature
projected by that layer's own k/v projections, then the block's own k/v. It has no embedding and
no LM head: the target's frozen ones are passed in, so they never enter `parameters()`, the
optimizer or the exported weights. Parameter names follow the reference layout the serving engines load.
See docs/architecture.md, DFlash model and objective.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from app.config import default_gamma
from app.config.schema import RunConfig
from app.data.batch import DrafterRow
from app.errors import UserError
from app.model.attention import Attend, Backend, FlexKernel, training_attention
from app.model.objective import CeChunk
from app.model.target import TargetModel, resolve_layer_ids, target_text_config

INIT_STD = 0.02
"""Std of the normal init of every projection (the HF Qwen3 `initializer_range`)."""


@dataclass(frozen=True)
class DrafterArch:
    """The drafter's resolved shape: config values, with the target's where the config says nothing."""

    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    target_hidden_size: int
    vocab_size: int
    """The target's vocabulary (embedding rows); the drafter predicts over it with the target's LM head."""
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.hidden_size != self.target_hidden_size:
            raise UserError(
                f"drafter: hidden size {self.hidden_size} must equal the target's ({self.target_hidden_size}): "
                "the drafter uses the target's embedding and LM head"
            )
        if not self.target_layer_ids:
            raise UserError("drafter.target_layer_ids: needs at least one target layer")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise UserError(
                f"drafter.target_layer_ids: must be in [0, {self.num_target_layers}) for a "
                f"{self.num_target_layers}-layer target, got {bad}"
            )
        if self.block_size < 2:
            raise UserError(
                f"drafter.block_size: must be >= 2 (the anchor plus at least one draft), got {self.block_size}"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise UserError(
                f"drafter.mask_token_id: must be a row of the target embedding (< {self.vocab_size}), "
                f"got {self.mask_token_id}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserError(
                f"drafter.num_key_value_heads: must divide num_attention_heads ({self.num_attention_heads}), "
                f"got {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise UserError(f"drafter.head_dim: must be even (rotary embedding), got {self.head_dim}")
        if self.sliding_window_layers and self.sliding_window is None:
            raise UserError("drafter.sliding_window_layers: needs drafter.sliding_window to be set")
        bad = [i for i in self.sliding_window_layers if not 0 <= i < self.num_layers]
        if bad:
            raise UserError(f"drafter.sliding_window_layers: must be in [0, {self.num_layers}), got {bad}")

    @property
    def num_features(self) -> int:
        """K: how many target layers feed the drafter."""
        return len(self.target_layer_ids)

    @property
    def feature_size(self) -> int:
        """Width of the concatenated context features, `fc`'s input: K * target hidden size."""
        return self.num_features * self.target_hidden_size

    def layer_window(self, layer: int) -> int | None:
        """The context window of drafter layer `layer`, or None when it sees the full context."""
        return self.sliding_window if layer in self.sliding_window_layers else None

    @classmethod
    def from_config(
        cls, config: RunConfig, target: TargetModel | PretrainedConfig | None = None
    ) -> DrafterArch:
        """Resolve the drafter's shape from the run config; unset sizes come from the target's config.

        `target` may be the loaded target, its (text) HF config, or None to read the config from
        `config.target` without loading any weights (what the benchmark does).
        """
        if isinstance(target, TargetModel):
            text = target.text_config
        elif isinstance(target, PretrainedConfig):
            text = target.get_text_config()
        else:
            text = target_text_config(config.target)
        drafter = config.drafter
        if config.train.anchors < 1:
            raise UserError(f"train.anchors: must be >= 1, got {config.train.anchors}")
        heads = drafter.num_attention_heads or text.num_attention_heads
        return cls(
            hidden_size=text.hidden_size,
            num_layers=drafter.num_layers,
            num_attention_heads=heads,
            num_key_value_heads=drafter.num_key_value_heads
            or getattr(text, "num_key_value_heads", None)
            or heads,
            head_dim=drafter.head_dim or getattr(text, "head_dim", None) or text.hidden_size // heads,
            intermediate_size=drafter.intermediate_size or text.intermediate_size,
            rms_norm_eps=drafter.rms_norm_eps or text.rms_norm_eps,
            rope_theta=drafter.rope_theta or _rope_theta(text),
            block_size=drafter.block_size,
            mask_token_id=drafter.mask_token_id,
            target_layer_ids=tuple(resolve_layer_ids(drafter, text.num_hidden_layers)),
            num_target_layers=text.num_hidden_layers,
            target_hidden_size=text.hidden_size,
            vocab_size=text.vocab_size,
            sliding_window=drafter.sliding_window,
            sliding_window_layers=tuple(drafter.sliding_window_layers),
        )


def with_derived_defaults(config: RunConfig, arch: DrafterArch) -> RunConfig:
    """`config` with every default that depends on the target or the block size written out: the
    drafter's head layout, FFN, norm eps, RoPE base and target layers as `arch` resolved them, and
    `train.gamma`. A run records this (config.json) and `dflash config show` prints it."""
    drafter = config.drafter.model_copy(
        update={
            "target_layer_ids": list(arch.target_layer_ids),
            "num_attention_heads": arch.num_attention_heads,
            "num_key_value_heads": arch.num_key_value_heads,
            "head_dim": arch.head_dim,
            "intermediate_size": arch.intermediate_size,
            "rope_theta": arch.rope_theta,
            "rms_norm_eps": arch.rms_norm_eps,
        }
    )
    gamma = config.train.gamma or default_gamma(arch.block_size)
    return config.model_copy(
        update={"drafter": drafter, "train": config.train.model_copy(update={"gamma": gamma})}
    )


def _rope_theta(text: PretrainedConfig) -> float:
    """transformers 5 keeps the base under `rope_parameters` (per layer type for some models)."""
    parameters = getattr(text, "rope_parameters", None) or {}
    if "rope_theta" in parameters:
        return float(parameters["rope_theta"])
    for per_type in ("full_attention", *parameters):
        nested = parameters.get(per_type)
        if isinstance(nested, dict) and "rope_theta" in nested:
            return float(nested["rope_theta"])
    return float(getattr(text, "rope_theta", None) or 10000.0)


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm, computed in fp32 and returned in the input's dtype."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[S, head_dim]` (fp32) for RoPE at `positions [S]`, in the rotate-half layout of Qwen3."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    angles = positions.float()[:, None] * theta ** -exponents[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """RoPE on `x [S, heads, d]` with tables `[S, d]`."""
    cos, sin = (table.to(x.dtype)[:, None, :] for table in rope)
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class DrafterAttention(nn.Module):
    """Block queries over `[context ; block]` keys/values, with per-head q/k RMSNorm and RoPE."""

    def __init__(self, arch: DrafterArch):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            arch.num_attention_heads,
            arch.num_key_value_heads,
            arch.head_dim,
        )
        self.q_proj = nn.Linear(arch.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(arch.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(arch.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, arch.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)

    def key_value(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (k_norm + RoPE) and values of tokens `x [S, H]`: each `[kv_heads, S, d]`."""
        length = x.shape[0]
        key = self.k_norm(self.k_proj(x).view(length, self.num_kv_heads, self.head_dim))
        value = self.v_proj(x).view(length, self.num_kv_heads, self.head_dim)
        return apply_rotary(key, rope).transpose(0, 1), value.transpose(0, 1)

    def forward(
        self,
        x: torch.Tensor,
        context_key: torch.Tensor,
        context_value: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        attend: Attend,
    ) -> torch.Tensor:
        """`x [Q, H]` block tokens (normed) attend to the given context K/V and their own K/V."""
        length = x.shape[0]
        query = apply_rotary(self.q_norm(self.q_proj(x).view(length, self.num_heads, self.head_dim)), rope)
        block_key, block_value = self.key_value(x, rope)
        key = torch.cat([context_key, block_key], dim=1)
        value = torch.cat([context_value, block_value], dim=1)
        out = attend(query.transpose(0, 1)[None], key[None], value[None])
        return self.o_proj(out[0].transpose(0, 1).reshape(length, self.num_heads * self.head_dim))


class DrafterMLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, arch: DrafterArch):
        super().__init__()
        self.gate_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.up_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    """Pre-norm decoder layer whose attention also reads the context K/V."""

    def __init__(self, arch: DrafterArch):
        super().__init__()
        self.self_attn = DrafterAttention(arch)
        self.mlp = DrafterMLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        context: torch.Tensor,
        context_rope: tuple[torch.Tensor, torch.Tensor],
        rope: tuple[torch.Tensor, torch.Tensor],
        attend: Attend,
    ) -> torch.Tensor:
        """Training: the block tokens `hidden [Q, H]` over the row's `context [T, H]` (the normed
        features), whose K/V this layer projects here, inside its compiled graph: eager, their norm
        and RoPE were a few dozen passes over the context's K/V per layer, forward and backward."""
        context_key, context_value = self.self_attn.key_value(context, context_rope)
        return self.over_context_kv(hidden, context_key, context_value, rope, attend)

    def over_context_kv(
        self,
        hidden: torch.Tensor,
        context_key: torch.Tensor,
        context_value: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        attend: Attend,
    ) -> torch.Tensor:
        """The layer over context K/V already projected (a draft round's cache), eager."""
        hidden = hidden + self.self_attn(
            self.input_layernorm(hidden), context_key, context_value, rope, attend
        )
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


@dataclass
class ContextCache:
    """Per drafter layer, the projected context K/V of every context token so far (one sequence).

    Keys are stored after k_norm and RoPE, so a draft round only projects its own block.
    """

    keys: list[torch.Tensor]
    """Per layer `[kv_heads, n, head_dim]`."""
    values: list[torch.Tensor]
    """Per layer `[kv_heads, n, head_dim]`."""
    positions: torch.Tensor
    """`[n]` position of each cached context token (sliding-window layers select by it)."""

    @property
    def length(self) -> int:
        return self.positions.shape[0]


@dataclass
class CompiledKernels:
    """Compiled kernels the drafter's training forward and loss run with; None: eager (CPU only, where
    the compiled flex backward fails; on CUDA a missing one is an error, never a quiet slow path)."""

    flex_attention: FlexKernel | None = None
    ce_chunk: CeChunk | None = None
    """The loss's cross-entropy chunk on CUDA, `app.model.ce_kernel.triton_ce_chunk` (read by the
    training step, which calls the loss)."""


class DFlashDrafter(nn.Module):
    """fc + hidden_norm, N decoder layers, final norm; embedding and LM head borrowed from the target."""

    def __init__(self, arch: DrafterArch, seed: int = 0, device: torch.device | str | None = None):
        """device: where the parameters are created and drawn. Building on the GPU directly matters:
        initialising a production drafter's 1.7B parameters on the CPU and copying them over costs
        seconds of every start."""
        super().__init__()
        self.arch = arch
        with torch.device(device) if device is not None else nullcontext():
            self.fc = nn.Linear(arch.feature_size, arch.hidden_size, bias=False)
            self.hidden_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
            self.layers = nn.ModuleList(DrafterLayer(arch) for _ in range(arch.num_layers))
            self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.attention_backend: Backend | None = None
        """Training attention: None = the device's (compiled flex on CUDA, dense SDPA on CPU)."""
        self.kernels = CompiledKernels()
        """The compiled training kernels, set from outside (`app.compile.apply.compile_drafter`)."""
        if not self.fc.weight.is_meta:
            self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Normal(0, 0.02) projections, unit norms; drawn on the parameters' device, so the same
        seed gives the same weights on every rank of a device type."""
        generator = torch.Generator(device=self.fc.weight.device).manual_seed(seed)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, INIT_STD, generator=generator)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    # ---- training -------------------------------------------------------------------------------

    def forward(self, features: torch.Tensor, row: DrafterRow, embed_tokens: nn.Embedding) -> torch.Tensor:
        """Hidden states of every block slot, `[A, B, H]` (before the LM head), for one packed row.

        `features [T, K*H]` are the row's context features; `row` gives tokens, positions, documents
        and anchors; `embed_tokens` is the target's frozen embedding.
        """
        self._check_inputs(features, row, embed_tokens)
        arch = self.arch
        num_anchors, block = row.anchor_positions.shape[0], arch.block_size
        features = self._compute_dtype(features)
        context = self.hidden_norm(self.fc(features))
        context_rope = rotary_tables(row.position_ids, arch.head_dim, arch.rope_theta)

        offsets = torch.arange(block, device=features.device)
        block_positions = (row.position_ids[row.anchor_positions][:, None] + offsets).reshape(-1)
        block_rope = rotary_tables(block_positions, arch.head_dim, arch.rope_theta)
        hidden = self._compute_dtype(embed_tokens(self._block_tokens(row.input_ids[row.anchor_positions])))

        hidden = hidden.reshape(num_anchors * block, arch.hidden_size)
        attention = training_attention(
            row, block, self._windows(), self.attention_backend, self.kernels.flex_attention
        )
        for index, layer in enumerate(self.layers):
            hidden = layer(hidden, context, context_rope, block_rope, attention[arch.layer_window(index)])
        return self.norm(hidden).view(num_anchors, block, arch.hidden_size)

    # ---- speculative decoding ---------------------------------------------------------------------

    def new_cache(self) -> ContextCache:
        """An empty context cache on the drafter's device."""
        arch, weight = self.arch, self.fc.weight
        empty = torch.empty(
            arch.num_key_value_heads, 0, arch.head_dim, device=weight.device, dtype=weight.dtype
        )
        return ContextCache(
            keys=[empty] * arch.num_layers,
            values=[empty] * arch.num_layers,
            positions=torch.empty(0, dtype=torch.long, device=weight.device),
        )

    @torch.no_grad()
    def extend_context(self, features: torch.Tensor, positions: torch.Tensor, cache: ContextCache) -> None:
        """Append context tokens (`features [n, K*H]` at `positions [n]`) to `cache`, every layer."""
        if features.dim() != 2 or features.shape[1] != self.arch.feature_size:
            raise UserError(self._feature_shape_message(features))
        # Inference shapes change every round: call the eager forwards (`.forward`), which bypass the
        # compiled wrappers `compile_drafter` installs for training (they would recompile every round).
        context = self.hidden_norm.forward(self.fc(self._compute_dtype(features)))
        rope = rotary_tables(positions, self.arch.head_dim, self.arch.rope_theta)
        first = cache.length == 0  # the first chunk fixes the cache's dtype (bf16 under autocast)
        for index, layer in enumerate(self.layers):
            key, value = layer.self_attn.key_value(context, rope)
            cache.keys[index] = (
                key if first else torch.cat([cache.keys[index], key.to(cache.keys[index].dtype)], 1)
            )
            cache.values[index] = (
                value if first else torch.cat([cache.values[index], value.to(cache.values[index].dtype)], 1)
            )
        cache.positions = torch.cat([cache.positions, positions.to(cache.positions.device)])

    @torch.no_grad()
    def draft_logits(
        self,
        cache: ContextCache,
        last_token_id: int | torch.Tensor,
        position: int,
        embed_tokens: nn.Embedding,
        lm_head: nn.Module,
    ) -> torch.Tensor:
        """Logits `[B-1, V]` of one block `[last token, MASK...]` at positions `position + k`, over the
        cached context before `position`; the block's own K/V are used for this round only, never cached."""
        device = self.fc.weight.device
        anchors = torch.as_tensor(last_token_id, device=device).reshape(1)
        return self.blocks_logits(
            cache, anchors, torch.tensor([position], device=device), embed_tokens, lm_head
        )[0]

    @torch.no_grad()
    def blocks_logits(
        self,
        cache: ContextCache,
        anchor_tokens: torch.Tensor,
        anchor_positions: torch.Tensor,
        embed_tokens: nn.Embedding,
        lm_head: nn.Module,
    ) -> torch.Tensor:
        """Logits `[A, B-1, V]` of A blocks `[anchor token, MASK...]` at once: block a sits at positions
        `anchor_positions[a] + k` and sees the cached context strictly before its anchor (a draft round's
        view, whatever else the cache holds), so a cache of a whole sequence serves every round of it
        (`app.evaluate.replay`). Anchors form the batch of each attention: the context K/V are shared."""
        arch = self.arch
        hidden = self._compute_dtype(embed_tokens(self._block_tokens(anchor_tokens)))  # [A, B, H]
        count, block = hidden.shape[:2]
        block_positions = (anchor_positions[:, None] + torch.arange(block, device=hidden.device)).reshape(-1)
        rope = rotary_tables(block_positions, arch.head_dim, arch.rope_theta)
        hidden = hidden.reshape(count * block, arch.hidden_size)
        for index, layer in enumerate(self.layers):
            mask = self._inference_mask(cache, anchor_positions, arch.layer_window(index))
            attend = functools.partial(_attend_per_block, mask=mask, context=cache.length)
            hidden = layer.over_context_kv(hidden, cache.keys[index], cache.values[index], rope, attend)
        hidden = self.norm.forward(hidden).view(count, block, arch.hidden_size)[:, 1:]
        return lm_head(hidden.to(lm_head.weight.dtype)).float()

    def draft(
        self,
        cache: ContextCache,
        last_token_id: int | torch.Tensor,
        position: int,
        embed_tokens: nn.Embedding,
        lm_head: nn.Module,
    ) -> torch.Tensor:
        """The greedy draft: token ids `[B-1]` for positions `position + 1 .. position + B - 1`."""
        return self.draft_logits(cache, last_token_id, position, embed_tokens, lm_head).argmax(dim=-1)

    # ---- helpers ------------------------------------------------------------------------------------

    def _block_tokens(self, anchor_tokens: torch.Tensor) -> torch.Tensor:
        """`[A] -> [A, B]`: each anchor token followed by B-1 MASK tokens."""
        tokens = torch.full(
            (anchor_tokens.shape[0], self.arch.block_size),
            self.arch.mask_token_id,
            dtype=torch.long,
            device=anchor_tokens.device,
        )
        tokens[:, 0] = anchor_tokens
        return tokens

    def _windows(self) -> set[int | None]:
        return {self.arch.layer_window(index) for index in range(self.arch.num_layers)}

    def _inference_mask(self, cache: ContextCache, anchors: torch.Tensor, window: int | None) -> torch.Tensor:
        """`[A, B, n + B]` bool: slot o of the block at anchor p sees the cached context before p and
        its block (the per-query window, app/model/attention.py: positions in [p + o - (W - 1), p + o])."""
        slots = torch.arange(self.arch.block_size, device=anchors.device)
        context = cache.positions[None, None, :] < anchors[:, None, None]
        block = torch.ones(len(slots), len(slots), dtype=torch.bool, device=anchors.device)
        if window is not None:
            window_start = anchors[:, None, None] + slots[None, :, None] - (window - 1)
            context = context & (cache.positions[None, None, :] >= window_start)
            block = (slots[None, :] <= slots[:, None]) & (slots[:, None] - slots[None, :] <= window - 1)
        context = context.expand(len(anchors), len(slots), -1)
        return torch.cat([context, block.expand(len(anchors), -1, -1)], dim=2)

    def _compute_dtype(self, x: torch.Tensor) -> torch.Tensor:
        """Without autocast, bring target-dtype inputs (bf16 features/embeddings) to the weights' dtype."""
        if torch.is_autocast_enabled(x.device.type):
            return x
        return x.to(self.fc.weight.dtype)

    def _feature_shape_message(self, features: torch.Tensor) -> str:
        arch = self.arch
        return (
            f"drafter: features must be [tokens, {arch.feature_size}] (K={arch.num_features} target layers "
            f"{list(arch.target_layer_ids)} x hidden {arch.target_hidden_size}), got {list(features.shape)}"
        )

    def _check_inputs(self, features: torch.Tensor, row: DrafterRow, embed_tokens: nn.Embedding) -> None:
        arch = self.arch
        if features.dim() != 2 or features.shape[1] != arch.feature_size:
            raise UserError(self._feature_shape_message(features))
        if features.shape[0] != row.input_ids.shape[0]:
            raise UserError(
                f"drafter: features cover {features.shape[0]} tokens but the row has {row.input_ids.shape[0]}"
            )
        if row.anchor_positions.shape[0] < 1:
            raise UserError("drafter: the row has no anchor slots (train.anchors must be >= 1)")
        if embed_tokens.embedding_dim != arch.hidden_size or embed_tokens.num_embeddings < arch.vocab_size:
            raise UserError(
                f"drafter: the target embedding is {embed_tokens.num_embeddings} x {embed_tokens.embedding_dim}, "
                f"expected {arch.vocab_size} x {arch.hidden_size}"
            )


def _attend_per_block(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, mask: torch.Tensor, context: int
) -> torch.Tensor:
    """Attention of A blocks laid out flat (`query [1, h, A*B, d]`, keys `[1, kv, n + A*B, d]`: the
    shared context, then every block's own) with each block as a batch row over the context and its
    own keys, under `mask [A, B, n + B]`: no block pays for the others' keys."""
    count, block = mask.shape[:2]
    heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[-1]

    def per_block(tensor: torch.Tensor, head_count: int) -> torch.Tensor:
        return tensor[0].view(head_count, count, block, dim).transpose(0, 1)

    def with_context(tensor: torch.Tensor) -> torch.Tensor:
        shared = tensor[0, :, :context].expand(count, -1, -1, -1)
        return torch.cat([shared, per_block(tensor[:, :, context:], kv_heads)], dim=2)

    out = F.scaled_dot_product_attention(
        per_block(query, heads),
        with_context(key),
        with_context(value),
        attn_mask=mask[:, None],
        enable_gqa=True,
    )
    return out.transpose(0, 1).reshape(1, heads, count * block, dim)
