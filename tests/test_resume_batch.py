"""A resume keeps the global batch (batches per optimizer step = drafter ranks x train.grad_accum) or
refuses, naming the grad_accum that keeps it; `train.reschedule` takes the change on purpose."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.errors import UserError
from app.train.trainer import Trainer
from tests.helpers import small_config


def test_a_resume_that_would_change_the_global_batch_is_refused_with_the_grad_accum_that_keeps_it(
    tiny_lm_dir, tiny_conversations, tmp_path: Path
) -> None:
    """max_steps fixed, so the schedule alone would not notice: trained 2 batches per step, resumed
    with 1 (what a resume onto half the drafter ranks with grad_accum=1 would train)."""
    Trainer(
        small_config(tiny_conversations, tmp_path, "train.max_steps=2", "train.grad_accum=2"), log=print
    ).run()
    with pytest.raises(UserError) as refused:
        Trainer(
            small_config(tiny_conversations, tmp_path, "train.max_steps=2"),
            resume=True,
            log=lambda line: None,
        )
    assert str(refused.value).endswith(
        "cannot resume: the checkpoint trained 2 batches per step (drafter ranks x train.grad_accum), this "
        "run 1: the global batch would change; set train.grad_accum=2 to keep it, or set "
        "train.reschedule=true to train with the new one from this step on"
    )
    lines: list[str] = []
    chosen = small_config(tiny_conversations, tmp_path, "train.max_steps=3", "train.reschedule=true")
    trainer = Trainer(chosen, resume=True, log=lines.append)
    assert any("note: train.reschedule: the checkpoint trained 2 batches per step" in line for line in lines)
    assert trainer.run().steps == 3
