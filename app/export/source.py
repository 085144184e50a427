"""A trained drafter from a run directory (its latest good checkpoint) or from one checkpoint directory.

A run directory holds `config.json` (the resolved run config the trainer wrote) and `checkpoints/`;
a checkpoint directory is one `checkpoints/step_*/` of a run, whose run directory is two levels up.
The drafter's shape is rebuilt from the run config and the target's config (no target weights
are loaded), and the checkpoint's weights must fit it exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import PretrainedConfig

from app.checkpoint.store import MANIFEST, checkpoint_root, load_latest_checkpoint, verify_checkpoint
from app.config import RunConfig, validate_config
from app.errors import UserError
from app.model.drafter import DFlashDrafter, DrafterArch
from app.model.target import TargetModel

RUN_CONFIG = "config.json"


@dataclass
class TrainedDrafter:
    """A checkpoint's drafter weights and the run config that trained them."""

    config: RunConfig
    checkpoint: Path
    step: int
    model_state: dict[str, torch.Tensor]

    def build(
        self, target: TargetModel | PretrainedConfig | None = None, device: torch.device | str = "cpu"
    ) -> DFlashDrafter:
        """The drafter with these weights (fp32) on `device`; `target` as for `DrafterArch.from_config`."""
        with torch.device("meta"):
            drafter = DFlashDrafter(DrafterArch.from_config(self.config, target))
        expected, found = set(drafter.state_dict()), set(self.model_state)
        if expected != found:
            raise UserError(
                f"{self.checkpoint}: weights do not match the run config's drafter: missing "
                f"{sorted(expected - found)[:5]}, unexpected {sorted(found - expected)[:5]}"
            )
        try:
            drafter.load_state_dict(self.model_state, assign=True)
        except RuntimeError as error:
            raise UserError(
                f"{self.checkpoint}: weights do not fit the run config's drafter ({str(error).splitlines()[-1].strip()})"
            ) from None
        return drafter.to(device=device, dtype=torch.float32)


def load_trained_drafter(source: str | Path) -> TrainedDrafter:
    """The drafter of a run directory's latest good checkpoint, or of one checkpoint directory."""
    source = Path(source)
    if (source / MANIFEST).is_file():
        return _from_checkpoint_dir(source)
    if (source / RUN_CONFIG).is_file() or checkpoint_root(source).is_dir():
        config = _run_config(source)
        checkpoint = load_latest_checkpoint(source)
        if checkpoint is None:
            raise UserError(f"{source}: no complete checkpoint under {checkpoint_root(source)}")
        return TrainedDrafter(config, checkpoint.path, checkpoint.step, checkpoint.model_state)
    raise UserError(
        f"{source}: expected a run directory (config.json + checkpoints/) or a checkpoint directory "
        "(checkpoints/step_*/ with manifest.json)"
    )


def _from_checkpoint_dir(path: Path) -> TrainedDrafter:
    problem = verify_checkpoint(path)
    if problem is not None:
        raise UserError(f"{path}: damaged checkpoint: {problem}")
    config = _run_config(path.parent.parent)
    state = _read_json(path / "state.json")
    try:
        model_state = load_file(path / "model.safetensors")
    except (SafetensorError, OSError) as error:
        raise UserError(f"{path / 'model.safetensors'}: not readable ({error})") from None
    return TrainedDrafter(config, path, int(state["step"]), model_state)


def _run_config(run_dir: Path) -> RunConfig:
    path = run_dir / RUN_CONFIG
    if not path.is_file():
        raise UserError(
            f"{run_dir}: no {RUN_CONFIG} (the run config the trainer writes next to checkpoints/)"
        )
    raw = _read_json(path)
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a JSON object (the resolved run config)")
    return validate_config(raw, source=str(path))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise UserError(f"{path}: not readable JSON ({error})") from None
