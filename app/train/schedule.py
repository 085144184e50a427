"""Learning rate as a pure function of the step: linear warmup, then cosine or warmup-stable-decay.

Being a function of the step alone, the schedule resumes exactly from the step counter; there is
no scheduler state to save, only the settings that define it (`schedule_settings`), which a resume
must find unchanged.
"""

from __future__ import annotations

import math

from app.config.schema import TrainConfig


def learning_rate(step: int, total_steps: int, train: TrainConfig) -> float:
    """The learning rate for optimizer step `step` (0-based) of `total_steps`."""
    warmup = round(train.warmup_ratio * total_steps)
    floor = train.lr * train.min_lr_ratio
    if step < warmup:
        return train.lr * (step + 1) / warmup
    if train.schedule == "cosine":
        progress = (step - warmup) / max(1, total_steps - warmup)
        return floor + (train.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    decay_steps = max(1, round(train.decay_ratio * total_steps))
    decay_start = max(warmup, total_steps - decay_steps)
    if step < decay_start:
        return train.lr
    progress = (step - decay_start) / max(1, total_steps - decay_start)
    return train.lr - (train.lr - floor) * min(1.0, progress)


def schedule_settings(total_steps: int, train: TrainConfig) -> dict[str, float | int | str]:
    """Everything `learning_rate` reads besides the step: two runs with equal settings follow one curve."""
    return {
        "total_steps": total_steps,
        "lr": train.lr,
        "schedule": train.schedule,
        "warmup_ratio": train.warmup_ratio,
        "decay_ratio": train.decay_ratio,
        "min_lr_ratio": train.min_lr_ratio,
    }
