"""What a resume must find unchanged before it loads a checkpoint's state into the trainer.

The training signal (what the drafter learns), the batch plan (the data order the saved cursor points
into), the global batch (batches per optimizer step) and the learning-rate schedule (every lr of the
remaining steps). Each check refuses with one line naming the checkpoint and what changed; a change of
the global batch or the schedule can be taken on purpose (`train.reschedule`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.checkpoint.store import (
    Checkpoint,
    check_training_signal,
    checkpoint_root,
    complete_checkpoints,
    latest_checkpoint,
    verify_checkpoint,
)
from app.config import RunConfig
from app.config.schema import TrainConfig
from app.errors import UserError
from app.train.schedule import schedule_settings


def refuse_if_all_damaged(run_dir: Path) -> None:
    """No loadable checkpoint: fine for a run that never wrote one, a refusal where all are damaged
    (starting from step 0 would silently throw the run away)."""
    damaged = complete_checkpoints(checkpoint_root(run_dir))
    if damaged:
        raise UserError(
            f"{checkpoint_root(run_dir)}: cannot resume: every checkpoint fails verification "
            f"({', '.join(path.name for path in damaged)}; the warnings above say why); restore one, "
            "or start a new run with another train.output_dir"
        )


def precheck_resume(config: RunConfig) -> None:
    """What a resume is refused for once the data and the target have loaded (minutes at production
    size), refused before they load: every checkpoint damaged (a file missing or truncated; the
    checksums are verified at load), or a changed training signal (it needs only the tokenizer and
    the target's config)."""
    from app.model.loading import load_tokenizer
    from app.model.target import resolve_layer_ids, target_text_config
    from app.train.setup import training_signal

    run_dir = Path(config.train.output_dir)
    root = checkpoint_root(run_dir)
    found = complete_checkpoints(root)
    problems = {path: verify_checkpoint(path, checksums=False) for path in found}
    intact = [path for path in found if problems[path] is None]
    if found and not intact:
        reasons = "; ".join(f"{path.name}: {problem}" for path, problem in problems.items())
        raise UserError(
            f"{root}: cannot resume: every checkpoint fails verification ({reasons}); restore one, or "
            "start a new run with another train.output_dir"
        )
    newest = latest_checkpoint(root)
    newest = newest if newest in intact else (intact[-1] if intact else None)
    try:
        saved = json.loads((newest / "state.json").read_text())["signal"] if newest else None
    except (OSError, ValueError, KeyError, TypeError):
        return  # unreadable: the load's full verification falls back past it and says why
    if saved is None:
        return
    text_config = target_text_config(config.target)
    layer_ids = resolve_layer_ids(config.drafter, text_config.num_hidden_layers)
    check_training_signal(saved, training_signal(config, layer_ids, load_tokenizer(config)), newest)


def check_resumable(
    checkpoint: Checkpoint,
    *,
    signal: dict[str, Any],
    plan: str,
    total_steps: int,
    batches_per_step: int,
    train: TrainConfig,
    log: Callable[[str], None],
) -> None:
    state, path = checkpoint.state, checkpoint.path
    check_training_signal(state["signal"], signal, path)
    if state["plan"] != plan:
        raise UserError(
            f"{path}: cannot resume: the training data or batching settings changed "
            f"(batch plan {state['plan']} != {plan}), so the saved data position means nothing in the "
            "new plan; resume with the run's data and data.* settings, or start a new run"
        )
    _check_global_batch(state.get("batches_per_step", 1), batches_per_step, path, train, log)
    _check_schedule(state, path, schedule_settings(total_steps, train), train.reschedule, log)


def _check_global_batch(
    saved: int, now: int, path: Path, train: TrainConfig, log: Callable[[str], None]
) -> None:
    """A resume keeps the batches per optimizer step (drafter ranks x train.grad_accum: the global
    batch), or refuses saying how to keep it; `train.reschedule` takes the change on purpose."""
    if saved == now:
        return
    change = (
        f"the checkpoint trained {saved} batches per step (drafter ranks x train.grad_accum), this run {now}"
    )
    if train.reschedule:
        log(f"note: train.reschedule: {change}; the data continues at the saved position")
        return
    drafters = now // train.grad_accum
    keep = (
        f"set train.grad_accum={saved // drafters} to keep it"
        if saved % drafters == 0
        else f"use a number of drafter ranks that divides {saved} and the grad_accum that keeps it"
    )
    raise UserError(
        f"{path}: cannot resume: {change}: the global batch would change; {keep}, or set "
        "train.reschedule=true to train with the new one from this step on"
    )


def _check_schedule(
    state: dict[str, Any], path: Path, now: dict[str, Any], reschedule: bool, log: Callable[[str], None]
) -> None:
    """A resume follows the checkpoint's learning-rate schedule, or refuses (`train.reschedule`
    follows this config's on purpose)."""
    saved = state.get("schedule") or {"total_steps": state["total_steps"]}  # before the full record
    changed = [f"{key} {saved[key]} -> {now[key]}" for key in saved if saved[key] != now.get(key)]
    if not changed:
        return
    if not reschedule:
        raise UserError(
            f"{path}: cannot resume: the learning-rate schedule would change ({'; '.join(changed)}; "
            "total_steps follows train.epochs, train.max_steps, train.grad_accum and the drafter ranks); "
            "resume with the run's settings, or set train.reschedule=true to follow the new schedule "
            "from this step on"
        )
    log(f"note: train.reschedule: the learning rate follows the new schedule ({'; '.join(changed)})")
