"""The training signal: what defines what the drafter learns, recorded in every checkpoint, which a
resume must keep (what a run loads before the drafter exists: `app.pipeline.inputs`)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from app.config import RunConfig
from app.data.dataset import tokenizer_fingerprint

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


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
