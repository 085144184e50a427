"""`dflash export SOURCE --out DIR [--dtype bf16|fp32]`: a trained drafter as an HF DFlash directory."""

from __future__ import annotations

import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from app.cli.arguments import require_importable_stack
from app.config.schema import StorageConfig
from app.errors import UserError


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
    upload: Annotated[
        bool,
        typer.Option(
            "--upload", help="Also upload it to the run's storage.s3_uri, under exports/<--out's name>/."
        ),
    ] = False,
) -> None:
    """Write config.json + model.safetensors that SGLang (DFLASH) and vLLM (dflash) load as the draft model."""
    require_importable_stack()
    from app.export.trained import export_trained  # torch loads only for this command

    exported = export_trained(source, out, dtype.value)
    for line in exported.describe():
        print(line)
    if upload:
        _upload(exported.config.storage, exported.directory)


def _upload(storage: StorageConfig, directory: Path) -> None:
    """`directory` to the run's `exports/<its name>/`, waited for: files first, the manifest last."""
    from app.storage import StorageError, upload_export

    if storage.s3_uri is None:
        raise UserError("--upload: the run has no storage.s3_uri to upload to (the export is written)")
    try:
        upload_export(storage, directory)
    except StorageError as error:
        print(f"dflash: error: {error}", file=sys.stderr)
        raise typer.Exit(1) from None
    print(f"uploaded to {storage.s3_uri.rstrip('/')}/exports/{directory.name}/")
