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
from app.errors import UserError
from app.evaluate.evaluator import Evaluator
from app.evaluate.lossless import LosslessCheck
from app.evaluate.predictability import describe_predictability
from app.evaluate.prompts import prompts_from_dataset, prompts_from_file
from app.evaluate.speculative import EvalResult
from app.export import load_trained_drafter
from app.model.target import load_target
from app.pipeline.inputs import load_run_inputs


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
    if data is None and not (config.data.eval_files or config.data.train_files):
        raise UserError(
            "eval: no prompts: pass --data FILE or set data.eval_files / data.train_files in the run config"
        )
    # The target loads after the prompts are chosen: a --data file that holds none is refused first.
    inputs = load_run_inputs(config, data="none" if data is not None else "eval", with_target=False)
    count = prompts or config.train.eval_prompts
    if data is not None:
        chosen = prompts_from_file(str(data), inputs.tokenizer, count, config.data.chat_template_kwargs)
    else:
        assert inputs.eval_data is not None
        chosen = prompts_from_dataset(inputs.eval_data, count)
    device, tokenizer = inputs.device, inputs.tokenizer
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
