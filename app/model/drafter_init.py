"""The drafter's layers initialised from the target's last decoder layers (`drafter.init = "target"`).

The drafter's layers have the reference layout's names, which are also the HF Llama/Qwen decoder
layer's (`self_attn.{q,k,v,o}_proj`, `mlp.{gate,up,down}_proj`, the two layernorms; Qwen3's
`q_norm`/`k_norm`). Drafter layer i takes target layer `num_target_layers - num_layers + i`, and the
final norm takes the target's: the last layers are the ones nearest the next-token prediction the
drafter makes. What the target lacks (a Llama's q/k norms) keeps its fresh init; `fc`, which has
no counterpart, stays random.
"""

from __future__ import annotations

import torch
from torch import nn

from app.errors import UserError
from app.model.drafter import DFlashDrafter
from app.model.target import TargetModel


@torch.no_grad()
def init_from_target(drafter: DFlashDrafter, target: TargetModel) -> str:
    """Copy the target's last layers (and final norm) into `drafter`; a parameter whose shape differs
    is refused in one line (the drafter's layout must be the target's). Returns what was copied."""
    layers = list(target.model.get_decoder().layers)
    first = len(layers) - len(drafter.layers)
    if first < 0:
        raise UserError(
            f"drafter.init: 'target' needs at most the target's {len(layers)} layers, the drafter has "
            f"{len(drafter.layers)}"
        )
    copied = kept = 0
    for index, layer in enumerate(drafter.layers):
        done, missing = _copy_matching(layer, layers[first + index], f"drafter layer {index}", first + index)
        copied, kept = copied + done, kept + missing
    final_norm = getattr(target.model.get_decoder(), "norm", None)
    if isinstance(final_norm, nn.Module):
        done, _ = _copy_matching(drafter.norm, final_norm, "the drafter's final norm", None)
        copied += done
    return (
        f"drafter init: {copied} tensors from the target's layers {first}-{len(layers) - 1} and final norm"
        + (f"; {kept} the target has no counterpart for kept their fresh init" if kept else "")
    )


def _copy_matching(
    mine: nn.Module, theirs: nn.Module, where: str, target_layer: int | None
) -> tuple[int, int]:
    """Copy each of `mine`'s parameters from the same name in `theirs`: (copied, without counterpart)."""
    source = dict(theirs.named_parameters())
    copied = missing = 0
    for name, parameter in mine.named_parameters():
        other = source.get(name)
        if other is None:
            missing += 1
            continue
        if other.shape != parameter.shape:
            origin = f"target layer {target_layer}" if target_layer is not None else "the target's final norm"
            raise UserError(
                f"drafter.init: 'target': {where}'s {name} is {tuple(parameter.shape)}, {origin}'s is "
                f"{tuple(other.shape)}; leave the drafter's head and FFN sizes at the target's, or use 'random'"
            )
        parameter.copy_(other.to(parameter.dtype))
        copied += 1
    return copied, missing
