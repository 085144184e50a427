"""The one evaluator: periodic eval in the trainer, `dflash eval` and the demo all measure tau here.

It fixes what makes two tau figures of one checkpoint comparable: the prompts, the token budget, the
stop rule (the tokenizer's end token and every end token of the target's generation config, as a
serving engine stops) and the precision (the drafter under bf16 autocast on CUDA when it trained so).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from app.config import RunConfig
from app.errors import UserError
from app.evaluate.lossless import LosslessCheck, check_lossless
from app.evaluate.speculative import EvalResult, evaluate_tau
from app.evaluate.tree import evaluate_trees
from app.model.drafter import DFlashDrafter
from app.model.target import TargetModel


class Evaluator:
    """Greedy speculative decoding of fixed prompts with the target, measuring a drafter's tau."""

    def __init__(
        self,
        config: RunConfig,
        target: TargetModel,
        tokenizer: PreTrainedTokenizerBase,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | None = None,
        tree_budgets: Sequence[int] | None = None,
        tree_top_k: int | None = None,
    ) -> None:
        """None: the config's `train.eval_max_new_tokens`, `[train.eval_tree_budget]` (none when 0)
        and `train.eval_tree_top_k`."""
        if not prompts:
            raise UserError("eval: no prompts to evaluate")
        self.target = target
        self.prompts = [list(prompt) for prompt in prompts]
        self.max_new_tokens = max_new_tokens or config.train.eval_max_new_tokens
        self.stop_token_ids = stop_token_ids(tokenizer, target)
        budget = config.train.eval_tree_budget
        self.tree_budgets = list(tree_budgets if tree_budgets is not None else [budget] if budget else [])
        self.tree_top_k = tree_top_k or config.train.eval_tree_top_k
        bf16 = target.device.type == "cuda" and config.train.precision == "bf16"
        self.autocast_dtype = torch.bfloat16 if bf16 else None

    def __call__(self, drafter: DFlashDrafter) -> EvalResult:
        """Chain tau of `drafter` and tree tau at each budget."""
        with decoding(drafter):
            result = evaluate_tau(
                self.target,
                drafter,
                self.prompts,
                self.max_new_tokens,
                eos_token_id=self.stop_token_ids,
                autocast_dtype=self.autocast_dtype,
            )
            result.trees = evaluate_trees(
                self.target,
                drafter,
                self.prompts,
                result,
                self.tree_budgets,
                self.tree_top_k,
                self.autocast_dtype,
            )
            return result

    def check_lossless(self, drafter: DFlashDrafter, result: EvalResult) -> LosslessCheck:
        """`result` (this evaluator's decodes with `drafter`) against the target's plain greedy decode."""
        with decoding(drafter):
            return check_lossless(
                self.target,
                drafter,
                self.prompts,
                result,
                self.max_new_tokens,
                self.stop_token_ids,
                self.autocast_dtype,
            )


@contextlib.contextmanager
def decoding(drafter: DFlashDrafter) -> Iterator[None]:
    """The drafter in eval mode (its training mode restored after) and every torch.compile'd function
    run eagerly: decoding's shapes change every round, and a training run's compiled modules (the
    target's norms, MLPs and RoPE, `app.compile.apply.compile_target`) would otherwise recompile for them,
    which after warm-up is an error."""
    was_training = drafter.training
    drafter.eval()
    try:
        with torch.compiler.set_stance("force_eager"):
            yield
    finally:
        drafter.train(was_training)


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, target: TargetModel) -> list[int]:
    """The tokenizer's end-of-sequence token and the target's generation-config ones."""
    stops: set[int] = set()
    if tokenizer.eos_token_id is not None:
        stops.add(tokenizer.eos_token_id)
    configured = getattr(target.model.generation_config, "eos_token_id", None)
    if configured is not None:
        stops.update([configured] if isinstance(configured, int) else configured)
    return sorted(stops)
