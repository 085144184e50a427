"""The colocated trainer on the built-in tiny target: exact resume, refused signal changes, golden loss curve."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import shutil
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from app.checkpoint.store import checkpoint_root, complete_checkpoints, verify_checkpoint
from app.checkpoint.writer import CheckpointWriteError
from app.config import load_config
from app.errors import UserError
from app.model.flops import forward_flops, step_flops
from app.model.objective import drafter_loss
from app.pipeline.counters import RankCounters
from app.train.metrics import NonFiniteLoss, StepOutput, StepSums, WindowSums, gather_window
from app.train.ranks import run_drafter_rank
from app.train.schedule import learning_rate
from app.train.trainer import Trainer, TrainingStopped
from tests.helpers import (
    SMALL,
    StopAtStep,
    dflash,
    random_target_config,
    run_dflash_with_file_size_limit,
    small_config,
    unwritable_directory,
)

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "golden" / "tiny_loss_curve.json"


def quiet(line: str) -> None:
    pass


def drafter_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in trainer.drafter.state_dict().items()}


def test_sigterm_then_resume_continues_exactly(tiny_lm_dir, tiny_conversations, tmp_path: Path) -> None:
    """6 steps straight == SIGTERM at step 3 (checkpointed) + a new Trainer resuming for the rest: same losses, same weights."""
    straight = Trainer(small_config(tiny_conversations, tmp_path / "a", "train.max_steps=6"), log=quiet)
    straight_losses = straight.run().losses

    config = small_config(tiny_conversations, tmp_path / "b", "train.max_steps=6", "telemetry.log_every=1")
    first = Trainer(config, log=quiet, reporters=[StopAtStep(3)])
    with pytest.raises(TrainingStopped, match="stopped by signal at step 3"):
        first.run()
    resumed = Trainer(config, resume=True, log=quiet)
    assert resumed.step == 3
    rest = resumed.run().losses

    first_losses = [
        json.loads(line)["loss"] for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    ][:3]
    assert first_losses + rest == straight_losses
    for name, weight in drafter_weights(straight).items():
        assert torch.equal(weight, drafter_weights(resumed)[name]), name


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ("train.anchors=32", "train.anchors"),
        ("drafter.block_size=6", "drafter.block_size"),
        ("drafter.target_layer_ids=[1, 2]", "drafter.target_layer_ids"),
        ("drafter.mask_token_id=4", "drafter.mask_token_id"),
    ],
)
def test_resume_refuses_a_changed_training_signal(
    tiny_lm_dir, tiny_conversations, tmp_path: Path, change, field
) -> None:
    Trainer(small_config(tiny_conversations, tmp_path, "train.max_steps=1"), log=quiet).run()
    with pytest.raises(UserError, match=rf"cannot resume: training signal {field} changed"):
        Trainer(
            small_config(tiny_conversations, tmp_path, "train.max_steps=2", change), resume=True, log=quiet
        )


def test_resume_skips_a_corrupt_checkpoint(tiny_lm_dir, tiny_conversations, tmp_path: Path) -> None:
    Trainer(
        small_config(tiny_conversations, tmp_path, "train.max_steps=4", "train.save_every=2"), log=quiet
    ).run()
    newest = complete_checkpoints(checkpoint_root(tmp_path))[-1]
    (newest / "optimizer.pt").write_bytes(b"truncated")
    with pytest.warns(UserWarning, match="fails its sha256|truncated"):
        resumed = Trainer(
            small_config(tiny_conversations, tmp_path, "train.max_steps=4"), resume=True, log=quiet
        )
    assert resumed.step == 2


def test_run_directory_contents(tiny_lm_dir, tiny_conversations, tmp_path: Path) -> None:
    lines: list[str] = []
    config = small_config(tiny_conversations, tmp_path, "train.max_steps=4", "telemetry.log_every=2")
    result = Trainer(config, log=lines.append).run()
    assert result.steps == 4 and len(result.losses) == 4
    recorded = json.loads((tmp_path / "config.json").read_text())
    assert recorded["train"]["max_steps"] == 4
    # derived defaults are written out: the drafter's shape from tiny-lm, gamma from the block size
    assert (recorded["drafter"]["num_attention_heads"], recorded["drafter"]["head_dim"]) == (4, 32)
    assert recorded["drafter"]["target_layer_ids"] == [1] and recorded["train"]["gamma"] == 4 / 2.5
    assert "torch" in json.loads((tmp_path / "fingerprint.json").read_text())
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [2, 4]
    log_lines = [line for line in lines if line.startswith("[")]
    assert len(log_lines) == 2
    # one CPU process: progress of the run's steps, one batch rate, and none of the fields that mean
    # nothing here (queues, separate target/drafter rates, GPU memory, mfu, noise that is off)
    # (and, on a log step, the DDTree streak of the eval's tree on a sample of the step's blocks)
    assert re.match(
        r"\[\d+s\] step=4/4 loss=\S+ acc=\S+ streak=\S+ tree_streak=\S+ lr=\S+ \| \S+b/s \(\S+Ktok/s\) "
        r"\| epoch~\S+ ETA=\S+$",
        log_lines[-1],
    )
    assert all(0 <= m["tree_streak"] <= config.drafter.block_size - 1 for m in metrics)
    assert all(
        field not in log_lines[-1] for field in ("tgt=", "dft=", "q_pre", "q_hs", "mem=", "mfu", "noise")
    )
    (legend,) = [line for line in lines if line.startswith("log line: ")]
    assert legend.endswith(
        "mfu not shown: a CPU has no reference peak (set telemetry.peak_tflops to compare with one)"
    )
    assert metrics[-1]["total_steps"] == 4 and metrics[-1]["mfu"] is None and metrics[-1]["tflops_per_s"] > 0


def test_the_log_line_mfu_is_the_useful_flops_of_the_batches_trained(
    tiny_lm_dir, tiny_conversations, tmp_path: Path
) -> None:
    """A window's mfu: the FLOPs `app.model.flops` counts on every row this rank trained in it (two
    micro-batches a step here), over the window's seconds, over the configured peak."""
    lines: list[str] = []
    config = small_config(
        tiny_conversations, tmp_path, "train.max_steps=4", "telemetry.log_every=2", "train.grad_accum=2",
        "telemetry.peak_tflops=0.5",
    )  # fmt: skip
    trainer = Trainer(config, log=lines.append)
    trained: list = []
    train_step = trainer.train_step
    trainer.train_step = lambda batches: (trained.append(batches), train_step(batches))[1]
    trainer.run()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for record, window in zip(records, (trained[:2], trained[2:]), strict=True):
        rows = [item.features.row for batches in window for item in batches.micro if item.planned is not None]
        assert len(rows) == 4
        flops = sum(float(step_flops(forward_flops(trainer.drafter.arch, row))) for row in rows)
        training_s = record["window_s"] - record["paused_s"]
        assert record["tflops_per_s"] * training_s * 1e12 == pytest.approx(flops, rel=1e-9)
        assert record["mfu"] == pytest.approx(record["tflops_per_s"] / 0.5, rel=1e-9)
    log_lines = [line for line in lines if line.startswith("[")]
    assert f"mfu={100 * records[-1]['mfu']:.1f}%" in log_lines[-1] and " step=4/4 " in log_lines[-1]
    assert any(
        line.endswith("mfu = drafter FLOP/s over 0.5 TFLOP/s (telemetry.peak_tflops)") for line in lines
    )


def test_an_eval_in_a_log_window_is_a_pause_not_a_throughput_collapse(
    tiny_lm_dir, tiny_conversations, tmp_path: Path
) -> None:
    """The eval after step 2 falls in the window of steps 3-4: its seconds are recorded as paused and
    left out of the rates and the ETA, which are over the window's training time only."""
    config = small_config(
        tiny_conversations, tmp_path, "train.max_steps=6", "telemetry.log_every=2", "train.eval_every=2",
        "train.eval_prompts=1", "train.save_every=100",
    )  # fmt: skip
    Trainer(config, log=quiet).run()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    windows = [record for record in records if "eval" not in record]
    assert [w["step"] for w in windows] == [2, 4, 6] and windows[0]["paused_s"] == 0
    assert [w["evaluated"] for w in windows] == [False, True, True]  # the evals after steps 2 and 4
    for window in windows[1:]:
        assert 0 < window["paused_s"] < window["window_s"]  # the eval at the previous line
        training_s = window["window_s"] - window["paused_s"]
        assert window["drafter_batches_per_s"] * training_s == pytest.approx(2, rel=1e-9)  # 2 steps of 1
        assert window["eta_s"] == pytest.approx((6 - window["step"]) * training_s / 2, rel=1e-9)


def test_empty_dataset_is_refused_before_any_model_loads(tiny_tokenizer_dir, tmp_path: Path) -> None:
    """All records too short: a one-line error naming the file, raised while the target path holds no model."""
    (tmp_path / "no-model").mkdir()
    data = tmp_path / "short.jsonl"
    record = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}
    data.write_text(json.dumps(record) + "\n")
    config_file = tmp_path / "run.toml"
    config_file.write_text(
        f'[target]\npath = "{tmp_path / "no-model"}"\ntokenizer = "{tiny_tokenizer_dir}"\n'
        f"[drafter]\nmask_token_id = 3\nblock_size = 4\n"
        f'[data]\ntrain_files = ["{data}"]\ntoken_budget = 256\nmax_length = 256\n'
        f'[train]\nanchors = 16\noutput_dir = "{tmp_path / "run"}"\ndevice = "cpu"\n'
    )
    with pytest.raises(UserError, match=r"short\.jsonl"):
        Trainer(load_config(config_file), log=quiet)


def test_grad_accum_applies_the_mean_of_the_micro_batch_gradients(
    tiny_lm_dir, tiny_conversations, tmp_path: Path
) -> None:
    """grad_accum=2: the one optimizer step sees the mean of the two micro-batches' own gradients
    (not their sum, not the last one alone). No clipping, so the gradient reaches the step as computed."""
    config = small_config(
        tiny_conversations, tmp_path, "train.max_steps=1", "train.grad_accum=2", "train.grad_clip=1e9"
    )
    trainer = Trainer(config, log=quiet)
    initial = copy.deepcopy(trainer.drafter)
    stepped: dict[str, torch.Tensor] = {}
    trainer.optimizer.register_step_pre_hook(
        lambda optimizer, args, kwargs: stepped.update(
            {name: p.grad.clone() for name, p in trainer.drafter.named_parameters()}
        )
    )
    trained: list = []
    train_step = trainer.train_step
    trainer.train_step = lambda batches: (trained.append(batches), train_step(batches))[1]
    trainer.run()

    (batches,) = trained
    assert len(batches.micro) == 2 and all(item.planned is not None for item in batches.micro)
    micro_gradients = []
    for item in batches.micro:
        initial.zero_grad(set_to_none=True)
        drafter_loss(
            initial,
            item.features,
            trainer.heads.embed_tokens,
            trainer.heads.lm_head,
            gamma=config.train.gamma,
            chunk_size=config.train.loss_chunk_size,
        ).loss.backward()
        micro_gradients.append({name: p.grad.clone() for name, p in initial.named_parameters()})
    assert stepped.keys() == micro_gradients[0].keys()
    for name, gradient in stepped.items():
        torch.testing.assert_close(gradient, (micro_gradients[0][name] + micro_gradients[1][name]) / 2)


def test_golden_loss_curve(tiny_tokenizer_dir, tiny_conversations, tmp_path: Path) -> None:
    """The first 20 steps of configs/tiny.toml (on the fixture data) stay on the recorded curve, within
    0.1%: a 1% change of the learning rate moves most steps by 0.2-2%.

    Regenerate after an intended change of the model, objective or data path with
    `DFLASH_UPDATE_GOLDEN=1 pytest tests/test_trainer.py -k golden`.
    """
    config = random_target_config(
        tiny_tokenizer_dir, tiny_conversations, tmp_path, max_steps=20, eval_every=0
    )
    losses = Trainer(config, log=quiet).run().losses
    if GOLDEN.exists() and not _updating():
        golden = json.loads(GOLDEN.read_text())["losses"]
        assert len(losses) == len(golden) == 20
        for step, (got, want) in enumerate(zip(losses, golden, strict=True), start=1):
            assert got == pytest.approx(want, rel=1e-3), f"step {step}: loss {got:.4f}, golden {want:.4f}"
        assert losses[-1] < losses[0]  # it learns
    else:
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(
            json.dumps(
                {"config": "configs/tiny.toml, random-weight tiny-lm target", "steps": 20, "losses": losses},
                indent=1,
            )
            + "\n"
        )
        pytest.fail(f"recorded a new golden curve in {GOLDEN}; review and commit it")


def _updating() -> bool:

    return os.environ.get("DFLASH_UPDATE_GOLDEN") == "1"


class CheckpointRecorder:
    """A reporter that keeps what it is told of checkpoints, and whether each was complete by then."""

    def __init__(self) -> None:
        self.reported: list[tuple[int, bool]] = []

    def on_start(self, start) -> None:
        pass

    def on_log(self, record) -> None:
        pass

    def on_checkpoint(self, path, step) -> None:
        self.reported.append((step, path in complete_checkpoints(path.parent)))

    def on_exit(self, reason, step) -> None:
        self.reported.append((-1, reason == "completed"))


def test_checkpoints_are_written_in_the_background_and_reported_once_complete(
    tiny_lm_dir, tiny_conversations, tmp_path: Path
) -> None:
    config = small_config(tiny_conversations, tmp_path, "train.max_steps=5", "train.save_every=2")
    recorder = CheckpointRecorder()
    result = Trainer(config, log=quiet, reporters=[recorder]).run()
    # steps 2 and 4 (save_every) and 5 (the end), each reported once it is complete, all before the exit
    assert recorder.reported == [(2, True), (4, True), (5, True), (-1, True)]
    assert result.checkpoint == complete_checkpoints(checkpoint_root(tmp_path))[-1]


def test_a_failed_checkpoint_write_fails_the_run_naming_the_step(
    tiny_lm_dir, tiny_conversations, tmp_path: Path
) -> None:
    checkpoint_root(tmp_path).write_text("not a directory")  # every write into it fails
    config = small_config(tiny_conversations, tmp_path, "train.max_steps=4", "train.save_every=2")
    with pytest.raises(CheckpointWriteError, match=r"checkpoint of step 2 in .* could not be written \("):
        Trainer(config, log=quiet).run()


def test_a_new_run_into_a_directory_with_checkpoints_is_refused_before_anything_loads(
    tiny_lm_dir, tiny_conversations, tmp_path: Path
) -> None:
    """Without --resume the new run would mix its checkpoints with the old ones (and prune its own);
    the refusal comes first, leaves the old run as it was and removes a killed write's staging."""
    Trainer(small_config(tiny_conversations, tmp_path, "train.max_steps=2"), log=quiet).run()
    root = checkpoint_root(tmp_path)
    before = sorted(path.name for path in root.iterdir())
    (root / ".step_00000009.abandoned").mkdir()  # what a SIGKILL mid-write leaves
    missing_data = small_config(tmp_path / "no-such-data.jsonl", tmp_path, "train.max_steps=2")
    with pytest.raises(UserError, match=r"holds the checkpoints of an earlier run \(newest step_00000002\); "
                       r"continue it with --resume, or start a new run with another train.output_dir"):  # fmt: skip
        Trainer(missing_data, log=quiet)  # refused before the (missing) data is even looked at
    assert sorted(path.name for path in root.iterdir()) == before


def test_resume_refuses_when_every_checkpoint_is_damaged(
    tiny_lm_dir, tiny_conversations, tmp_path: Path
) -> None:
    config = small_config(tiny_conversations, tmp_path, "train.max_steps=2", "train.save_every=1")
    Trainer(config, log=quiet).run()
    for path in complete_checkpoints(checkpoint_root(tmp_path)):
        (path / "model.safetensors").write_bytes(b"damaged")
    with (
        pytest.warns(UserWarning),
        pytest.raises(
            UserError,
            match=r"cannot resume: every checkpoint fails verification \(step_00000001, step_00000002;",
        ),
    ):
        Trainer(config, resume=True, log=quiet)


def test_a_resume_it_would_refuse_after_loading_is_refused_before_the_data_loads(
    tiny_lm_dir, tiny_conversations, tmp_path: Path
) -> None:
    """`dflash train --resume` (run_drafter_rank) with a changed training signal, then with every
    checkpoint truncated: refused naming why before the data loads (its file is gone by then: loading
    it would be another error), not after the data and the target (minutes at production size)."""
    data = tmp_path / "data.jsonl"
    data.write_bytes(Path(tiny_conversations).read_bytes())
    run_dir = tmp_path / "run"
    run_drafter_rank(
        small_config(data, run_dir, "train.max_steps=2", "train.save_every=1"), None, False, quiet
    )
    data.unlink()
    changed = small_config(data, run_dir, "train.max_steps=3", "train.anchors=32")
    with pytest.raises(
        UserError, match=r"step_00000002: cannot resume: training signal train\.anchors changed"
    ):
        run_drafter_rank(changed, None, True, quiet)
    for path in complete_checkpoints(checkpoint_root(run_dir)):
        (path / "model.safetensors").write_bytes(b"damaged")
    with pytest.raises(UserError) as refused:
        run_drafter_rank(small_config(data, run_dir, "train.max_steps=3"), None, True, quiet)
    assert re.search(
        r"cannot resume: every checkpoint fails verification \(step_00000001: model\.safetensors is "
        r"truncated \(7 of \d+ bytes\); step_00000002: ",
        str(refused.value),
    ), refused.value


def test_a_non_finite_step_is_never_checkpointed(
    tiny_lm_dir, tiny_conversations, tmp_path: Path, capsys, monkeypatch
) -> None:
    """An absurd learning rate through `dflash train`: the run stops at the first non-finite step,
    before the save of that step, on a step that logs nothing (the check does not wait for a log
    line); a job failure, exit 1, with the one line that says what to do and no traceback."""
    done = dflash(
        capsys, monkeypatch, "train", str(ROOT / "configs" / "tiny.toml"), *SMALL,
        f"data.train_files=['{tiny_conversations}']", f"train.output_dir={tmp_path}", "train.max_steps=6",
        "train.save_every=1", "telemetry.log_every=100", "train.lr=1e12", "train.warmup_ratio=0",
        "train.grad_clip=1e30",
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    stopped = re.fullmatch(
        r"dflash: failed: non-finite loss at step (\d+) \(.*\); resume .*", done.stderr.splitlines()[-1]
    )
    assert stopped is not None, done.stderr
    bad_step = int(stopped.group(1))
    saved = complete_checkpoints(checkpoint_root(tmp_path))
    assert all(int(path.name.removeprefix("step_")) < bad_step for path in saved)
    for path in saved:
        weights = load_file(path / "model.safetensors")
        assert all(torch.isfinite(tensor).all() for tensor in weights.values()), path.name


def test_a_non_finite_step_changes_no_weight(tiny_lm_dir, tiny_conversations, tmp_path: Path) -> None:
    """The first non-finite step and every one after it skip the optimizer step on the device: when
    the run stops (here at its only look, the last step), the weights and AdamW moments in memory
    are still finite."""
    config = small_config(
        tiny_conversations, tmp_path, "train.max_steps=6", "train.save_every=100", "telemetry.log_every=100",
        "train.lr=1e12", "train.warmup_ratio=0", "train.grad_clip=1e30",
    )  # fmt: skip
    trainer = Trainer(config, log=quiet)
    with pytest.raises(NonFiniteLoss, match=r"non-finite loss at step [1-5] "):
        trainer.run()
    assert not trainer.drafter_step.finite
    assert all(torch.isfinite(parameter).all() for parameter in trainer.drafter.parameters())
    moments = [value for state in trainer.optimizer.state.values() for value in state.values()]
    assert moments and all(torch.isfinite(value).all() for value in moments)


@pytest.mark.parametrize("where", ["under a file", "read-only"])
def test_an_unwritable_output_dir_is_refused_before_anything_loads(tmp_path: Path, where: str) -> None:
    """Refused in one line naming train.output_dir, before the (missing) data is even looked at: not
    hours later, when the first checkpoint is written."""
    missing_data = tmp_path / "no-such-data.jsonl"
    if where == "under a file":
        (tmp_path / "notes.txt").write_text("")
        run_dir = nullcontext(tmp_path / "notes.txt" / "run")
        expected = r".*/notes.txt/run: .*/notes.txt is a file, not a directory$"
    else:
        run_dir = unwritable_directory(tmp_path / "run")
        expected = r".*/run: cannot create or write files there \("
    with run_dir as path, pytest.raises(UserError, match=rf"^train.output_dir = {expected}"):
        Trainer(small_config(missing_data, path), log=quiet)


def test_a_full_disk_at_a_checkpoint_stops_the_run_in_one_line_keeping_the_previous_one(
    tiny_lm_dir, tiny_conversations, tmp_path: Path
) -> None:
    """The second checkpoint's write fails for real (a file size limit gives EFBIG, as a full disk
    gives ENOSPC): exit 2 with one line naming that checkpoint, the OS error and the one kept; no
    partial checkpoint is left, `latest` stays on the first, and --resume from it trains on."""
    config = small_config(tiny_conversations, tmp_path, "train.max_steps=4")
    with pytest.raises(TrainingStopped):
        Trainer(config, log=quiet, reporters=[StopAtStep(2)]).run()
    root = checkpoint_root(tmp_path)
    first = root / "step_00000002"
    sizes = {path.name: path.stat().st_size for path in first.iterdir()}
    limit = (sizes["model.safetensors"] + sizes["optimizer.pt"]) // 2  # the weights fit, not the optimizer
    assert sizes["model.safetensors"] < limit < sizes["optimizer.pt"]

    overrides = [
        f"data.train_files=['{tiny_conversations}']",
        f"train.output_dir={tmp_path}",
        "train.max_steps=4",
    ]
    done = run_dflash_with_file_size_limit(
        limit, "train", "configs/tiny.toml", *SMALL, *overrides, "--resume"
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "Loading weights" not in done.stderr  # the library's bar, in a log that is not a terminal
    assert sum(line.startswith("dflash:") for line in done.stderr.splitlines()) == 1
    assert done.stderr.splitlines()[-1] == (
        f"dflash: error: checkpoint of step 4 in {root} could not be written (File too large); the previous "
        "checkpoint step_00000002 is kept: free space (or raise the quota or file size limit), then "
        "continue with --resume"
    )
    assert sorted(path.name for path in root.iterdir()) == ["latest", "step_00000002"]  # no staging left
    assert (root / "latest").read_text() == "step_00000002"
    assert verify_checkpoint(first) is None

    resumed = Trainer(config, resume=True, log=quiet)
    assert resumed.step == 2
    assert resumed.run().steps == 4


def test_a_resume_keeps_the_schedule_or_refuses_a_change(
    tiny_lm_dir, tiny_conversations, tmp_path: Path
) -> None:
    """A resume with another train.max_steps (or warm-up) would recompute every remaining learning
    rate: refused, naming the change and how to take it on purpose; `train.reschedule` follows it."""
    Trainer(small_config(tiny_conversations, tmp_path, "train.max_steps=2"), log=quiet).run()
    with pytest.raises(
        UserError, match=r"cannot resume: the learning-rate schedule would change \(total_steps 2 -> 4;"
    ):
        Trainer(small_config(tiny_conversations, tmp_path, "train.max_steps=4"), resume=True, log=quiet)
    with pytest.raises(UserError, match=r"\(warmup_ratio 0.05 -> 0.5;.*set train.reschedule=true"):
        Trainer(small_config(tiny_conversations, tmp_path, "train.max_steps=2", "train.warmup_ratio=0.5"),
                resume=True, log=quiet)  # fmt: skip
    lines: list[str] = []
    rescheduled = small_config(tiny_conversations, tmp_path, "train.max_steps=4", "train.reschedule=true")
    trainer = Trainer(rescheduled, resume=True, log=lines.append)
    assert any("the learning rate follows the new schedule (total_steps 2 -> 4)" in line for line in lines)
    assert trainer.run().steps == 4
    assert trainer.optimizer.param_groups[0]["lr"] == learning_rate(3, 4, rescheduled.train)


def test_a_window_s_tree_streak_is_per_sampled_block_over_the_steps_that_measured_it() -> None:
    def window(*steps: dict[str, float]) -> WindowSums:
        return WindowSums(**{name: torch.tensor([step[name] for step in steps]) for name in steps[0]})

    plain = {"loss": 4.0, "acc": 1.0, "streak": 2.0, "batches": 2.0, "tree_accepted": 0.0, "tree_blocks": 0.0}
    measured = {**plain, "loss": 6.0, "streak": 3.0, "tree_accepted": 30.0, "tree_blocks": 16.0}
    both = window(plain, measured)
    assert both.mean(both.streak) == pytest.approx(5 / 4)  # per real batch of the window
    assert both.tree_streak() == pytest.approx(30 / 16)  # per sampled block, not per batch
    assert window(plain).tree_streak() is None  # no step of it measured one


def test_a_step_s_sums_reach_the_window_by_name() -> None:
    """What crosses the drafter group is packed by position; each field comes back under its name."""
    sums = StepSums.zeros(torch.device("cpu"))
    values = {field.name: float(index + 1) for index, field in enumerate(dataclasses.fields(sums))}
    for name, value in values.items():
        getattr(sums, name).fill_(value)
    step = StepOutput(sums, 0.0, torch.tensor(1.0), round=None, flops=torch.tensor(0))  # type: ignore[arg-type]
    window, counters = gather_window(None, [step, step], RankCounters(1, 2, 3, 4, 5, []))
    assert {name: getattr(window, name).tolist() for name in values} == {
        n: [v] * 2 for n, v in values.items()
    }
    assert window.step_losses == [1 / 4] * 2 and counters == [RankCounters(1, 2, 3, 4, 5, [])]


def test_a_step_s_sums_and_a_window_s_are_one_definition_of_the_summed_fields() -> None:
    """A field added to the step's sums cannot be missed by the window: both take the same fields (the
    same `Field` objects; dataclasses' fields compare by identity, so two copies would differ)."""
    assert dataclasses.fields(StepSums) == dataclasses.fields(WindowSums)


def test_a_copied_run_resumes_as_itself_and_changed_data_is_refused_or_recorded(
    tiny_lm_dir, tiny_conversations, tmp_path: Path, capsys, monkeypatch
) -> None:
    """`cp -r a b; dflash train b --resume`: b continues, a is untouched. Two words swapped in an
    answer (same lengths, same batch plan) are refused at resume naming the file and the way out;
    `train.allow_data_change` resumes and the run's record keeps the change."""
    data = tmp_path / "data.jsonl"
    data.write_bytes(Path(tiny_conversations).read_bytes())
    original = tmp_path / "a"
    Trainer(small_config(data, original, "train.max_steps=2", "train.save_every=1"), log=quiet).run()
    copy_dir = tmp_path / "b"
    shutil.copytree(original, copy_dir)
    before = sorted(path.name for path in checkpoint_root(original).iterdir())
    done = dflash(
        capsys, monkeypatch, "train", str(copy_dir), "train.max_steps=3", "train.reschedule=true", "--resume"
    )
    assert done.returncode == 0, done.stderr
    assert complete_checkpoints(checkpoint_root(copy_dir))[-1].name == "step_00000003"
    assert sorted(path.name for path in checkpoint_root(original).iterdir()) == before

    records = [json.loads(line) for line in data.read_text().splitlines()]
    answer = records[0]["messages"][-1]
    words = answer["content"].split(" ")
    words[3], words[4] = words[4], words[3]  # the same tokens in another order: the same batch plan
    answer["content"] = " ".join(words)
    data.write_text("".join(json.dumps(record) + "\n" for record in records))
    done = dflash(
        capsys, monkeypatch, "train", str(copy_dir), "train.max_steps=4", "train.reschedule=true", "--resume"
    )
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"dflash: error: {copy_dir}: cannot resume: the data differs from the run's last start "
        f"({data} changed); resume with the original data, or set train.allow_data_change=true to "
        "continue on the changed data (recorded in data_identity.json)"
    )
    resumed = [
        "train", str(copy_dir), "train.max_steps=4", "train.reschedule=true", "train.allow_data_change=true", "--resume"
    ]  # fmt: skip
    done = dflash(capsys, monkeypatch, *resumed)
    assert done.returncode == 0, done.stderr
    assert (
        f"warning: resuming on changed data, accepted by train.allow_data_change: {data} changed"
        in done.stdout
    )
    record = json.loads((copy_dir / "data_identity.json").read_text())
    assert [change["change"] for change in record["changes"]] == [f"{data} changed"]
    # the record now holds the changed data: the next resume on it is no change
    assert (
        dflash(
            capsys,
            monkeypatch,
            "train",
            str(copy_dir),
            "train.max_steps=5",
            "train.reschedule=true",
            "--resume",
        ).returncode
        == 0
    )
