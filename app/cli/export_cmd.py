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
    from app.export.trained import export_trained  # torch loads only for this command

    for line in export_trained(source, out, dtype.value).describe():
        print(line)
