"""A trained drafter, from a run directory (its latest good checkpoint) or one checkpoint, written as the
HF DFlash directory the serving engines load, with the commands that serve the target with it: what
`dflash export` prints and `app.api.export` returns. No target weights load: its config and its
tokenizer (which names the mask token, `dflash_config.mask_token`) are enough.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from app.errors import UserError
from app.export.hf_dflash import CONFIG_FILE, ExportDtype, export_drafter, serving_commands
from app.export.source import load_trained_drafter
from app.model.target import target_text_config

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from app.config import RunConfig


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
    mask_token: str
    """The mask token's string in the target's tokenizer (`dflash_config.mask_token`)."""
    target_layer_ids: list[int]
    serving: list[str]
    """SGLang's and vLLM's command lines that serve the target with this drafter."""
    config: RunConfig
    """The run's config (its `storage` says where `--upload` puts the export)."""

    def describe(self) -> list[str]:
        return [
            f"exported step {self.step} ({self.checkpoint}) to {self.directory} as {self.dtype}: "
            f"{self.parameters / 1e6:.2f}M parameters, block_size {self.block_size}, "
            f"mask_token_id {self.mask_token_id} ({self.mask_token!r}), target_layer_ids {self.target_layer_ids}",
            "serve the target with this drafter:",
            *(f"  {line}" for line in self.serving),
        ]


def export_trained(source: str | Path, out: str | Path, dtype: ExportDtype = "bf16") -> TrainedExport:
    """Write `source`'s drafter to `out` (an earlier export there is replaced) in `dtype`."""
    trained = load_trained_drafter(source)
    target = target_text_config(trained.config.target)
    drafter = trained.build(target)
    tokenizer = _target_tokenizer(trained.config)
    directory = export_drafter(drafter, out, target, dtype, tokenizer=tokenizer)
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
        mask_token=json.loads((directory / CONFIG_FILE).read_text())["dflash_config"]["mask_token"],
        target_layer_ids=list(arch.target_layer_ids),
        serving=serving_commands(served, directory.resolve(), arch.block_size),
        config=trained.config,
    )


def _target_tokenizer(config: RunConfig) -> PreTrainedTokenizerBase:
    """The run's target tokenizer, as training loaded it (`target.tokenizer`, `target.path` or the
    built-in target's directory). Without it the export cannot name the mask token, and a config
    without `dflash_config.mask_token` is not written: the error names what is missing."""
    from app.model.loading import load_tokenizer

    try:
        return load_tokenizer(config)
    except UserError as error:
        raise UserError(f"export: dflash_config.mask_token needs the target's tokenizer: {error}") from None
