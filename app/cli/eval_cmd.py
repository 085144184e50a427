"""`dflash eval SOURCE`: acceptance length tau of a trained drafter, by speculative decoding: the
chain's and, for each tree budget, DDTree's."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from app.atomic import write_bytes_atomic
from app.cli.arguments import int_list, require_importable_stack


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
    tree_budget: Annotated[
        str | None,
        typer.Option(
            "--tree-budget",
            help="DDTree node budgets, comma-separated (e.g. 16,64,256); 0: the chain only. "
            "Default: train.eval_tree_budget.",
        ),
    ] = None,
    tree_top_k: Annotated[
        int | None,
        typer.Option(
            "--tree-top-k",
            min=1,
            help="Tokens per depth the tree chooses among (default: train.eval_tree_top_k).",
        ),
    ] = None,
    lossless: Annotated[
        bool,
        typer.Option(
            "--check-lossless",
            help="Also decode each prompt plainly with the target and check the chain (and, on an "
            "attention-only target, a real tree-verification forward) emitted exactly that; exit 1 if not.",
        ),
    ] = False,
    per_prompt: Annotated[
        bool, typer.Option("--per-prompt", help="Also print each prompt's chain and tree tau.")
    ] = False,
    json_out: Annotated[
        str | None,
        typer.Option(
            "--json", help="Also write everything measured (per budget, depth and domain) to this JSON file."
        ),
    ] = None,
) -> None:
    """Measure a drafter's acceptance length tau on held-out prompts, chain and tree.

    Speculative-decodes them with the target and the drafter and prints chain and tree tau and their
    histograms (exit 1 when --check-lossless finds a decode other than the target's)."""
    from app.cli.bars import library_bars_only_on_a_tty

    require_importable_stack()
    from app.evaluate.trained import evaluate_trained  # heavy imports only for this command

    library_bars_only_on_a_tty()

    budgets = _budgets(tree_budget)
    evaluation = evaluate_trained(
        source,
        prompts=prompts,
        max_new_tokens=max_new_tokens,
        data=data,
        tree_budgets=budgets,
        tree_top_k=tree_top_k,
        check_lossless=lossless,
        progress=lambda message: print(message, file=sys.stderr, flush=True),
    )
    for line in evaluation.describe() + (evaluation.result.describe_prompts() if per_prompt else []):
        print(line, flush=True)
    if json_out is not None:
        record = {
            "step": evaluation.step,
            "checkpoint": str(evaluation.checkpoint),
            **evaluation.result.report(),
            "target_predictability": evaluation.predictability,
        }
        write_bytes_atomic(Path(json_out), json.dumps(record, indent=1).encode())
    if evaluation.lossless is not None and not evaluation.lossless.ok:
        raise typer.Exit(1)


def _budgets(text: str | None) -> list[int] | None:
    """`--tree-budget 16,64,256` -> [16, 64, 256]; `0` -> [] (the chain only); None: the config's."""
    if text is None:
        return None
    return [budget for budget in int_list(text, "--tree-budget", 0) if budget > 0]
