"""Eval: speculative decoding with the drafter and its acceptance length tau."""

from app.evaluate.prompts import prompts_from_dataset, prompts_from_file
from app.evaluate.speculative import EvalResult, GenerationResult, evaluate_tau, speculative_generate

__all__ = [
    "EvalResult",
    "GenerationResult",
    "evaluate_tau",
    "prompts_from_dataset",
    "prompts_from_file",
    "speculative_generate",
]
