"""Checks that keep a run on its compiled kernels: the flex rule, cache counters, recompiles, throughput.

The incident's run degraded silently three ways: eager flex_attention on CUDA, kernels recompiled
(or compiled during FX tracing through a forced flag), and 4.6K instead of 20K tok/s. Each has a
check here: `compiles_on` refuses eager on CUDA, `cache_use_problems` reads the inductor/autograd
cache counters after warm-up, `steady_state` turns any later recompile into a one-line error, and
`baseline_step_time` is the step time `build-cache` measured, which the throughput watch compares with.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from app.config.schema import RunConfig
from app.errors import UserError

RECOMPILE_MESSAGE = "Detected recompile when torch.compile stance is 'fail_on_recompile'"

FX_TRACE_FLAGS = (("force_compile_during_fx_trace", False), ("error_on_nested_fx_trace", True))
"""torch._dynamo.config flags and their safe values. Forcing compilation during FX tracing is the
incident's "fix" that produced degraded kernels; this code base never changes either flag."""


class RecompileError(UserError):
    """Something was recompiled after warm-up: shapes, dtypes or code changed in steady state."""


class CompileCacheMiss(UserError):
    """With a matching cache loaded, warm-up still compiled (miss) or skipped the cache (bypass)."""


def compiles_on(mode: str, device: torch.device | str, attention_backend: str | None = None) -> bool:
    """Whether training on `device` compiles (`compile.mode` auto/on/off); refuses the degraded choices.

    CUDA always compiles: eager flex_attention there materialises the full score matrix (the
    incident's 4-5x slower, volatile-memory mode), and the dense fallback is for CPU only. CPU never
    compiles: the compiled flex backward fails there.
    """
    cuda = torch.device(device).type == "cuda"
    if cuda and mode == "off":
        raise UserError(
            'compile.mode: "off" is refused on CUDA (eager flex_attention materialises the full score '
            "matrix: 4-5x slower, volatile memory)"
        )
    if not cuda and mode == "on":
        raise UserError(
            f'compile.mode: "on" needs CUDA (the compiled flex_attention backward fails on {torch.device(device).type}); '
            'use "auto" to run eager here'
        )
    if cuda and attention_backend not in (None, "flex"):
        raise UserError(
            f"drafter attention backend {attention_backend!r} on CUDA: training uses compiled flex_attention "
            "on GPUs (the dense path materialises the full mask)"
        )
    return cuda


@dataclass(frozen=True)
class CompileCounters:
    """torch._dynamo's compile-cache counters (process-wide, cumulative)."""

    fxgraph_cache_hit: int = 0
    fxgraph_cache_miss: int = 0
    fxgraph_cache_bypass: int = 0
    autograd_cache_hit: int = 0
    autograd_cache_miss: int = 0
    autograd_cache_bypass: int = 0
    unique_graphs: int = 0

    def __sub__(self, earlier: CompileCounters) -> CompileCounters:
        return CompileCounters(
            **{name: value - getattr(earlier, name) for name, value in asdict(self).items()}
        )

    @property
    def misses(self) -> int:
        return self.fxgraph_cache_miss + self.autograd_cache_miss

    @property
    def bypasses(self) -> int:
        return self.fxgraph_cache_bypass + self.autograd_cache_bypass

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    def describe(self) -> str:
        return (
            f"inductor hit/miss/bypass {self.fxgraph_cache_hit}/{self.fxgraph_cache_miss}/"
            f"{self.fxgraph_cache_bypass}, autograd hit/miss/bypass {self.autograd_cache_hit}/"
            f"{self.autograd_cache_miss}/{self.autograd_cache_bypass}, graphs {self.unique_graphs}"
        )


def read_counters() -> CompileCounters:
    from torch._dynamo.utils import counters

    inductor, autograd = counters["inductor"], counters["aot_autograd"]
    return CompileCounters(
        fxgraph_cache_hit=inductor["fxgraph_cache_hit"],
        fxgraph_cache_miss=inductor["fxgraph_cache_miss"],
        fxgraph_cache_bypass=inductor["fxgraph_cache_bypass"],
        autograd_cache_hit=autograd["autograd_cache_hit"],
        autograd_cache_miss=autograd["autograd_cache_miss"],
        autograd_cache_bypass=autograd["autograd_cache_bypass"],
        unique_graphs=counters["stats"]["unique_graphs"],
    )


def cache_use_problems(warmup: CompileCounters, cache_loaded: bool) -> list[str]:
    """Error lines for the warm-up's counters: with a loaded cache nothing may miss or bypass it."""
    if not cache_loaded:
        return []
    problems = []
    if warmup.misses:
        problems.append(
            f"compile cache: {warmup.fxgraph_cache_miss} inductor and {warmup.autograd_cache_miss} autograd "
            "cache misses after loading a matching cache: kernels were compiled afresh (the cache is stale "
            "or incomplete for this run; rebuild it with `dflash build-cache`)"
        )
    if warmup.bypasses:
        problems.append(
            f"compile cache: {warmup.fxgraph_cache_bypass} inductor and {warmup.autograd_cache_bypass} "
            "autograd cache bypasses: some graphs cannot be cached and were compiled afresh"
        )
    return problems


def verify_fx_trace_flags() -> None:
    """Refuse to train when the FX-tracing safety flags were changed (by any imported code)."""
    import torch._dynamo.config as dynamo_config

    changed = [
        f"{name}={getattr(dynamo_config, name)!r}"
        for name, safe in FX_TRACE_FLAGS
        if getattr(dynamo_config, name, safe) != safe
    ]
    if changed:
        raise RuntimeError(
            f"torch._dynamo.config {', '.join(changed)}: compiling during FX tracing produced degraded "
            "kernels in the incident; something in this process changed it; refusing to train"
        )


def enter_steady_state() -> None:
    """From here on a recompile raises (`fail_on_recompile`); wrap steps in `recompile_errors()`."""
    torch.compiler.set_stance("fail_on_recompile")


@contextlib.contextmanager
def steady_state() -> Iterator[None]:
    """A recompile inside raises a one-line `RecompileError`; the default stance after."""
    enter_steady_state()
    try:
        with recompile_errors():
            yield
    finally:
        torch.compiler.set_stance("default")


def eagerly() -> contextlib.AbstractContextManager[None]:
    """Every torch.compile'd function runs eagerly inside (a context, or a decorator): where shapes
    change every call (decoding, eval), a training run's compiled modules would otherwise compile
    again for each, which after warm-up is an error."""
    return torch.compiler.set_stance("force_eager")


@contextlib.contextmanager
def recompile_errors() -> Iterator[None]:
    """Turn dynamo's multi-line fail_on_recompile error into a one-line RecompileError with the reason."""
    try:
        yield
    except RuntimeError as error:
        if RECOMPILE_MESSAGE not in str(error):
            raise
        raise RecompileError(describe_recompile(str(error))) from None


def describe_recompile(message: str) -> str:
    """`function (file:line): guard failure` from dynamo's fail_on_recompile message."""
    where = re.search(r"filename: '([^']*)', function name: '([^']*)', line number: (\d+)", message)
    location = f"{where.group(2)} ({where.group(1)}:{where.group(3)})" if where else "a compiled function"
    reasons = [line.strip()[2:] for line in message.splitlines() if line.strip().startswith("- ")]
    reason = "; ".join(reasons) if reasons else "it had not been compiled during warm-up"
    return (
        f"recompile after warm-up in {location}: {reason}. Steady-state shapes and dtypes must not change "
        "(compile.fail_on_recompile = false lets the run continue, recompiling)"
    )


def baseline_step_time(measured: dict[str, Any], config: RunConfig) -> float | None:
    """Seconds per optimizer step this run should reach, from a manifest's `measured` section.

    A colocated rank also runs the target forward in every step. In a split topology a step takes
    one batch per drafter rank and the target ranks make `target_ranks` batches per forward time,
    so the step can go no faster than its slower stage: the drafter step, or
    `drafter_ranks / target_ranks` target forwards (1 target + 1 drafter is target-bound).
    """
    drafter = measured.get("drafter_step_s")
    if not drafter:
        return None
    target = measured.get("target_forward_s") or 0.0
    topology = config.topology
    if topology.target_ranks == 0:
        return drafter + target
    return max(drafter, target * topology.drafter_ranks / topology.target_ranks)
