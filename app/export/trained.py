"""A trained drafter, from a run directory (its latest good checkpoint) or one checkpoint, written as the
HF DFlash directory the serving engines load, with the commands that serve the target with it: what
`dflash export` prints and `app.api.export` returns. No target weights load: its config is enough.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from app.export.hf_dflash import ExportDtype, export_drafter, serving_commands
from app.export.source import load_trained_drafter
from app.model.target import target_text_config


@dataclass
class TrainedExport:
    """Where a checkpoint's drafter was exported, and what it is."""

    directory: Path
    step: int
    checkpoint: Path
    dtype: ExportDtype
    parameters: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    serving: list[str]
    """SGLang's and vLLM's command lines that serve the target with this drafter."""

    def describe(self) -> list[str]:
        return [
            f"exported step {self.step} ({self.checkpoint}) to {self.directory} as {self.dtype}: "
            f"{self.parameters / 1e6:.2f}M parameters, block_size {self.block_size}, "
            f"mask_token_id {self.mask_token_id}, target_layer_ids {self.target_layer_ids}",
            "serve the target with this drafter:",
            *(f"  {line}" for line in self.serving),
        ]


def export_trained(source: str | Path, out: str | Path, dtype: ExportDtype = "bf16") -> TrainedExport:
    """Write `source`'s drafter to `out` (an earlier export there is replaced) in `dtype`."""
    trained = load_trained_drafter(source)
    target = target_text_config(trained.config.target)
    drafter = trained.build(target)
    directory = export_drafter(drafter, out, target, dtype)
    arch = drafter.arch
    served = (
        trained.config.target.path or "TARGET_MODEL_DIR"
    )  # a random-weight or built-in target has no path
    return TrainedExport(
        directory=directory,
        step=trained.step,
        checkpoint=trained.checkpoint,
        dtype=dtype,
        parameters=sum(p.numel() for p in drafter.parameters()),
        block_size=arch.block_size,
        mask_token_id=arch.mask_token_id,
        target_layer_ids=list(arch.target_layer_ids),
        serving=serving_commands(served, directory.resolve(), arch.block_size),
    )
