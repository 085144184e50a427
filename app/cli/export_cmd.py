"""`dflash export SOURCE --out DIR [--dtype bf16|fp32]`: a trained drafter as an HF DFlash directory."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import typer


class ExportDtype(StrEnum):
    bf16 = "bf16"
    fp32 = "fp32"


def export(
    source: Annotated[
        str, typer.Argument(help="Run directory (its latest good checkpoint) or one checkpoint directory.")
    ],
    out: Annotated[
        str, typer.Option("--out", help="Directory to write (replaced if it is an earlier export).")
    ],
    dtype: Annotated[
        ExportDtype, typer.Option("--dtype", help="Weight dtype of the export.")
    ] = ExportDtype.bf16,
) -> None:
    """Write config.json + model.safetensors that SGLang (DFLASH) and vLLM (dflash) load as the draft model."""
    from app.export import export_drafter, load_trained_drafter  # torch loads only for this command
    from app.export.hf_dflash import serving_commands
    from app.model.target import target_text_config

    trained = load_trained_drafter(source)
    target = target_text_config(trained.config.target)
    drafter = trained.build(target)
    directory = export_drafter(drafter, out, target, dtype.value)
    arch = drafter.arch
    print(
        f"exported step {trained.step} ({trained.checkpoint}) to {directory} as {dtype.value}: "
        f"{sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters, block_size {arch.block_size}, "
        f"mask_token_id {arch.mask_token_id}, target_layer_ids {list(arch.target_layer_ids)}"
    )
    served = (
        trained.config.target.path or "TARGET_MODEL_DIR"
    )  # a random-weight or built-in target has no path
    print("serve the target with this drafter:")
    for line in serving_commands(served, directory.resolve(), arch.block_size):
        print(f"  {line}")
