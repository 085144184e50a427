"""Environment variables that decide how torch compiles and launches kernels.

They never show in the package list, yet `TORCHDYNAMO_DISABLE=1` left in a shell profile runs every
kernel eager and `TORCHINDUCTOR_FORCE_DISABLE_CACHES=1` makes every start ignore the baked compile
cache; `TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1` changes the numerics of every fp32 matmul. The fingerprint
records every variable of these families; the ones in `DEGRADING` are problems a run refuses to start
with, and a change of one in `NUMERICS` is a breaking difference at resume.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

RECORDED_PREFIXES = (
    "TORCHDYNAMO_",
    "TORCHINDUCTOR_",
    "TORCH_COMPILE_",
    "TRITON_",
    "PYTORCH_",
    "TORCH_CUDNN_",
)
NUMERICS = (
    "NVIDIA_TF32_OVERRIDE", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "CUBLAS_WORKSPACE_CONFIG",
    "TORCH_BLAS_PREFER_CUBLASLT", "TORCH_BLAS_PREFER_HIPBLASLT", "NCCL_ALGO", "NCCL_PROTO",
)  # fmt: skip
"""Variables that change numerics (which matmul precision and kernels run, the order a reduction sums
in): any change of one between two starts of a run is a breaking difference."""
NUMERICS_WHY = "changes the numerics: matmul precision, the kernels chosen or a reduction's order"
RECORDED_NAMES = (
    "TORCH_LOGS", "TORCH_CACHING_PRECOMPILE", "TORCH_STRICT_PRECOMPILE", "CUDA_LAUNCH_BLOCKING", *NUMERICS,
)  # fmt: skip
_FALSE = {"", "0", "false", "no", "off"}


@dataclass(frozen=True)
class DegradingFlag:
    name: str
    degrades_when: Literal["set", "off"]
    """"set": any true value degrades (a switch that disables or slows); "off": turning it off does."""
    why: str

    def degrades(self, value: str) -> bool:
        off = value.strip().lower() in _FALSE
        return off if self.degrades_when == "off" else not off


DEGRADING = {
    flag.name: flag
    for flag in (
        DegradingFlag("TORCHDYNAMO_DISABLE", "set", "torch.compile is disabled: every kernel runs eager"),
        DegradingFlag("TORCH_COMPILE_DISABLE", "set", "torch.compile is disabled: every kernel runs eager"),
        DegradingFlag("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "set",
                      "inductor ignores every cache: the baked compile cache is unused, each start compiles"),
        DegradingFlag("TORCHINDUCTOR_FX_GRAPH_CACHE", "off", "the FX graph cache is off: the baked cache is unused"),
        DegradingFlag("TORCHINDUCTOR_AUTOGRAD_CACHE", "off", "the autograd cache is off: the baked cache is unused"),
        DegradingFlag("TORCHINDUCTOR_MAX_AUTOTUNE", "set",
                      "other kernels than the baked ones, after minutes of autotuning at start"),
        DegradingFlag("TORCHINDUCTOR_MAX_AUTOTUNE_GEMM", "set", "other matmul kernels than the baked ones"),
        DegradingFlag("TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE", "set", "other pointwise kernels than the baked ones"),
        DegradingFlag("TORCH_COMPILE_DEBUG", "set", "every compile writes debug traces"),
        DegradingFlag("TORCH_CACHING_PRECOMPILE", "set",
                      "Dynamo's experimental precompile: on torch 2.11 every warm start from its cache failed in Dynamo"),
        DegradingFlag("TRITON_INTERPRET", "set", "Triton kernels run in the Python interpreter"),
        DegradingFlag("CUDA_LAUNCH_BLOCKING", "set", "every kernel launch waits for the GPU"),
        DegradingFlag("PYTORCH_NO_CUDA_MEMORY_CACHING", "set", "no caching allocator: a cudaMalloc per tensor"),
    )
}  # fmt: skip


def recorded_compiler_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every compiler and launch variable set in `environ` (default: this process), sorted by name."""
    environ = os.environ if environ is None else environ
    return {
        name: environ[name]
        for name in sorted(environ)
        if name.startswith(RECORDED_PREFIXES) or name in RECORDED_NAMES
    }


def degrading_flags(recorded: Mapping[str, str]) -> list[tuple[DegradingFlag, str]]:
    """The recorded variables whose value disables or degrades compilation, with their values."""
    return [
        (DEGRADING[name], value)
        for name, value in recorded.items()
        if name in DEGRADING and DEGRADING[name].degrades(value)
    ]
