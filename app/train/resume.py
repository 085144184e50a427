"""What a resume must find unchanged before it loads a checkpoint's state into the trainer.

The training signal (what the drafter learns), the batch plan (the data order the saved cursor points
into) and the learning-rate schedule (every lr of the remaining steps). Each check refuses with one
line naming the checkpoint and what changed; a schedule change can be taken on purpose.
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
    from app.model.target import resolve_layer_ids, target_text_config
    from app.train.setup import load_tokenizer, training_signal

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
    train: TrainConfig,
    log: Callable[[str], None],
) -> None:
    state, path = checkpoint.state, checkpoint.path
    check_training_signal(state["signal"], signal, path)
    if state["plan"] != plan:
        raise UserError(
            f"{path}: cannot resume: the training data or batching settings changed "
            f"(batch plan {state['plan']} != {plan})"
        )
    _check_schedule(state, path, schedule_settings(total_steps, train), train.reschedule, log)


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
