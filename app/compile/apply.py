"""torch.compile applied to the drafter from outside its code: the model modules and the loss stay
plain PyTorch, and every compiled kernel is made here, once per process, on the main thread
(compiling flex_attention from several threads at once broke the incident's run).

What compiles (CUDA only; dynamic=False, the shapes are fixed): every decoder layer and norm of the
drafter (fuses the norms, RoPE and SwiGLU around the attention), flex_attention with the training
BlockMask, and the loss's cross-entropy chunk (fuses its softmax passes over the vocab). On CPU
nothing compiles: the compiled flex backward fails there, and training runs eager SDPA.
"""

from __future__ import annotations

import functools
import threading

import torch
from torch.nn.attention.flex_attention import flex_attention

from app.model.attention import FlexKernel
from app.model.drafter import CompiledKernels, DFlashDrafter
from app.model.objective import CeChunk, weighted_ce_chunk


def compile_drafter(drafter: DFlashDrafter) -> None:
    """Compile the drafter's layers and give it the compiled training kernels. Call before the first
    step, on the main thread; a drafter on CUDA refuses to train without it."""
    if drafter.fc.weight.device.type != "cuda":
        raise RuntimeError("compile_drafter: only on CUDA (compiled flex_attention backward fails on CPU)")
    require_main_thread("the drafter")
    for module in (drafter.hidden_norm, *drafter.layers, drafter.norm):
        module.compile(dynamic=False)
    drafter.kernels = CompiledKernels(flex_attention=compiled_flex_attention(), ce_chunk=compiled_ce_chunk())


@functools.cache
def compiled_flex_attention() -> FlexKernel:
    require_main_thread("flex_attention")
    return torch.compile(flex_attention, dynamic=False)


@functools.cache
def compiled_ce_chunk() -> CeChunk:
    require_main_thread("cross-entropy chunk")
    return torch.compile(weighted_ce_chunk, dynamic=False)


def require_main_thread(what: str) -> None:
    """Compiled kernels are created on the main thread only: concurrent FX tracing breaks them."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            f"compiled {what} must be created on the main thread (concurrent FX tracing breaks it)"
        )
