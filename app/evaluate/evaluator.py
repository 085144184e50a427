"""The one evaluator: periodic eval in the trainer, `dflash eval` and the demo all measure tau here.

It fixes what makes two tau figures of one checkpoint comparable: the prompts, the token budget, the
stop rule (the tokenizer's end token and every end token of the target's generation config, as a
serving engine stops) and the precision (the drafter under bf16 autocast on CUDA when it trained so).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from app.compile.guard import eagerly
from app.config import RunConfig
from app.errors import UserError
from app.evaluate.lossless import LosslessCheck, check_lossless
from app.evaluate.predictability import answer_predictability
from app.evaluate.replay import evaluate_replay
from app.evaluate.result import EvalResult
from app.generate.build import greedy_decoder
from app.generate.step import DecodeShape
from app.model.drafter import DFlashDrafter
from app.model.loading import stop_token_ids
from app.model.target import TargetModel

DECODE_ROWS = 128
"""Prompts the target answers together when eval decodes (one batch of a typical eval set)."""


class Evaluator:
    """A drafter's tau on fixed prompts: the target's greedy answers are decoded once, on the first
    call, and every call replays the speculative rounds over them (`app.evaluate.replay`)."""

    def __init__(
        self,
        config: RunConfig,
        target: TargetModel,
        tokenizer: PreTrainedTokenizerBase,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | None = None,
        tree_budgets: Sequence[int] | None = None,
        tree_top_k: int | None = None,
        *,
        domains: Sequence[str] | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        """None: the config's `train.eval_max_new_tokens`, `[train.eval_tree_budget]` (none when 0)
        and `train.eval_tree_top_k`. `domains`: each prompt's, for the per-domain table; `progress`
        hears how the decode and the replay go (eval of many prompts takes a while)."""
        if not prompts:
            raise UserError("eval: no prompts to evaluate")
        if domains is not None and len(domains) != len(prompts):
            raise ValueError(f"eval: {len(domains)} domains for {len(prompts)} prompts")
        self.target = target
        self.prompts = [list(prompt) for prompt in prompts]
        self.domains = list(domains) if domains is not None else None
        self.max_new_tokens = max_new_tokens or config.train.eval_max_new_tokens
        self.stop_token_ids = stop_token_ids(tokenizer, target)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        budget = config.train.eval_tree_budget
        self.tree_budgets = list(tree_budgets if tree_budgets is not None else [budget] if budget else [])
        self.tree_top_k = tree_top_k or config.train.eval_tree_top_k
        bf16 = target.device.type == "cuda" and config.train.precision == "bf16"
        self.autocast_dtype = torch.bfloat16 if bf16 else None
        self.progress = progress

    @functools.cached_property
    def answers(self) -> list[list[int]]:
        """The target's greedy answer to each prompt, cut at the token budget and the first stop
        token: what every speculative decode of it emits, whatever the drafter."""
        started = time.monotonic()
        shape = DecodeShape(
            rows=min(DECODE_ROWS, len(self.prompts)),
            max_prompt_tokens=max(map(len, self.prompts)),
            max_new_tokens=self.max_new_tokens,
        )
        self._report(
            f"eval: the target answers {len(self.prompts)} prompts (up to {self.max_new_tokens} tokens each)"
        )
        decoder = greedy_decoder(self.target.model, shape, self.stop_token_ids, self.pad_token_id)
        answers = decoder.decode(self.prompts)
        seconds = time.monotonic() - started
        tokens = sum(map(len, answers))
        self._report(
            f"eval: {tokens} answer tokens in {seconds:.1f}s ({tokens / max(seconds, 1e-9):.0f} tok/s)"
        )
        return answers

    @functools.cached_property
    def predictability(self) -> dict[str, dict[str, Any]]:
        """How sure the target is of its own answers' tokens, per domain (`app.evaluate.predictability`):
        what bounds every drafter's acceptance on these prompts."""
        with eagerly():  # see `decoding`
            return answer_predictability(
                self.target, self.prompts, self.answers, self.domains, self.autocast_dtype
            )

    def __call__(self, drafter: DFlashDrafter) -> EvalResult:
        """Chain tau of `drafter` and tree tau at each budget, per depth and per domain."""
        answers = self.answers
        with decoding(drafter):
            return evaluate_replay(
                self.target,
                drafter,
                self.prompts,
                answers,
                self.tree_budgets,
                self.tree_top_k,
                self.autocast_dtype,
                self.domains,
                self.progress,
            )

    def check_lossless(self, drafter: DFlashDrafter, result: EvalResult) -> LosslessCheck:
        """`result` (this evaluator's replay with `drafter`) against the real speculative loop and the
        target's plain greedy decode (`app.evaluate.lossless`)."""
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

    def _report(self, message: str) -> None:
        if self.progress is not None:
            self.progress(message)


@contextlib.contextmanager
def decoding(drafter: DFlashDrafter) -> Iterator[None]:
    """The drafter in eval mode (its training mode restored after) and every torch.compile'd function
    run eagerly: decoding's shapes change every round, and a training run's compiled modules (the
    target's norms, MLPs and RoPE, `app.compile.apply.compile_target`) would otherwise recompile for them,
    which after warm-up is an error."""
    was_training = drafter.training
    drafter.eval()
    try:
        with eagerly():
            yield
    finally:
        drafter.train(was_training)
