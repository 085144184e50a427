"""The DFlash training objective: decayed block cross-entropy through the frozen LM head, in chunks.

Block slot k (k >= 1) of anchor a predicts the token at row index a + k (same position, no shift),
where that token exists, belongs to the anchor's document and is supervised (loss_mask). Slot k
weighs `exp(-(k-1)/gamma)`; the loss is the weighted CE sum over the weight sum, plus, with
`train.objective` other than "ce", `train.objective_weight` times an objective on acceptance
(`app.model.acceptance`), computed in the same chunks from the CE's own rows.

The logits `anchors x block x vocab` never exist at once (1024 x 32 x 248K at production sizes):
`chunked_lm_head_ce` runs the LM head `chunk` anchors at a time and computes each chunk's gradient
w.r.t. the hidden states right there (softmax - one-hot, times the LM head), keeping only that
`[A, B-1, H]` gradient for backward. Logits are computed once per step (forward + input gradient:
2 LM-head matmuls, no recompute), and peak memory scales with the chunk size, not the anchors.

Metrics are returned as detached 0-d tensors on the training device: reading them (`.item()`,
`float()`) synchronises with the GPU, so the trainer should only do it on log steps. The tree streak
(`TreeSample`, the DDTree analogue of `streak`) is measured on log steps only, from a few blocks.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from app.config import default_gamma
from app.config.schema import TrainConfig
from app.data.batch import DrafterRow, FeatureBatch
from app.errors import UserError
from app.model.acceptance import SlotObjective
from app.model.attention import UncompiledKernelOnCudaError
from app.model.tree import grow_tree, top_k_per_depth


class CeChunk(Protocol):
    """`ce_chunk(logits [n, V], labels [n], weights [n], row_ce) -> (weighted CE sum, d/d logits, argmax)`;
    it may write the gradient over `logits` (the CUDA kernel does): the caller's logits are spent.
    `row_ce`, an fp32 `[n]` buffer or None, receives each row's weighted CE: with unit weights,
    -log p of the label, what the acceptance objectives need (the CE alone passes None)."""

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        weights: torch.Tensor,
        row_ce: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


@dataclass
class LossOutput:
    """One drafter step's loss and metrics (metrics detached; `.item()` them on log steps only)."""

    loss: torch.Tensor
    """0-d, differentiable: weighted CE sum / weight sum (0 when nothing is supervised), plus
    `objective_weight` x the objective's term when `train.objective` adds one (then it may be < 0)."""
    acc: torch.Tensor
    """0-d: argmax accuracy over supervised block slots."""
    streak: torch.Tensor
    """0-d: mean over valid blocks of the leading correct slots: per block what a round anchored there
    accepts, but over uniform anchors, so above eval's tau - 1, a mean over rounds (docs/architecture.md)."""
    noise: float
    """Std of the Gaussian noise added to the context features this step (0: off)."""
    supervised_tokens: torch.Tensor
    """0-d int64: block slots that carried loss."""
    tree_streak: tuple[torch.Tensor, torch.Tensor] | None = None
    """With a `TreeSample`: (sum over the sampled blocks of the leading slots on a path of the tree,
    blocks sampled), 0-d float each; None otherwise."""


@dataclass(frozen=True)
class TreeSample:
    """Measure the tree streak this step: on `blocks` valid blocks spread over the row, the leading
    supervised slots whose tokens are a path of the budget-`budget` DDTree tree built from the
    drafter's own top-`top_k` per depth (what tree verification would accept, less its bonus token)."""

    budget: int
    top_k: int
    blocks: int

    @classmethod
    def from_config(cls, train: TrainConfig, blocks: int) -> TreeSample | None:
        """The eval's tree (`train.eval_tree_budget`, `eval_tree_top_k`) on `blocks` blocks; None when
        either is 0."""
        if not blocks or not train.eval_tree_budget:
            return None
        return cls(train.eval_tree_budget, train.eval_tree_top_k, blocks)


def training_autocast(train: TrainConfig, device: torch.device) -> torch.autocast:
    """The step's precision rule: bf16 autocast on CUDA when `train.precision` is bf16 (weights and
    optimizer stay fp32), none elsewhere. The loss's logits come out in its dtype, so whatever
    compiles the CE kernel ahead of a run (build-cache) makes them under the same rule."""
    enabled = device.type == "cuda" and train.precision == "bf16"
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def drafter_loss(
    drafter: nn.Module,
    batch: FeatureBatch,
    embed_tokens: nn.Embedding,
    lm_head: nn.Linear,
    *,
    gamma: float | None = None,
    chunk_size: int = 128,
    noise_std: float = 0.0,
    generator: torch.Generator | None = None,
    ce_chunk: CeChunk | None = None,
    tree_sample: TreeSample | None = None,
    objective: str = "ce",
    objective_weight: float = 1.0,
    tree_top_k: int = 1,
    soft_targets: float = 0.0,
) -> LossOutput:
    """Forward one feature batch through the drafter and the chunked, decayed block CE.

    `drafter` may be the DFlashDrafter or a DDP wrapper of it (it is called, not introspected).
    `gamma` None takes the published default for the block size; `chunk_size` is in anchors
    (`train.loss_chunk_size`); `noise_std > 0` adds N(0, noise_std^2) to the features, drawn from
    `generator` (on the features' device) so resumed runs replay the same noise; `ce_chunk` is the
    compiled `weighted_ce_chunk` (required on CUDA, see `chunked_lm_head_ce`); `objective` and
    `objective_weight` are `train.objective` and `train.objective_weight` (`app.model.acceptance`), and
    `tree_top_k` the tree's candidates per depth of "ce+tree" (`train.eval_tree_top_k`);
    `soft_targets` is `train.soft_targets` (`SoftLabels`; needs the batch's `target_hidden`).
    """
    row, features = batch.row, batch.features
    block_size = _block_size(drafter)
    if noise_std > 0:
        noise = torch.randn(features.shape, generator=generator, device=features.device, dtype=features.dtype)
        features = features + noise_std * noise
    hidden = drafter(features, row, embed_tokens)
    labels, supervised = block_labels(row, block_size)
    weights = supervised * slot_weights(block_size, gamma or default_gamma(block_size), hidden.device)
    weights = weights / weights.sum().clamp_min(torch.finfo(torch.float32).tiny)
    slot_objective = SlotObjective.build(objective, objective_weight, supervised, tree_top_k=tree_top_k)
    soft = SoftLabels.of(batch, block_size, soft_targets) if soft_targets > 0 else None
    loss, predictions = chunked_lm_head_ce(
        hidden[:, 1:], lm_head, labels, weights, chunk_size, ce_chunk, slot_objective, soft
    )
    acc, streak = block_metrics(predictions, labels, supervised, row.anchor_valid)
    tree = tree_streak(hidden[:, 1:], lm_head, labels, supervised, tree_sample) if tree_sample else None
    return LossOutput(
        loss=loss,
        acc=acc,
        streak=streak,
        noise=float(noise_std),
        supervised_tokens=supervised.sum(),
        tree_streak=tree,
    )


@torch.no_grad()
def tree_streak(
    hidden: torch.Tensor,
    lm_head: nn.Linear,
    labels: torch.Tensor,
    supervised: torch.Tensor,
    sample: TreeSample,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the tree streaks, blocks) over `sample.blocks` blocks with a supervised first slot,
    spread evenly (`hidden [A, B-1, H]` of slots 1..B-1). Reads the row's labels on the host: a log
    step's synchronisation, one LM-head matmul of the sampled blocks and a tree per block."""
    candidates = supervised[:, 0].nonzero().flatten()
    picks = candidates[
        torch.linspace(0, len(candidates) - 1, min(sample.blocks, len(candidates))).round().long()
    ]
    accepted = sum(tree_accepted(hidden, lm_head, labels, supervised, picks, sample.budget, sample.top_k))
    device = hidden.device
    return torch.tensor(float(accepted), device=device), torch.tensor(float(len(picks)), device=device)


@torch.no_grad()
def tree_accepted(
    hidden: torch.Tensor,
    lm_head: nn.Linear,
    labels: torch.Tensor,
    supervised: torch.Tensor,
    blocks: torch.Tensor,
    budget: int,
    top_k: int,
) -> list[int]:
    """Per block of `blocks` (indices into `hidden [A, B-1, H]`), the leading supervised slots whose
    tokens are a path of its budget-`budget` DDTree tree: what a tree round anchored there accepts
    (tests/test_train_eval_alignment.py holds it to eval's tree rounds)."""
    if not len(blocks):
        return []
    leading = torch.cumprod(supervised[blocks].int(), dim=1).sum(dim=1)
    log_probs, token_ids = top_k_per_depth(lm_head(hidden[blocks].to(lm_head.weight.dtype)), top_k)
    return [
        grow_tree(block_log_probs, block_token_ids, budget).accepted(block[:length])
        for block, length, block_log_probs, block_token_ids in zip(
            labels[blocks].tolist(), leading.tolist(), log_probs, token_ids, strict=True
        )
    ]


@dataclass
class SoftLabels:
    """`train.soft_targets`: slot k's label mixes in the target's own distribution for that token,
    softmax(LM head(the target's final hidden state one position before it)): at row index a + k - 1
    for slot k of anchor a (slot 1 reads the anchor's own)."""

    hidden: torch.Tensor
    """`[A, B-1, H]` the target's final hidden states whose LM-head output predicts each slot's token."""
    weight: float
    """w: the label is (1 - w) x one-hot + w x the target's distribution."""

    @classmethod
    def of(cls, batch: FeatureBatch, block_size: int, weight: float) -> SoftLabels:
        if batch.target_hidden is None:
            raise ValueError("train.soft_targets: the batch carries no target final hidden states")
        length = batch.row.input_ids.shape[0]
        offsets = torch.arange(block_size - 1, device=batch.row.anchor_positions.device)
        index = (batch.row.anchor_positions[:, None] + offsets).clamp(max=length - 1)
        return cls(batch.target_hidden[index], weight)

    def logits(self, anchors: slice, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The target's logits `[a * (B-1), V]` for a chunk of anchors (its LM head: `weight`, `bias`)."""
        hidden = self.hidden[anchors]
        logits = hidden.reshape(-1, hidden.shape[-1]).to(weight.dtype) @ weight.t()
        return logits + bias if bias is not None else logits


def block_labels(row: DrafterRow, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets of block slots 1..B-1: `labels [A, B-1]` (0 where unsupervised) and `supervised [A, B-1]`."""
    length = row.input_ids.shape[0]
    index = row.anchor_positions[:, None] + torch.arange(1, block_size, device=row.input_ids.device)
    inside = index < length
    index = index.clamp(max=length - 1)
    anchor_document = row.document_ids[row.anchor_positions][:, None]
    supervised = (
        inside
        & (row.document_ids[index] == anchor_document)
        & row.loss_mask[index]
        & row.anchor_valid[:, None]
    )
    labels = torch.where(supervised, row.input_ids[index], 0)
    return labels, supervised


def slot_weights(block_size: int, gamma: float, device: torch.device | str) -> torch.Tensor:
    """`[B-1]` weights of slots 1..B-1: exp(-(k-1)/gamma), 1 for the first predicted slot."""
    if gamma <= 0:
        raise UserError(f"train.gamma: must be > 0, got {gamma}")
    return torch.exp(-torch.arange(block_size - 1, device=device, dtype=torch.float32) / gamma)


def feature_noise_std(train: TrainConfig, step: int) -> float:
    """Noise std at optimizer step `step`: `feature_noise_std`, decaying linearly to 0 over
    `feature_noise_decay_steps` when that is > 0."""
    if train.feature_noise_decay_steps <= 0:
        return train.feature_noise_std
    return train.feature_noise_std * max(0.0, 1.0 - step / train.feature_noise_decay_steps)


def noise_generator(seed: int, step: int, position: int, device: torch.device) -> torch.Generator:
    """The feature noise's generator at (seed, step, position in the round): the same batch gets the
    same noise on any topology, and a resumed run replays it."""
    key = f"noise:{seed}:{step}" + (f":{position}" if position else "")
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little") >> 1)


def block_metrics(
    predictions: torch.Tensor, labels: torch.Tensor, supervised: torch.Tensor, anchor_valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`acc` over supervised slots and `streak` = mean leading correct slots per valid block (0-d each)."""
    correct = (predictions == labels) & supervised
    acc = correct.sum() / supervised.sum().clamp_min(1)
    leading = leading_correct(predictions, labels, supervised)
    streak = (leading * anchor_valid).sum() / anchor_valid.sum().clamp_min(1)
    return acc.detach(), streak.detach()


def leading_correct(
    predictions: torch.Tensor, labels: torch.Tensor, supervised: torch.Tensor
) -> torch.Tensor:
    """`[A]` leading correct slots per block, stopping at the first wrong or unsupervised slot: the
    drafts a chain round anchored there accepts (tests/test_train_eval_alignment.py)."""
    correct = (predictions == labels) & supervised
    return torch.cumprod(correct.int(), dim=1).sum(dim=1)


def chunked_lm_head_ce(
    hidden: torch.Tensor,
    lm_head: nn.Linear,
    labels: torch.Tensor,
    weights: torch.Tensor,
    chunk_size: int,
    ce_chunk: CeChunk | None = None,
    objective: SlotObjective | None = None,
    soft: SoftLabels | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """sum(weights * CE(lm_head(hidden), labels)) and the argmax predictions, `chunk_size` anchors at a time.

    `hidden [A, S, H]`, `labels`/`weights [A, S]`. The LM head must be frozen: only `hidden` gets a gradient.
    `ce_chunk` computes each chunk: on CUDA the Triton kernel `app.model.ce_kernel.triton_ce_chunk`
    (handed over by `app.compile.apply.compile_drafter`), required there; None runs
    `weighted_ce_chunk` eagerly elsewhere. With an `objective`, the loss adds its term; its
    gradient rides on the CE's (`_chunk_loss`). With `soft` labels each chunk also runs the LM head
    on the target's hidden states and takes `soft_ce_chunk` (plain PyTorch on every device).
    """
    if lm_head.weight.requires_grad:
        raise ValueError("chunked_lm_head_ce: the LM head must be frozen (requires_grad=False)")
    if chunk_size < 1:
        raise UserError(f"train.loss_chunk_size: must be >= 1, got {chunk_size}")
    if ce_chunk is None and soft is None and hidden.device.type == "cuda":
        raise UncompiledKernelOnCudaError(
            "the loss's cross-entropy chunk has no CUDA kernel (its vocab-sized passes would run "
            "eagerly, unfused); compile the drafter first (app.compile.apply.compile_drafter)"
        )
    return _ChunkedLinearCrossEntropy.apply(
        hidden, lm_head.weight, lm_head.bias, labels, weights, chunk_size, ce_chunk or weighted_ce_chunk,
        objective, soft,
    )  # fmt: skip


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Forward computes loss, predictions and d(loss)/d(hidden) chunk by chunk; backward only scales it."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, weights, chunk_size, ce_chunk, objective, soft):
        needs_grad = ctx.needs_input_grad[0]
        loss = torch.zeros((), device=hidden.device, dtype=torch.float32)
        predictions = torch.empty(labels.shape, device=hidden.device, dtype=torch.long)
        grad_hidden = torch.empty_like(hidden) if needs_grad else None
        for start in range(0, hidden.shape[0], chunk_size):
            stop = min(start + chunk_size, hidden.shape[0])
            chunk = hidden[start:stop].reshape(-1, hidden.shape[-1]).to(weight.dtype)
            logits = chunk @ weight.t()
            if bias is not None:
                logits = logits + bias
            anchors = slice(start, stop)
            if soft is not None:
                chunk_loss, grad_logits, chunk_predictions = soft_ce_chunk(
                    logits, labels[anchors].reshape(-1), weights[anchors].reshape(-1),
                    soft.logits(anchors, weight, bias), soft.weight,
                )  # fmt: skip
                row_scale = None
            else:
                chunk_loss, grad_logits, chunk_predictions, row_scale = _chunk_loss(
                    ce_chunk, logits, labels[anchors], weights[anchors], objective, anchors
                )
            loss = loss + chunk_loss
            predictions[start:stop] = chunk_predictions.view(stop - start, -1)
            if needs_grad:
                grad_chunk = grad_logits @ weight
                if row_scale is not None:  # rows scale after the head's matmul: [n, H], not [n, V]
                    grad_chunk = grad_chunk * row_scale.view(-1, 1)
                grad_hidden[start:stop] = grad_chunk.view(stop - start, -1, hidden.shape[-1])
            del logits, grad_logits  # free this chunk's vocab-sized buffers before the next one
        ctx.mark_non_differentiable(predictions)
        if needs_grad:
            ctx.save_for_backward(grad_hidden)
        return loss, predictions

    @staticmethod
    def backward(ctx, grad_loss, grad_predictions):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_loss.to(grad_hidden.dtype), None, None, None, None, None, None, None, None


def _chunk_loss(
    ce_chunk: CeChunk,
    logits: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    objective: SlotObjective | None,
    anchors: slice,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk's (loss, d/d logits, argmax, per-row scale of `d/d logits @ W` or None) for its
    `labels`/`weights [a, B-1]`.

    The CE alone runs the chunk with its weights: the gradient comes out weighted, no row scale. An
    objective runs it with unit weights for each row's CE and unweighted g = softmax - one_hot; the
    row's gradient is then (w + lambda c) g, applied to `g @ W`'s rows by the caller.
    """
    if objective is None:
        loss, grad_logits, predictions = ce_chunk(logits, labels.reshape(-1), weights.reshape(-1))
        return loss, grad_logits, predictions, None
    row_ce = torch.empty(labels.numel(), device=logits.device, dtype=torch.float32)
    unit = torch.ones(labels.numel(), device=logits.device, dtype=torch.float32)
    _, grad_logits, predictions = ce_chunk(logits, labels.reshape(-1), unit, row_ce)
    row_ce = row_ce.view(labels.shape)
    value, c = objective.chunk(anchors, row_ce, weights)
    return (row_ce * weights).sum() + value, grad_logits, predictions, weights + c


def weighted_ce_chunk(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, row_ce: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted CE sum, its gradient w.r.t. the logits (in the logits' dtype), and the argmax, for
    `logits [n, V]`: what one chunk of the loss computes, in plain PyTorch (the CPU's path; on CUDA
    the Triton kernel `app.model.ce_kernel` computes the same in two passes over the logits).
    `row_ce`, when given, receives each row's weighted CE (`CeChunk`).

    The normaliser is softmax's max, shift, exp and sum, without `torch.logsumexp`'s guard against
    infinite maxima: the logits of a finite step are finite, and a non-finite step is skipped whole.
    """
    dtype = logits.dtype
    logits = logits.float()
    predictions = logits.argmax(dim=-1)
    row_max = logits.amax(dim=-1, keepdim=True)
    exp = (logits - row_max).exp()
    sum_exp = exp.sum(dim=-1, keepdim=True)
    log_normaliser = (row_max + sum_exp.log()).squeeze(-1)
    label_logits = logits.gather(-1, labels[:, None]).squeeze(-1)
    rows = (log_normaliser - label_logits) * weights
    if row_ce is not None:
        row_ce.copy_(rows)
    loss = rows.sum()
    # d(w * CE)/d(logits) = w * (softmax - one_hot)
    one_hot = torch.arange(logits.shape[-1], device=logits.device) == labels[:, None]
    grad = (exp / sum_exp - one_hot.float()) * weights[:, None]
    return loss, grad.to(dtype), predictions


def soft_ce_chunk(
    logits: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    target_logits: torch.Tensor,
    mix: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`weighted_ce_chunk` against soft labels y = (1 - mix) one_hot(labels) + mix softmax(target_logits):
    sum(weights * -sum_v y log softmax(logits)), its gradient w * (softmax - y), and the argmax. The
    cross-entropy with the target's distribution is its KL divergence plus that distribution's entropy,
    which does not depend on the drafter: the same gradient."""
    dtype = logits.dtype
    logits = logits.float()
    predictions = logits.argmax(dim=-1)
    log_q = logits.log_softmax(dim=-1)
    soft = target_logits.float().softmax(dim=-1) * mix
    soft.scatter_add_(-1, labels[:, None], torch.full_like(log_q[:, :1], 1.0 - mix))
    loss = (-(soft * log_q).sum(dim=-1) * weights).sum()
    grad = (log_q.exp() - soft) * weights[:, None]
    return loss, grad.to(dtype), predictions


def _block_size(drafter: nn.Module) -> int:
    module = getattr(drafter, "module", drafter)  # DDP / FSDP wrappers keep the drafter in `.module`
    return module.arch.block_size
