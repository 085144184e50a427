"""`dflash eval SOURCE`: acceptance length tau of a trained drafter, by speculative decoding: the
chain's and, for each tree budget, DDTree's."""

from __future__ import annotations

from typing import Annotated

import typer

from app.errors import UserError


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
    per_prompt: Annotated[
        bool, typer.Option("--per-prompt", help="Also print each prompt's chain and tree tau.")
    ] = False,
) -> None:
    """Speculative-decode held-out prompts with the target and the drafter; print tau and the histogram."""
    from app.data.dataset import load_tokenized, load_training_data  # heavy imports only for this command
    from app.evaluate import prompts_from_dataset, prompts_from_file
    from app.evaluate.evaluator import Evaluator
    from app.export import load_trained_drafter
    from app.model.target import load_target
    from app.train.setup import load_tokenizer, pick_device

    budgets = _budgets(tree_budget)
    trained = load_trained_drafter(source)
    config = trained.config
    count = prompts or config.train.eval_prompts
    tokenizer = load_tokenizer(config)
    if data is not None:
        prompt_ids = prompts_from_file(data, tokenizer, count, config.data.chat_template_kwargs)
    elif config.data.eval_files:
        held_out = load_tokenized(config.data.eval_files, config.data, tokenizer, min_supervised_tokens=1)
        prompt_ids = prompts_from_dataset(held_out, count)
    elif config.data.train_files:
        prompt_ids = prompts_from_dataset(load_training_data(config, tokenizer)[1], count)
    else:
        raise UserError(
            "eval: no prompts: pass --data FILE or set data.eval_files / data.train_files in the run config"
        )

    device = pick_device(config.train.device)
    target = load_target(config, device)
    evaluator = Evaluator(config, target, tokenizer, prompt_ids, max_new_tokens, budgets, tree_top_k)
    result = evaluator(trained.build(target, device))
    print(
        f"eval: step {trained.step} ({trained.checkpoint}) on {device}, {len(prompt_ids)} prompts", flush=True
    )
    for line in result.describe() + (result.describe_prompts() if per_prompt else []):
        print(line, flush=True)


def _budgets(text: str | None) -> list[int] | None:
    """`--tree-budget 16,64,256` -> [16, 64, 256]; `0` -> [] (the chain only); None: the config's."""
    if text is None:
        return None
    try:
        budgets = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        budgets = []
    if not budgets or any(budget < 0 for budget in budgets):
        raise UserError(f"--tree-budget: expected node budgets >= 0 separated by commas, got {text!r}")
    return [budget for budget in budgets if budget > 0]
