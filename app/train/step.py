"""One drafter training step: the implementation the trainer, the compile warm-up, build-cache's
baseline timing and every benchmark run, so what is measured is what trains.

Built once from the run config: the loss settings (gamma, chunk size, objective), the precision
rule (bf16 autocast on CUDA when `train.precision` is bf16), the optimizer (AdamW, fused on CUDA)
and the gradient clip. A step is `backward` once per micro-batch, then `apply` once: gradients accumulate
over the micro-batches, each loss divided by their number, and `apply` clips, steps and clears them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from app.compile.guard import recompile_errors
from app.config import RunConfig
from app.config.schema import TrainConfig
from app.data.batch import FeatureBatch
from app.model.drafter import DFlashDrafter
from app.model.objective import LossOutput, TreeSample, drafter_loss, training_autocast
from app.pipeline.distributed import Runtime
from app.pipeline.replicas import broadcast_optimizer_state, wrap_for_drafter_group


class FrozenHeads(Protocol):
    """What the drafter borrows from the target: a TargetModel, or the heads a split rank received."""

    embed_tokens: nn.Embedding
    lm_head: nn.Linear


@dataclass
class BorrowedHeads:
    """The target's frozen embedding and LM head, held apart from the target (a split drafter rank
    receives them; benchmarks make stand-ins)."""

    embed_tokens: nn.Embedding
    lm_head: nn.Linear


def build_optimizer(drafter: DFlashDrafter, train: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """The drafter's AdamW (fused on CUDA: one kernel per parameter group instead of one per tensor)."""
    return torch.optim.AdamW(
        drafter.parameters(),
        lr=train.lr,
        betas=train.betas,
        weight_decay=train.weight_decay,
        fused=device.type == "cuda",
    )


class DrafterStep:
    """Forward, chunked loss and backward of one feature batch; clip and optimizer step of the drafter."""

    def __init__(self, config: RunConfig, drafter: DFlashDrafter, heads: FrozenHeads, device: torch.device):
        self.train = config.train
        self.drafter = drafter
        self.model: nn.Module = drafter
        """What the forward calls: the drafter, or its DDP wrapper once `replicate` joined the group."""
        self.heads = heads
        self.device = torch.device(device)
        self.optimizer = build_optimizer(drafter, config.train, self.device)
        self.finite = torch.ones((), dtype=torch.bool, device=self.device)
        """False (on the device) from the first step whose loss or gradient norm was not finite on:
        from then on no optimizer step changes the weights, so the run stops (at its next look) with
        the state of the last good step, never with a non-finite one applied."""

    def replicate(self, runtime: Runtime, resumed: bool) -> None:
        """Train as one of the drafter group from here on: DDP over it (drafter rank 0's weights, and
        after a resume its optimizer state, broadcast to every drafter rank)."""
        self.model = wrap_for_drafter_group(self.drafter, runtime)
        if resumed:
            broadcast_optimizer_state(self.optimizer, runtime)

    @property
    def replicated(self) -> bool:
        return self.model is not self.drafter

    def accumulating(self, last: bool) -> contextlib.AbstractContextManager[None]:
        """Around a micro-batch's forward and backward: with DDP only the `last` one all-reduces."""
        return self.model.no_sync() if self.replicated and not last else contextlib.nullcontext()  # type: ignore[operator]

    def loss(
        self,
        batch: FeatureBatch,
        *,
        noise_std: float = 0.0,
        generator: torch.Generator | None = None,
        tree_sample: TreeSample | None = None,
    ) -> LossOutput:
        """The drafter's loss and metrics on `batch` (and its tree streak with `tree_sample`); a
        recompile here raises a one-line RecompileError."""
        with training_autocast(self.train, self.device), recompile_errors():
            return drafter_loss(
                self.model,
                batch,
                self.heads.embed_tokens,
                self.heads.lm_head,
                gamma=self.train.gamma,  # None: the objective's published default for the block size
                chunk_size=self.train.loss_chunk_size,
                noise_std=noise_std,
                generator=generator,
                ce_chunk=self.drafter.kernels.ce_chunk,
                tree_sample=tree_sample,
                objective=self.train.objective,
                objective_weight=self.train.objective_weight,
                tree_top_k=self.train.eval_tree_top_k,
                soft_targets=self.train.soft_targets,
            )

    def backward(
        self,
        batch: FeatureBatch,
        *,
        micro_batches: int = 1,
        noise_std: float = 0.0,
        generator: torch.Generator | None = None,
        tree_sample: TreeSample | None = None,
    ) -> LossOutput:
        """Accumulate the gradient of `batch`'s loss divided by `micro_batches` (their mean, once all ran)."""
        out = self.loss(batch, noise_std=noise_std, generator=generator, tree_sample=tree_sample)
        (out.loss / micro_batches).backward()
        return out

    def apply(self, lr: float, loss: torch.Tensor | None = None) -> torch.Tensor:
        """Clip the accumulated gradients, take the optimizer step at `lr`, clear them; the grad norm
        (before clipping, on the device: reading it synchronises).

        A non-finite gradient norm or `loss` (the step's summed loss) skips this step and every later
        one without a host sync: on CUDA the fused AdamW reads the `finite` flag as its `found_inf`
        and leaves weights and moments untouched on the device; on the CPU reading it costs nothing.
        """
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.train.grad_clip)
        self.finite &= torch.isfinite(grad_norm)
        if loss is not None:
            self.finite &= torch.isfinite(loss)
        if self.device.type == "cuda":
            self.optimizer.found_inf = (~self.finite).float()  # type: ignore[attr-defined]
            self.optimizer.step()
        elif bool(self.finite):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm
