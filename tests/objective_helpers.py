"""Shared by the objective's tests: the small shapes, a synthetic row, the block-label rule written out
and a one-layer drafter with its frozen embedding and LM head."""

from __future__ import annotations

import torch
from torch import nn

from app.config import validate_config
from app.data.batch import FeatureBatch
from app.data.synthetic import synthetic_row
from app.model.drafter import DFlashDrafter, DrafterArch

VOCAB, HIDDEN, BLOCK = 257, 32, 5


def make_row(seed, token_budget=128, anchors=12, valid=9, padding=7):
    generator = torch.Generator().manual_seed(seed)
    return synthetic_row(
        token_budget,
        anchors,
        VOCAB,
        num_documents=3,
        padding=padding,
        valid_anchors=valid,
        generator=generator,
    )


def reference_labels(row, block_size):
    """Slot k of anchor a: the token at a + k, if it exists, is in a's document and is supervised."""
    length = row.input_ids.shape[0]
    labels, supervised = [], []
    for anchor, valid in zip(row.anchor_positions.tolist(), row.anchor_valid.tolist(), strict=True):
        block_labels_, block_supervised = [], []
        for k in range(1, block_size):
            target = anchor + k
            ok = (
                valid
                and target < length
                and row.document_ids[target] == row.document_ids[anchor]
                and bool(row.loss_mask[target])
            )
            block_supervised.append(ok)
            block_labels_.append(int(row.input_ids[target]) if ok else 0)
        labels.append(block_labels_)
        supervised.append(block_supervised)
    return torch.tensor(labels), torch.tensor(supervised)


def drafter_setup():
    """(drafter, embed_tokens, lm_head, batch): a one-layer drafter of block size `BLOCK` on a random
    qwen3-shaped target, frozen random embedding and LM head, and a 128-token row of 12 anchors."""
    config = validate_config(
        {
            "target": {
                "architecture": {
                    "model_type": "qwen3",
                    "vocab_size": VOCAB,
                    "hidden_size": HIDDEN,
                    "intermediate_size": 48,
                    "num_hidden_layers": 6,
                    "num_attention_heads": 2,
                    "num_key_value_heads": 1,
                    "head_dim": 16,
                }
            },
            "drafter": {"num_layers": 1, "block_size": BLOCK, "mask_token_id": 4, "target_layer_ids": [2]},
            "data": {"token_budget": 128, "max_length": 64},
            "train": {"anchors": 12},
        }
    )
    drafter = DFlashDrafter(DrafterArch.from_config(config), seed=0)
    generator = torch.Generator().manual_seed(3)
    embed_tokens = nn.Embedding(VOCAB, HIDDEN).requires_grad_(False)
    lm_head = nn.Linear(HIDDEN, VOCAB, bias=False).requires_grad_(False)
    for module in (embed_tokens, lm_head):
        module.weight.copy_(torch.randn(module.weight.shape, generator=generator))
    batch = FeatureBatch(row=make_row(1), features=torch.randn(128, HIDDEN, generator=generator))
    return drafter, embed_tokens, lm_head, batch
