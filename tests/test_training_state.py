"""What a training step may change and what a resume must bring back: a gradient that is not finite
under a finite loss is refused like a non-finite loss, and the global RNG, which training never draws
from (each draw has its own seeded generator), is still restored from the checkpoint on resume."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from app.bench.drafter import _frozen_head_stand_ins
from app.checkpoint.store import load_latest_checkpoint
from app.compile.warmup import synthetic_batches
from app.config import load_config
from app.model.drafter import DFlashDrafter, DrafterArch
from app.train.metrics import NonFiniteLoss
from app.train.ranks import run_drafter_rank
from app.train.signals import StopRequest
from app.train.step import BorrowedHeads, DrafterStep
from app.train.trainer import Trainer
from tests.helpers import small_config


def quiet(line: str) -> None:
    pass


def poison_gradient(drafter: DFlashDrafter) -> torch.utils.hooks.RemovableHandle:
    """NaN in one weight's gradient, the loss untouched (what an overflow in a backward kernel does)."""
    return drafter.layers[0].mlp.down_proj.weight.register_hook(lambda grad: grad * float("nan"))


def test_a_finite_loss_with_a_non_finite_gradient_changes_no_weight_then_or_after():
    config = load_config("configs/tiny.toml", ["train.anchors=16", "drafter.num_layers=1"])
    cpu = torch.device("cpu")
    drafter = DFlashDrafter(DrafterArch.from_config(config), seed=0, device=cpu)
    step = DrafterStep(
        config, drafter, BorrowedHeads(*_frozen_head_stand_ins(drafter.arch, cpu, torch.float32)), cpu
    )
    batch = synthetic_batches(config, drafter, cpu, 1)[0]
    before = {name: parameter.detach().clone() for name, parameter in drafter.named_parameters()}

    hook = poison_gradient(drafter)
    loss = step.backward(batch).loss.detach()
    assert torch.isfinite(loss) and not torch.isfinite(step.apply(1e-3, loss))
    hook.remove()
    assert not step.finite
    # the next step is finite, yet skipped too: the run stops at its next look with the last good state
    assert torch.isfinite(step.apply(1e-3, step.backward(batch).loss.detach()))
    for name, parameter in drafter.named_parameters():
        assert torch.equal(parameter, before[name]), name


@contextmanager
def poisoned(poison: Callable[[Trainer], object]) -> Iterator[None]:
    """Every Trainer built inside gets `poison` applied once it is built (`dflash train`'s own path,
    `run_drafter_rank`, builds it)."""
    built = Trainer.__init__

    def init(self: Trainer, *args, **kwargs) -> None:
        built(self, *args, **kwargs)
        poison(self)

    Trainer.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        Trainer.__init__ = built  # type: ignore[method-assign]


def test_the_trainer_stops_at_a_step_whose_gradient_alone_is_not_finite_naming_where_to_go_on(
    tiny_lm_dir, tiny_conversations, tmp_path: Path
) -> None:
    """Poisoned from the first step: nothing to resume from, the run starts again. Poisoned at step 3
    of a run saving every step: it resumes from step 2's checkpoint, named."""
    config = small_config(tiny_conversations, tmp_path / "a", "train.max_steps=2")
    with (
        poisoned(lambda trainer: poison_gradient(trainer.drafter)),
        pytest.raises(
            NonFiniteLoss,
            match=r"^non-finite loss at step 1 \(epoch 0, batch 0.*\); no checkpoint was written: start the run "
            r"again with a lower train\.lr, or inspect those samples$",
        ),
    ):
        run_drafter_rank(config, None, False, quiet)
    run_dir = tmp_path / "b"
    config = small_config(tiny_conversations, run_dir, "train.max_steps=4", "train.save_every=1")

    def from_step_3(trainer: Trainer) -> None:
        weight = trainer.drafter.layers[0].mlp.down_proj.weight
        weight.register_hook(lambda grad: grad * float("nan") if trainer.step >= 2 else grad)

    with poisoned(from_step_3), pytest.raises(NonFiniteLoss) as stopped:
        run_drafter_rank(config, None, False, quiet)
    assert str(stopped.value).startswith("non-finite loss at step 3 ")
    assert str(stopped.value).endswith(
        f"; resume from {run_dir / 'checkpoints' / 'step_00000002'} with a lower train.lr, or inspect those samples"
    )


class DrawsFromTheGlobalRng:
    """A reporter that draws from torch's global RNG at every log line, as any library call may."""

    def on_start(self, start) -> None:
        torch.rand(7)

    def on_log(self, record) -> None:
        torch.rand(7)

    def on_checkpoint(self, path, step) -> None:
        pass

    def on_exit(self, reason, step) -> None:
        pass


def test_training_draws_nothing_from_the_global_rng_and_a_resume_restores_it(
    tiny_lm_dir, tiny_conversations, tmp_path: Path
) -> None:
    """Two runs from different global RNG states, one drawing from it between steps, train the same
    weights bit for bit (noise and anchors on): what the saved state restores changes nothing trained.
    It is restored all the same, so code that starts drawing from it resumes exactly."""
    extra = ("train.max_steps=2", "train.save_every=1", "train.feature_noise_std=0.5")
    weights = []
    for seed, reporters in [(0, []), (1, [DrawsFromTheGlobalRng()])]:
        torch.manual_seed(seed)
        trainer = Trainer(
            small_config(tiny_conversations, tmp_path / str(seed), *extra), log=quiet, reporters=reporters
        )
        trainer.run()
        weights.append(trainer.drafter.state_dict())
    for name, weight in weights[0].items():
        assert torch.equal(weight, weights[1][name]), name

    saved = load_latest_checkpoint(tmp_path / "1").rng_state["cpu"]
    torch.manual_seed(2)
    assert not torch.equal(torch.get_rng_state(), saved)
    Trainer(small_config(tiny_conversations, tmp_path / "1", *extra), resume=True, log=quiet)
    assert torch.equal(torch.get_rng_state(), saved)


def test_the_stop_handler_only_sets_a_flag_and_the_loop_says_it() -> None:
    """A print inside a signal handler can interrupt a print in progress (a reentrant-call error): the
    handler only records the signal; the loop's next look says it, once."""
    notes: list[str] = []
    stop = StopRequest(notes.append)
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and notes == []
        assert stop.agreed(None) and notes == ["received SIGTERM: checkpointing after this step"]
        assert stop.agreed(None) and len(notes) == 1
    finally:
        stop.restore()
