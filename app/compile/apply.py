"""torch.compile applied to the drafter and the target from outside their code: the model modules and
the loss stay plain PyTorch, and every compiled kernel is made here, once per process, on the main
thread (compiling flex_attention from several threads at once broke the incident's run).

What compiles (CUDA only): every decoder layer and norm of the drafter (fuses the norms, RoPE and
SwiGLU around the attention), flex_attention with the training BlockMask, all with dynamic=False (the
shapes are fixed); and the target's norms, MLPs and RoPE, dynamic in the token count only
(`compile_target`). The loss's cross-entropy chunk is a Triton kernel of its own (`app.model.ce_kernel`),
handed to the drafter here with the compiled ones. On CPU nothing compiles: the compiled flex backward
fails there, and training runs eager SDPA.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from types import ModuleType

import torch
from torch.compiler._cache import CacheArtifactManager
from torch.nn.attention.flex_attention import flex_attention

from app.model.attention import FlexKernel
from app.model.drafter import CompiledKernels, DFlashDrafter
from app.model.target import TargetModel


def compile_drafter(drafter: DFlashDrafter) -> None:
    """Compile the drafter's layers and give it the compiled training kernels. Call before the first
    step, on the main thread; a drafter on CUDA refuses to train without it."""
    if drafter.fc.weight.device.type != "cuda":
        raise RuntimeError("compile_drafter: only on CUDA (compiled flex_attention backward fails on CPU)")
    require_main_thread("the drafter")
    # Triton comes with torch's Linux x86-64 wheels only: imported where CUDA runs, not with this module
    from app.model.ce_kernel import triton_ce_chunk

    for module in (drafter.hidden_norm, *drafter.layers, drafter.norm):
        module.compile(dynamic=False)
    drafter.kernels = CompiledKernels(flex_attention=compiled_flex_attention(), ce_chunk=triton_ce_chunk)


def compile_target(target: TargetModel) -> int:
    """Compile the target's position-wise modules (`TargetModel.position_wise_modules`: its norms and
    dense MLPs) and its attention layers' RoPE over a flat, dynamic token dimension; returns how many
    modules. Call on the main thread before the target's warm-up (`warm_up_target` runs both ends of
    the shape set).

    In eager HF code each fp32 norm is five or six full passes over the activations (cast, square,
    mean, scale, weight, cast back), a quarter of a 27B hybrid forward on an H200, and RoPE is a
    dozen (slices, negation, two concatenations, products and sums). Compiled, each is one read and
    one write. Every input is flattened to `[tokens, ...]` with the token dim marked dynamic, so one
    graph per module kind and layout serves every batch shape of the run (and recompiling never
    happens for a new shape). The projections (cuBLAS), attention and library kernels such as
    flash-linear-attention's stay as they are: whole decoder layers compiled measured 0.87-0.96x of
    eager. Eval's cached decoding calls these at other shapes: it runs them eagerly
    (`app.compile.guard.eagerly`)."""
    require_main_thread("the target's position-wise modules")
    modules = target.position_wise_modules()
    for module in modules:
        module.forward = _over_flat_tokens(torch.compile(module.forward))
    for modeling in target.rotary_modeling_modules():
        original = _TRANSFORMERS_ROTARY.setdefault(modeling, modeling.apply_rotary_pos_emb)
        modeling.apply_rotary_pos_emb = _rotary_over_flat_tokens(torch.compile(original), original)
    return len(modules)


def compile_decode_step(
    step: Callable[..., torch.Tensor], device: torch.device
) -> Callable[..., torch.Tensor]:
    """`step` (the target's batched decode step, `app.generate.step.RingStep`) compiled into CUDA
    graphs: one token per row through the whole model, at the decoder's one shape, so it compiles on
    its first call and never again in the process (fullgraph: a graph break would be an error, not a
    quiet slow path; so is a graph inductor would not capture).
    Eager, a 30-layer target's step is hundreds of kernel launches from Python for a few microseconds
    of work each; replayed as a graph it runs at the GPU's pace."""
    if device.type != "cuda":
        raise RuntimeError("compile_decode_step: only on CUDA (CUDA graphs)")
    require_main_thread("the target's decode step")
    # "reduce-overhead"'s one option, plus an error where inductor would otherwise skip the graphs
    # quietly (a mutated input, say) and launch every kernel from Python
    options = {"triton.cudagraphs": True, "triton.cudagraph_or_error": True}
    return torch.compile(step, options=options, dynamic=False, fullgraph=True)


# transformers' own `apply_rotary_pos_emb` per modeling module, so compiling a second target of the
# same module wraps the original, not the first wrapper
_TRANSFORMERS_ROTARY: dict[ModuleType, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {}


def _over_flat_tokens(compiled: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`compiled` called with its tensor arguments flattened to `[tokens, last dim]` (a view where
    the layout allows: a query split from a fused projection is read in place, a graph of its own),
    the token dim marked dynamic (a batch's is at least 2, above dynamo's size-1 specialisation),
    the result viewed back to the first argument's leading dims. Traced by an enclosing graph (a
    whole-model compile later in the process, `compile_decode_step`), it is the module's own forward
    (`inside_a_trace`)."""

    def flat(value: object) -> object:
        if not isinstance(value, torch.Tensor):
            return value
        tokens = _unrelated(value.reshape(-1, value.shape[-1]))
        torch._dynamo.mark_dynamic(tokens, 0)
        return tokens

    def forward(*args: object, **kwargs: object) -> torch.Tensor:
        if inside_a_trace():
            return compiled(*args, **kwargs)
        leading = next(v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)).shape[:-1]
        output = compiled(*map(flat, args), **{name: flat(value) for name, value in kwargs.items()})
        return output.view(*leading, output.shape[-1])

    return forward


def inside_a_trace() -> bool:
    """Whether dynamo is tracing the caller into an enclosing graph. `compile_target`'s replacements
    stay for the whole process (transformers' RoPE is a module-level function), so a later whole-model
    compile traces through them; marking a dim dynamic there is an error, and that graph fuses these
    operations itself."""
    return torch.compiler.is_compiling()


def _unrelated(view: torch.Tensor) -> torch.Tensor:
    """`view` without its autograd link to the tensor it views (the target is frozen): dynamo guards
    a view on its base's shape, which differs per batch shape and would recompile each new one."""
    return view.detach()


def _rotary_over_flat_tokens(
    compiled: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    original: Callable[..., tuple[torch.Tensor, torch.Tensor]],
) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """transformers' `apply_rotary_pos_emb(q, k, cos, sin)` (q, k `[B, heads, T, D]`, cos and sin
    `[B or 1, T, rotary dim]`) computed by `compiled` over `[B*T, heads, D]`, the token dim dynamic.
    The results come back token-major (`[B, T, heads, D]` in memory, viewed as `[B, heads, T, D]`):
    the layout attention kernels read natively, and in which their output needs no copy to go back
    to `[B, T, hidden]`. Other layouts or call forms, and an enclosing graph's trace
    (`inside_a_trace`), go to `original`."""

    def apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1):
        if unsqueeze_dim != 1 or q.dim() != 4 or cos.dim() != 3 or inside_a_trace():
            return original(q, k, cos, sin, unsqueeze_dim)
        batch, _, length, _ = q.shape

        def tokens(x: torch.Tensor) -> torch.Tensor:
            flat = _unrelated(x.transpose(1, 2).reshape(batch * length, *x.shape[1:2], x.shape[-1]))
            torch._dynamo.mark_dynamic(flat, 0)
            return flat

        def angles(x: torch.Tensor) -> torch.Tensor:
            flat = _unrelated(x.expand(batch, length, x.shape[-1]).reshape(batch * length, x.shape[-1]))
            torch._dynamo.mark_dynamic(flat, 0)
            return flat

        q_out, k_out = compiled(tokens(q), tokens(k), angles(cos), angles(sin))
        return tuple(out.view(batch, length, *out.shape[1:]).transpose(1, 2) for out in (q_out, k_out))

    return apply


@functools.cache
def compiled_flex_attention() -> FlexKernel:
    require_main_thread("flex_attention")
    return torch.compile(flex_attention, dynamic=False)


def reset_compiled_state() -> None:
    """Forget every graph this process compiled (dynamo's code caches, the shared kernels above, the
    loss's Triton kernel) and the cache artifacts recorded so far, as in a new process: what compiles
    next is looked up or compiled afresh, and recorded. build-cache starts from here, so an entry built
    in a process that compiled before (a notebook, the test suite) still holds every artifact and
    Triton file its run will load."""
    require_main_thread("the compiled state")
    from app.model.ce_kernel import forget_compiled_kernel  # Triton: see compile_drafter

    torch.compiler.reset()
    compiled_flex_attention.cache_clear()
    forget_compiled_kernel()
    CacheArtifactManager.clear()


def require_main_thread(what: str) -> None:
    """Compiled kernels are created on the main thread only: concurrent FX tracing breaks them."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            f"compiled {what} must be created on the main thread (concurrent FX tracing breaks it)"
        )
