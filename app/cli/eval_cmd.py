"""`dflash eval SOURCE`: acceptance length tau of a trained drafter, by speculative decoding."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from app.model.target import TargetModel


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
    import torch  # heavy imports only for this command

    from app.data.dataset import load_tokenized, load_training_data
    from app.errors import UserError
    from app.evaluate import evaluate_tau, prompts_from_dataset, prompts_from_file
    from app.export import load_trained_drafter
    from app.model.target import load_target
    from app.train.setup import load_tokenizer, pick_device

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
    drafter = trained.build(target, device)
    bf16 = device.type == "cuda" and config.train.precision == "bf16"
    result = evaluate_tau(
        target,
        drafter,
        prompt_ids,
        max_new_tokens or config.train.eval_max_new_tokens,
        eos_token_id=_stop_tokens(tokenizer, target),
        autocast_dtype=torch.bfloat16 if bf16 else None,
    )
    print(
        f"eval: step {trained.step} ({trained.checkpoint}) on {device}, {len(prompt_ids)} prompts", flush=True
    )
    for line in result.describe():
        print(line, flush=True)


def _stop_tokens(tokenizer: PreTrainedTokenizerBase, target: TargetModel) -> list[int]:
    """The tokenizer's end-of-sequence token and the target's generation-config ones."""
    stops: set[int] = set()
    if tokenizer.eos_token_id is not None:
        stops.add(tokenizer.eos_token_id)
    configured = getattr(target.model.generation_config, "eos_token_id", None)
    if configured is not None:
        stops.update([configured] if isinstance(configured, int) else configured)
    return sorted(stops)
