"""torch.compile applied to the drafter (and, for `dflash bench target`, the target's layers) from
outside their code: the model modules and the loss stay plain PyTorch, and every compiled kernel is
made here, once per process, on the main thread (compiling flex_attention from several threads at
once broke the incident's run).

What compiles (CUDA only; dynamic=False, the shapes are fixed): every decoder layer and norm of the
drafter (fuses the norms, RoPE and SwiGLU around the attention), flex_attention with the training
BlockMask, and the loss's cross-entropy chunk (fuses its softmax passes over the vocab). On CPU
nothing compiles: the compiled flex backward fails there, and training runs eager SDPA.
"""

from __future__ import annotations

import functools
import threading

import torch
from torch.compiler._cache import CacheArtifactManager
from torch.nn.attention.flex_attention import flex_attention

from app.model.attention import FlexKernel
from app.model.drafter import CompiledKernels, DFlashDrafter
from app.model.objective import CeChunk, weighted_ce_chunk
from app.model.target import TargetModel


def compile_drafter(drafter: DFlashDrafter) -> None:
    """Compile the drafter's layers and give it the compiled training kernels. Call before the first
    step, on the main thread; a drafter on CUDA refuses to train without it."""
    if drafter.fc.weight.device.type != "cuda":
        raise RuntimeError("compile_drafter: only on CUDA (compiled flex_attention backward fails on CPU)")
    require_main_thread("the drafter")
    for module in (drafter.hidden_norm, *drafter.layers, drafter.norm):
        module.compile(dynamic=False)
    drafter.kernels = CompiledKernels(flex_attention=compiled_flex_attention(), ce_chunk=compiled_ce_chunk())


def compile_target_layers(target: TargetModel, shapes: int) -> None:
    """Put every decoder layer the target's features run under torch.compile (its forward only, so
    the feature taps' hooks stay outside the graph), for `shapes` input shapes. Identical layers share
    one graph per layer kind and shape, so the recompile limit is raised to hold them all, and hitting
    it fails rather than silently running the rest eager."""
    require_main_thread("the target's layers")
    kinds = len({getattr(layer, "layer_type", None) for layer in target.layers_run})
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, kinds * shapes)
    config.fail_on_recompile_limit_hit = True
    for layer in target.layers_run:
        layer.forward = torch.compile(layer.forward, dynamic=False)


@functools.cache
def compiled_flex_attention() -> FlexKernel:
    require_main_thread("flex_attention")
    return torch.compile(flex_attention, dynamic=False)


@functools.cache
def compiled_ce_chunk() -> CeChunk:
    require_main_thread("cross-entropy chunk")
    return torch.compile(weighted_ce_chunk, dynamic=False)


def reset_compiled_state() -> None:
    """Forget every graph this process compiled (dynamo's code caches, the shared kernels above) and
    the cache artifacts recorded so far, as in a new process: what compiles next is looked up or
    compiled afresh, and recorded. build-cache starts from here, so an entry built in a process that
    compiled before (a notebook, the test suite) still holds every artifact its run will load."""
    require_main_thread("the compiled state")
    torch.compiler.reset()
    compiled_flex_attention.cache_clear()
    compiled_ce_chunk.cache_clear()
    CacheArtifactManager.clear()


def require_main_thread(what: str) -> None:
    """Compiled kernels are created on the main thread only: concurrent FX tracing breaks them."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            f"compiled {what} must be created on the main thread (concurrent FX tracing breaks it)"
        )
