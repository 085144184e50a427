"""`dflash eval SOURCE`: acceptance length tau of a trained drafter, by speculative decoding."""

from __future__ import annotations

from typing import Annotated

import typer


def evaluate(
    source: Annotated[
        str, typer.Argument(help="Run directory (its latest good checkpoint) or one checkpoint directory.")
    ],
    prompts: Annotated[
        int | None, typer.Option("--prompts", min=1, help="Prompts to decode (default: train.eval_prompts).")
    ] = None,
    max_new_tokens: Annotated[
        int | None,
        typer.Option(
            "--max-new-tokens", min=1, help="Tokens per prompt (default: train.eval_max_new_tokens)."
        ),
    ] = None,
    data: Annotated[
        str | None,
        typer.Option(
            "--data",
            help="Conversation file (.jsonl/.json/.parquet, OpenAI or ShareGPT); the turns before each first "
            "reply are the prompts. Default: the run's held-out records.",
        ),
    ] = None,
) -> None:
    """Speculative-decode held-out prompts with the target and the drafter; print tau and the histogram."""
    from app.evaluate.trained import evaluate_trained  # heavy imports only for this command

    evaluation = evaluate_trained(source, prompts=prompts, max_new_tokens=max_new_tokens, data=data)
    for line in evaluation.describe():
        print(line, flush=True)
