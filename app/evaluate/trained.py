"""tau of a trained drafter, from a run directory (its latest good checkpoint) or one checkpoint: what
`dflash eval` prints and `app.api.evaluate` returns.

The prompts are `data` (a conversation file) when given, else the run's `data.eval_files`, else the
records it held out of its training files: the same ones the periodic eval of the run measured.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.config import require_builtin_packages
from app.data.dataset import load_tokenized, load_training_data
from app.errors import UserError
from app.evaluate.evaluator import Evaluator
from app.evaluate.lossless import LosslessCheck
from app.evaluate.predictability import describe_predictability
from app.evaluate.prompts import prompts_from_dataset, prompts_from_file
from app.evaluate.speculative import EvalResult
from app.export import load_trained_drafter
from app.model.loading import load_tokenizer, pick_device
from app.model.target import load_target


@dataclass
class TrainedEvaluation:
    """One checkpoint's tau on a set of prompts."""

    step: int
    checkpoint: Path
    device: str
    result: EvalResult
    predictability: dict[str, dict[str, Any]]
    """How sure the target is of its own answers' tokens, per domain (`app.evaluate.predictability`)."""
    lossless: LosslessCheck | None = None
    """With `check_lossless`: the decodes against the target's plain greedy decode."""

    @property
    def tau(self) -> float:
        return self.result.tau

    def describe(self) -> list[str]:
        header = f"eval: step {self.step} ({self.checkpoint}) on {self.device}, {len(self.result.per_prompt)} prompts"
        lossless = [self.lossless.describe()] if self.lossless else []
        return [header, *self.result.describe(), *describe_predictability(self.predictability), *lossless]


def evaluate_trained(
    source: str | Path,
    *,
    prompts: int | None = None,
    max_new_tokens: int | None = None,
    data: str | Path | None = None,
    tree_budgets: Sequence[int] | None = None,
    tree_top_k: int | None = None,
    check_lossless: bool = False,
    progress: Callable[[str], None] | None = None,
) -> TrainedEvaluation:
    """Speculative-decode `prompts` prompts (default `train.eval_prompts`) of up to `max_new_tokens`
    tokens (default `train.eval_max_new_tokens`) with the run's target and `source`'s drafter; tree
    tau at each of `tree_budgets` with `tree_top_k` tokens per depth (defaults: the run's
    `train.eval_tree_budget` and `train.eval_tree_top_k`); `check_lossless` also compares the decodes
    with the target's plain greedy decode (`app.evaluate.lossless`); `progress` hears how it goes."""
    trained = load_trained_drafter(source)
    config = trained.config
    require_builtin_packages(config.target.builtin)  # before the tokenizer, data or target load
    count = prompts or config.train.eval_prompts
    tokenizer = load_tokenizer(config)
    if data is not None:
        chosen = prompts_from_file(str(data), tokenizer, count, config.data.chat_template_kwargs)
    elif config.data.eval_files:
        held_out = load_tokenized(config.data.eval_files, config.data, tokenizer, min_supervised_tokens=1)
        chosen = prompts_from_dataset(held_out, count)
    elif config.data.train_files:
        chosen = prompts_from_dataset(load_training_data(config, tokenizer)[1], count)
    else:
        raise UserError(
            "eval: no prompts: pass --data FILE or set data.eval_files / data.train_files in the run config"
        )
    device = pick_device(config.train.device)
    target = load_target(config, device)
    evaluator = Evaluator(
        config,
        target,
        tokenizer,
        chosen.ids,
        max_new_tokens,
        tree_budgets,
        tree_top_k,
        domains=chosen.domains,
        progress=progress,
    )
    drafter = trained.build(target, device)
    result = evaluator(drafter)
    lossless = evaluator.check_lossless(drafter, result) if check_lossless else None
    return TrainedEvaluation(
        trained.step, trained.checkpoint, str(device), result, evaluator.predictability, lossless
    )
