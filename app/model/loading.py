"""What every command that runs the target starts from besides the model: the device, the target's
tokenizer and its stop tokens. Here, below train, eval, export and datagen, so that none of them
imports another for these.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from app.config import RunConfig
from app.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from app.model.target import TargetModel


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device: cuda requested but no CUDA device is visible")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def tokenizer_dir(config: RunConfig) -> Path:
    """The target tokenizer's directory: `target.tokenizer`, else the target's own. A `target.path` that
    is not here is refused first, also beside a `target.tokenizer`: before any data is tokenized."""
    from app.model.target import local_directory

    target = config.target
    if target.path is not None:
        local_directory(target.path, "target.path", "a local Hugging Face model directory")
    if target.tokenizer is not None:
        return local_directory(target.tokenizer, "target.tokenizer", "a local tokenizer directory")
    if target.path is not None:
        return Path(target.path)
    if target.builtin is not None:
        from app.model.builtin import builtin_target_dir

        return builtin_target_dir(target.builtin)
    raise UserError(
        "target.tokenizer: required with target.architecture (a random-weight target has no tokenizer)"
    )


def load_tokenizer(config: RunConfig) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    directory = tokenizer_dir(config)
    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as error:
        raise UserError(f"{directory}: cannot load a tokenizer ({str(error).splitlines()[0]})") from None


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, target: TargetModel) -> list[int]:
    """The tokenizer's end-of-sequence token and the target's generation-config ones."""
    stops: set[int] = set()
    if tokenizer.eos_token_id is not None:
        stops.add(tokenizer.eos_token_id)
    configured = getattr(target.model.generation_config, "eos_token_id", None)
    if configured is not None:
        stops.update([configured] if isinstance(configured, int) else configured)
    return sorted(stops)
