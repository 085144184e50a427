"""What a process of a run starts from before any drafter exists, set up in one place for both training
roles (`app.train.ranks`) and `dflash eval` (`app.evaluate.trained`): the device, the fast-kernel check
where the target runs, the target's tokenizer, the tokenized data (once per node under torchrun) and
the frozen target.

Here, below evaluate and train, so that neither imports the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from app.config import RunConfig
from app.data.dataset import TokenizedDataset, load_tokenized, load_training_data
from app.errors import UserError
from app.model.loading import load_tokenizer, pick_device

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from app.model.target import TargetModel
    from app.pipeline.distributed import Runtime

Data = Literal["run", "eval", "none"]


@dataclass
class RunInputs:
    """A process's device, tokenizer, data and target; what the process does not need is None."""

    device: torch.device
    tokenizer: PreTrainedTokenizerBase
    train_data: TokenizedDataset | None
    eval_data: TokenizedDataset | None
    target: TargetModel | None
    accepted: list[str] = field(default_factory=list)
    """The slow-kernel line a start records as accepted (`target.allow_slow_kernels`), if any."""


def load_run_inputs(
    config: RunConfig,
    runtime: Runtime | None = None,
    *,
    fingerprint: dict[str, Any] | None = None,
    data: Data = "run",
    with_target: bool = True,
) -> RunInputs:
    """Load in the order that fails cheapest first: the data before the target (an empty dataset is
    refused before any model is built). `runtime` None: the process is the whole run.

    `fingerprint` (the environment check's) refuses a hybrid target without its fast kernels where
    the target runs (`require_fast_kernels`); None skips that check. `data`: "run" the (train, eval)
    data, "eval" only the eval data (the training files are tokenized only to hold records out of
    them), "none" nothing. `with_target`: this process runs the target (a split drafter rank does not).
    """
    device = runtime.device if runtime is not None else pick_device(config.train.device)
    accepted = (
        require_fast_kernels(config, device, fingerprint, runs_target=with_target)
        if fingerprint is not None
        else []
    )
    tokenizer = load_tokenizer(config)
    train_data, eval_data = _load_data(config, tokenizer, runtime, data)
    target = None
    if with_target:
        from app.model.target import load_target

        target = load_target(config, device)
    return RunInputs(device, tokenizer, train_data, eval_data, target, accepted)


def _load_data(
    config: RunConfig, tokenizer: PreTrainedTokenizerBase, runtime: Runtime | None, data: Data
) -> tuple[TokenizedDataset | None, TokenizedDataset | None]:
    if data == "none":
        return None, None
    if data == "eval" and config.data.eval_files:
        return None, load_tokenized(config.data.eval_files, config.data, tokenizer, min_supervised_tokens=1)
    train, held_out = _load_node_data(config, tokenizer, runtime)
    return (train if data == "run" else None), held_out


def _load_node_data(
    config: RunConfig, tokenizer: PreTrainedTokenizerBase, runtime: Runtime | None
) -> tuple[TokenizedDataset, TokenizedDataset]:
    """(train, eval) data. Under torchrun, local rank 0 of each node tokenizes first (the first load of
    a large dataset takes long) and the node's other ranks then read its cache."""
    if runtime is None:
        return load_training_data(config, tokenizer)
    node = f"data/node{runtime.layout.node}"
    if runtime.layout.local_rank == 0:
        data = load_training_data(config, tokenizer)
        runtime.side.mark_ready(node)
        return data
    runtime.side.wait_ready(node, "the node's tokenized data")
    return load_training_data(config, tokenizer)


def require_fast_kernels(
    config: RunConfig, device: torch.device, fingerprint: dict[str, Any], *, runs_target: bool = True
) -> list[str]:
    """On CUDA a hybrid target needs its fast kernels where it runs: refuse without them, or (with
    `target.allow_slow_kernels`) return the line the run's start records as accepted. A split drafter
    rank (`runs_target` False) never runs the target, so its own kernels do not matter."""
    from app.env.guard import fast_kernel_gaps
    from app.model.target import is_hybrid, target_text_config

    if not runs_target or device.type != "cuda" or not is_hybrid(target_text_config(config.target)):
        return []
    gaps = fast_kernel_gaps(fingerprint)
    if not gaps:
        return []
    message = (
        f"target: a hybrid (Gated DeltaNet) target on CUDA without {', '.join(gaps)} runs its linear-attention "
        "layers on transformers' slow reference path; install them with `./uvw sync --group gpu` "
        "or train in the GPU image"
    )
    if not config.target.allow_slow_kernels:
        raise UserError(f"{message}; to train on the slow path anyway, set target.allow_slow_kernels=true")
    return [f"{message} (accepted by target.allow_slow_kernels)"]
