"""What a run starts from, before any model exists: the tokenized data (once per node under
torchrun), the fast-kernel check and the training signal a resume must keep (the device and the
tokenizer: `app.model.loading`).

Light on purpose: target ranks need these without the trainer's imports.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import torch

from app.config import RunConfig
from app.data.dataset import TokenizedDataset, load_training_data, tokenizer_fingerprint
from app.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from app.pipeline.distributed import Runtime


def load_run_data(
    config: RunConfig, tokenizer: PreTrainedTokenizerBase, runtime: Runtime | None
) -> tuple[TokenizedDataset, TokenizedDataset]:
    """(train, eval) data. Under torchrun, local rank 0 of each node tokenizes first (the first load of
    a large dataset takes long) and the node's other ranks then read its cache."""
    if runtime is None:
        return load_training_data(config, tokenizer)
    node = f"data/node{runtime.layout.node}"
    if runtime.layout.local_rank == 0:
        data = load_training_data(config, tokenizer)
        runtime.side.mark_ready(node)
        return data
    runtime.side.wait_ready(node, "the node's tokenized data")
    return load_training_data(config, tokenizer)


def require_fast_kernels(
    config: RunConfig, device: torch.device, fingerprint: dict[str, Any], *, runs_target: bool = True
) -> list[str]:
    """On CUDA a hybrid target needs its fast kernels where it runs: refuse without them, or (with
    `target.allow_slow_kernels`) return the line the run's start records as accepted. A split drafter
    rank (`runs_target` False) never runs the target, so its own kernels do not matter."""
    from app.env.guard import fast_kernel_gaps
    from app.model.target import is_hybrid, target_text_config

    if not runs_target or device.type != "cuda" or not is_hybrid(target_text_config(config.target)):
        return []
    gaps = fast_kernel_gaps(fingerprint)
    if not gaps:
        return []
    message = (
        f"target: a hybrid (Gated DeltaNet) target on CUDA without {', '.join(gaps)} runs its linear-attention "
        "layers on transformers' slow reference path; install them with `./uvw sync --group gpu` "
        "or train in the GPU image"
    )
    if not config.target.allow_slow_kernels:
        raise UserError(f"{message}; to train on the slow path anyway, set target.allow_slow_kernels=true")
    return [f"{message} (accepted by target.allow_slow_kernels)"]


def training_signal(
    config: RunConfig, layer_ids: list[int], tokenizer: PreTrainedTokenizerBase
) -> dict[str, Any]:
    """What defines what the drafter learns; a resume must not change any of it."""
    source = config.target
    identity = source.path or source.builtin or json.dumps(source.architecture, sort_keys=True)
    return {
        "train.anchors": config.train.anchors,
        "drafter.block_size": config.drafter.block_size,
        "drafter.target_layer_ids": list(layer_ids),
        "drafter.mask_token_id": config.drafter.mask_token_id,
        "drafter.num_layers": config.drafter.num_layers,
        "target": identity,
        "target.seed": source.seed if source.architecture is not None else None,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        # only when set: checkpoints of runs from before the objectives (all CE) still resume
        **(
            {
                "train.objective": config.train.objective,
                "train.objective_weight": config.train.objective_weight,
            }
            if config.train.objective != "ce"
            else {}
        ),
    }
