"""The compile-cache key: everything that decides whether compiled kernels can be reused.

A cache built for one GPU model, torch/CUDA/triton build, inductor setting, shape or model source is
useless (or worse, silently recompiled) on another, so all of them go into the key. The fields are a
flat `{"group.name": value}` mapping so that a mismatch can be shown field by field; the key itself
is a readable GPU prefix plus a hash of every field.

Groups: `machine.*` (GPU, compute capability, torch, CUDA, triton, python), `inductor.*` (settings
that change generated code), `shape.*` (the run's static shapes and dtypes), `code.*` (hash of the
compiled model sources and of uv.lock). The doctor compares the first, second and last groups
without a config, all four with one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import platform
import re
from importlib import metadata
from pathlib import Path
from typing import Any

from app.config.schema import RunConfig
from app.data.shapes import TargetShapes

KeyFields = dict[str, Any]

MACHINE_GROUPS = ("machine.", "inductor.", "code.")
"""Field groups that depend on the machine and the installed code only (no run config needed)."""

INDUCTOR_SETTINGS = (
    "max_autotune",
    "max_autotune_gemm",
    "max_autotune_pointwise",
    "max_autotune_gemm_backends",
    "coordinate_descent_tuning",
    "epilogue_fusion",
    "aggressive_fusion",
    "freezing",
    "fallback_random",
    "cpp_wrapper",
    "triton.cudagraphs",
    "triton.cooperative_reductions",
    "fx_graph_cache",
    "autotune_local_cache",
    "bundle_triton_into_fx_graph_cache",
    "force_disable_caches",
)
"""torch._inductor.config settings that change the generated kernels or whether caches are used."""

COMPILED_SOURCES = (
    "app.model.attention",
    "app.model.drafter",
    "app.model.objective",
    "app.model.ce_kernel",
    "app.compile.apply",
    "app.model.gated_deltanet",
)
"""Modules whose functions torch.compile traces, or that decide what it traces and how (the target's
modules and their flattened inputs), or which shapes the baked library kernels are built for (the
hybrid target's q, k and v as flash-linear-attention's kernels get them), or the drafter's own
Triton kernel that the entry bakes: an edit there changes the entry's contents."""

KEY_HASH_CHARS = 16


def cache_key(fields: KeyFields) -> str:
    """`<gpu-slug>-sm<cc>-<hash of all fields>`, e.g. `nvidia-h200-sm90-3f2a...`."""
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()
    gpu = re.sub(r"[^a-z0-9]+", "-", str(fields.get("machine.gpu", "unknown")).lower()).strip("-")
    capability = str(fields.get("machine.compute_capability") or "").replace(".", "")
    prefix = f"{gpu}-sm{capability}" if capability else gpu
    return f"{prefix}-{digest[:KEY_HASH_CHARS]}"


def key_fields(config: RunConfig, arch: Any, device: Any) -> KeyFields:
    """All key fields of a run: this machine and code, plus the config's shapes (`arch`: a DrafterArch)."""
    return {**machine_fields(device), **inductor_fields(), **shape_fields(config, arch), **code_fields()}


def machine_key_fields(device: Any) -> KeyFields:
    """The fields that need no run config (what `dflash doctor` compares without --config)."""
    return {**machine_fields(device), **inductor_fields(), **code_fields()}


def machine_fields(device: Any) -> KeyFields:
    """GPU model and capability (by name: an H100 cache misses on an H200), torch + CUDA, triton, python."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        gpu, capability = torch.cuda.get_device_name(index), f"{major}.{minor}"
    else:
        gpu, capability = device.type, None
    return {
        "machine.gpu": gpu,
        "machine.compute_capability": capability,
        "machine.torch": torch.__version__,
        "machine.cuda": torch.version.cuda,
        "machine.triton": _version("triton") or _version("pytorch-triton"),
        "machine.python": ".".join(platform.python_version_tuple()[:2]),
    }


def inductor_fields() -> KeyFields:
    from torch._inductor import config as inductor_config

    fields = {}
    for name in INDUCTOR_SETTINGS:
        value: Any = inductor_config
        for part in name.split("."):
            value = getattr(value, part, None)
        fields[f"inductor.{name}"] = (
            value if isinstance(value, bool | int | float | str | None) else str(value)
        )
    return fields


def shape_fields(config: RunConfig, arch: Any) -> KeyFields:
    """The static shapes and dtypes every compiled graph is specialised on (dynamic=False)."""
    return {
        "shape.token_budget": config.data.token_budget,
        "shape.anchors": config.train.anchors,
        "shape.block_size": arch.block_size,
        "shape.loss_chunk_size": config.train.loss_chunk_size,
        "shape.precision": config.train.precision,
        "shape.target_dtype": config.target.dtype,
        "shape.hidden_size": arch.hidden_size,
        "shape.num_layers": arch.num_layers,
        "shape.num_attention_heads": arch.num_attention_heads,
        "shape.num_key_value_heads": arch.num_key_value_heads,
        "shape.head_dim": arch.head_dim,
        "shape.intermediate_size": arch.intermediate_size,
        "shape.num_target_features": arch.num_features,
        "shape.vocab_size": arch.vocab_size,
        "shape.sliding_window": arch.sliding_window,
        "shape.sliding_window_layers": list(arch.sliding_window_layers),
        "shape.target_model_type": _target_model_type(config),
        # The target's batch shapes: what the baked library Triton kernels and autotuning cover.
        "shape.target_batches": [list(shape) for shape in TargetShapes.from_config(config.data).all],
    }


def code_fields() -> KeyFields:
    """Hashes of the compiled model sources and of uv.lock (None where the lock is not found)."""
    from app.atomic import file_sha256
    from app.env.project import find_project_root

    digest = hashlib.sha256()
    for module in COMPILED_SOURCES:
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            raise RuntimeError(f"compile cache key: cannot locate the source of {module}")
        digest.update(module.encode() + b"\0" + Path(spec.origin).read_bytes() + b"\0")
    root = find_project_root()
    lock = root / "uv.lock" if root is not None else None
    return {
        "code.model_sources": digest.hexdigest()[:KEY_HASH_CHARS],
        "code.uv_lock": file_sha256(lock)[:KEY_HASH_CHARS] if lock is not None and lock.is_file() else None,
    }


def diff_fields(expected: KeyFields, found: KeyFields, groups: tuple[str, ...] | None = None) -> list[str]:
    """Fields (restricted to `groups` prefixes) whose values differ, as `name: found != expected` lines."""
    names = sorted(set(expected) | set(found))
    if groups is not None:
        names = [name for name in names if name.startswith(groups)]
    return [
        f"{name}: {_shown(found.get(name))} (this run: {_shown(expected.get(name))})"
        for name in names
        if expected.get(name) != found.get(name)
    ]


def _target_model_type(config: RunConfig) -> str | None:
    from app.config import target_architecture, text_architecture

    architecture = target_architecture(config.target)
    if architecture is None:
        return None
    return text_architecture(architecture).get("model_type") or architecture.get("model_type")


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _shown(value: Any) -> str:
    return "(absent)" if value is None else str(value)
