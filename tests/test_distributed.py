"""Multi-process training: roles, batch assignment, transport, failure handling, resume.

The end-to-end tests run the real `dflash train` under torchrun on CPU (gloo): 2 targets + 2 drafters
against the colocated trainer accumulating the same batches, a target killed mid-run, a resume of
that run on another topology, and 5 targets + 3 drafters over epochs that end in a partial round.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from app.checkpoint.store import checkpoint_root
from app.config import load_config
from app.config.schema import TopologyConfig
from app.data.batch import TargetBatch
from app.data.batching import BatchPlanner, DataCursor, PlannedBatch
from app.data.packing import pack_row
from app.data.shapes import TargetShapes
from app.errors import UserError
from app.pipeline.assignment import RoundPlanner
from app.pipeline.distributed import start_runtime
from app.pipeline.roles import layout_for
from app.pipeline.sidechannel import SideChannel, Watchdog
from app.pipeline.transport import decode_meta, encode_meta, sample_digest
from app.train.trainer import Trainer
from tests.helpers import SMALL
from tests.jobs import (
    CONFIG,
    KILL_RUN_STEPS,
    assert_resumed_like_the_reference,
    finish,
    logged_steps,
    one_thread,
    split,
    torchrun,
    worker_pid,
)

ROOT = Path(__file__).resolve().parents[1]


def quiet(line: str) -> None:
    pass


# ---- roles and assignment (no processes) --------------------------------------------------------------


def test_layout_gives_every_rank_one_role() -> None:
    topology = TopologyConfig(target_ranks=5, drafter_ranks=3, nproc_per_node=8)
    layouts = [layout_for(topology, rank, 8, rank) for rank in range(8)]
    assert [layout.role for layout in layouts] == ["drafter"] * 3 + ["target"] * 5
    assert [layout.index for layout in layouts] == [0, 1, 2, 0, 1, 2, 3, 4]
    assert [layout.is_logger for layout in layouts] == [True] + [False] * 7
    assert layouts[4].name == "target 1 (rank 4)"
    colocated = layout_for(TopologyConfig(drafter_ranks=2, nproc_per_node=2), 1, 2, 1)
    assert colocated.role == "colocated" and colocated.trains and colocated.target_ranks == ()
    with pytest.raises(UserError, match="torchrun started 4"):
        layout_for(topology, 0, 4, 0)


def test_a_multi_process_topology_outside_torchrun_is_a_one_line_error(monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    config = load_config(CONFIG, split(2, 2))
    with pytest.raises(UserError, match=r"topology: 4 processes configured; launch under torchrun"):
        start_runtime(config, quiet)


def test_rounds_keep_5_targets_and_3_drafters_balanced_and_see_every_sample_once_per_epoch() -> None:
    lengths = np.random.default_rng(0).integers(20, 250, size=400)
    planner = BatchPlanner(lengths, shapes=TargetShapes((64, 128, 256), 256, 8), bucket_window=64, seed=3)
    rounds = RoundPlanner(planner, drafters=3, grad_accum=1, targets=5)
    epochs = 2
    sizes = [len(planner.plan(epoch)) for epoch in range(epochs)]
    assert any(size % 3 for size in sizes), "the plan should end an epoch in a partial round"
    all_rounds = list(rounds.rounds(DataCursor(), epochs))
    assert len(all_rounds) == rounds.total_steps(epochs) == sum(-(-size // 3) for size in sizes)

    for epoch in range(epochs):
        batches = [batch for r in all_rounds if r.epoch == epoch for batch in r.real]
        samples = sorted(sample for batch in batches for sample in batch.sample_ids)
        assert samples == list(range(len(lengths)))  # each sample exactly once per epoch
        padded = [r for r in all_rounds if r.epoch == epoch and len(r.real) < 3]
        assert len(padded) == (1 if sizes[epoch] % 3 else 0)  # only the epoch's last round is short

    drafter_counts = np.zeros(3, dtype=int)
    for r in all_rounds:  # every drafter gets one slot per round, real except in an epoch's short round
        slots = [r.for_drafter(drafter, 3) for drafter in range(3)]
        assert all(len(slot) == 1 for slot in slots)
        drafter_counts += [slot[0] is not None for slot in slots]
    assert drafter_counts.max() - drafter_counts.min() <= epochs  # one short round per epoch at most
    deliveries = list(rounds.deliveries(DataCursor(), epochs, len(all_rounds)))
    assert [d.batch for d in deliveries] == [b for r in all_rounds for b in r.real]
    target_counts = np.bincount([d.target for d in deliveries], minlength=5)
    assert target_counts.max() - target_counts.min() <= epochs  # i mod 5 restarts each epoch
    assert set(d.drafter for d in deliveries) == {0, 1, 2}

    # A resumed run continues with exactly the rounds the uninterrupted one would have trained.
    resumed = list(rounds.rounds(all_rounds[7].next_cursor, epochs))
    assert resumed == all_rounds[8:]


def test_meta_message_round_trips_the_packed_row() -> None:
    batch = TargetBatch(
        input_ids=torch.tensor([[5, 6, 7, 8, 0], [9, 10, 11, 12, 13]]),
        attention_mask=torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]),
        loss_mask=torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.bool),
        sample_ids=torch.tensor([4, 2]),
    )
    row = pack_row(batch, token_budget=128, anchors=4, pad_token_id=0, seed=1, epoch=2, index=9)
    header, decoded = decode_meta(encode_meta(PlannedBatch(2, 9, [4, 2]), row, 9), 128, 4)
    assert header == {"version": 1, "epoch": 2, "index": 9, "digest": sample_digest([4, 2]), "real_tokens": 9}
    for name in (
        "input_ids",
        "position_ids",
        "document_ids",
        "loss_mask",
        "anchor_positions",
        "anchor_valid",
    ):
        assert torch.equal(getattr(decoded, name), getattr(row, name)), name
        assert getattr(decoded, name).dtype == getattr(row, name).dtype, name
    assert sample_digest([2, 4]) != sample_digest([4, 2])


def test_watchdog_brings_the_job_down_naming_a_silent_rank() -> None:
    """Rank 1 never heartbeats: rank 0's watchdog records it as the failure; rank 2 learns it from the store."""
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )

    def channel() -> SideChannel:
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
        return SideChannel(dist.PrefixStore("job/", client))

    topology = TopologyConfig(target_ranks=1, drafter_ranks=2, nproc_per_node=3)
    exits: dict[int, int] = {}
    lines: list[str] = []
    watchdogs = [
        Watchdog(
            layout_for(topology, rank, 3, rank),
            channel(),
            lines.append,
            timeout_s=1.0,
            interval_s=0.05,
            grace_s=0.1,
            exit_process=lambda code, rank=rank: exits.setdefault(rank, code),
        ).start()
        for rank in (0, 2)
    ]
    deadline = time.monotonic() + 20
    while len(exits) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    for watchdog in watchdogs:
        watchdog.stop()
    assert exits == {0: 1, 2: 1}
    failure = channel().failure()
    assert failure is not None and failure["rank"] == 1 and "no heartbeat" in failure["cause"]
    assert any("drafter 1 (rank 1) failed: no heartbeat" in line for line in lines)


def test_watchdog_ignores_a_rank_that_left_on_purpose() -> None:
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
    side = SideChannel(dist.PrefixStore("job/", client))
    side.mark_left(1)
    exits: list[int] = []
    layout = layout_for(TopologyConfig(drafter_ranks=2, nproc_per_node=2), 0, 2, 0)
    watchdog = Watchdog(
        layout, side, quiet, timeout_s=0.3, interval_s=0.05, exit_process=exits.append
    ).start()
    time.sleep(1.0)
    watchdog.stop()
    assert exits == [] and side.failure() is None


def test_colocated_accumulation_pads_each_epochs_last_round(
    tiny_lm_dir, small_conversations, tmp_path
) -> None:
    """grad_accum=3 over 5-batch epochs: rounds of 3 + 2 (one padding slot), every batch trained once."""
    config = load_config(
        CONFIG,
        [*SMALL, f"data.train_files=['{small_conversations}']", f"train.output_dir={tmp_path}",
         "train.epochs=2", "train.grad_accum=3"],
    )  # fmt: skip
    trainer = Trainer(config, log=quiet)
    sizes = [len(trainer.planner.plan(epoch)) for epoch in range(2)]
    assert sizes == [5, 5]
    result = trainer.run()
    assert result.steps == trainer.total_steps == 4
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["drafter_batch_counts"] == [10] and last["target_batch_counts"] == [10]
    assert all(np.isfinite(result.losses))
    assert trainer.cursor == DataCursor(2, 0)


# ---- torchrun, end to end -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_conversations(tiny_conversations, tmp_path_factory) -> Path:
    """13 records (9 train after the 4 held out): 5 target batches per epoch at the SMALL shapes."""
    path = tmp_path_factory.mktemp("small") / "train.jsonl"
    path.write_text("\n".join(tiny_conversations.read_text().splitlines()[:13]) + "\n")
    return path


@pytest.fixture(scope="module")
def killed_split_run(tiny_lm_dir, tiny_conversations, tmp_path_factory) -> dict:
    """2 targets + 2 drafters under torchrun; target 1 (rank 3) is SIGKILLed once step 2 is logged."""
    run_dir = tmp_path_factory.mktemp("split")
    log = run_dir.parent / f"{run_dir.name}.log"
    overrides = [
        *SMALL, f"data.train_files=['{tiny_conversations}']", f"train.output_dir={run_dir}",
        f"train.max_steps={KILL_RUN_STEPS}", "train.save_every=1", "train.keep_last=100",
        "topology.feature_queue=1", "topology.prefetch_batches=1", *split(2, 2),
    ]  # fmt: skip
    agent = torchrun(4, overrides, log)
    deadline = time.monotonic() + 500
    while not logged_steps(run_dir) or logged_steps(run_dir)[-1]["step"] < 2:
        assert agent.poll() is None, f"the job ended before step 2:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, "no step 2 within 500 s"
        time.sleep(0.05)
    os.kill(worker_pid(agent, 3), signal.SIGKILL)
    killed_at = time.monotonic()
    output = finish(agent, log, timeout=120)
    return {
        "run_dir": run_dir,
        "overrides": overrides,
        "returncode": agent.returncode,
        "exit_seconds": time.monotonic() - killed_at,
        "output": output,
    }


@pytest.mark.slow
def test_torchrun_of_two_on_a_one_process_topology_is_refused(tmp_path: Path) -> None:
    """Every rank would train alone into the one run dir (steps 1, 1, 2, 2, ... in its metrics): each
    refuses in one line, before any data or model loads, and nothing is written. (The first rank to
    exit makes torchrun stop the other, which may be gone before it prints its line.)"""
    run_dir = tmp_path / "run"
    log = tmp_path / "torchrun.log"
    output = finish(torchrun(2, [f"train.output_dir={run_dir}"], log), log, timeout=300)
    assert 1 <= output.count("dflash: error: topology: the config lays out 1 processes") <= 2, output
    assert "but torchrun started 2" in output
    assert f'File "{ROOT / "app"}' not in output  # no traceback through our code (torchrun prints its own)
    assert not run_dir.exists()


def test_split_2_plus_2_trains_the_batches_of_the_colocated_accumulating_trainer(
    killed_split_run, accumulation_reference
) -> None:
    """Same data and seed: the first optimizer step's loss and gradients (AdamW's exp_avg = 0.1 x the
    clipped gradient) and weights are bit-identical to colocated grad_accum=2."""
    split_dir = killed_split_run["run_dir"]
    split_steps = logged_steps(split_dir)
    reference_steps = logged_steps(accumulation_reference)
    assert split_steps[0]["loss"] == reference_steps[0]["loss"]
    assert split_steps[0]["drafter_batch_counts"] == [1, 1] and split_steps[0]["target_batch_counts"][0] >= 1
    step_1 = "checkpoints/step_00000001"
    split_state = torch.load(split_dir / step_1 / "optimizer.pt", weights_only=True)["state"]
    reference_state = torch.load(accumulation_reference / step_1 / "optimizer.pt", weights_only=True)["state"]
    for index, state in reference_state.items():
        assert torch.equal(split_state[index]["exp_avg"], state["exp_avg"]), index
    split_weights = load_file(split_dir / step_1 / "model.safetensors")
    for name, weight in load_file(accumulation_reference / step_1 / "model.safetensors").items():
        assert torch.equal(split_weights[name], weight), name


@pytest.mark.slow
def test_killing_a_target_brings_every_rank_down_naming_it(killed_split_run) -> None:
    output = killed_split_run["output"]
    assert killed_split_run["returncode"] != 0
    assert killed_split_run["exit_seconds"] < 60
    root_cause = output[output.index("Root Cause") :]
    # The other ranks leave no error file: it would date them by when they raised, which torchrun can
    # put before the killed rank's exit (then a follower is named the root cause)
    followers = output[output.index("Failures:") : output.index("Root Cause")]
    assert followers.count("error_file: <N/A>") == followers.count("rank      :") > 0, followers
    assert re.search(r"rank\s*:\s*3 \(local_rank: 3\)", root_cause), root_cause
    assert "Signal 9 (SIGKILL)" in root_cause
    assert "target 1 (rank 3)" in output  # our own role names appear in the job's log


@pytest.mark.slow
def test_resume_after_the_killed_run_on_another_topology_ends_like_the_reference(
    killed_split_run, accumulation_reference
) -> None:
    """The cursor is global: 1 target + 1 drafter accumulating 2 batches resumes the 2+2 run's rounds."""
    run_dir = killed_split_run["run_dir"]
    resumed_from = max(int(path.name.split("_")[1]) for path in checkpoint_root(run_dir).glob("step_*"))
    assert 2 <= resumed_from < KILL_RUN_STEPS
    overrides = [*killed_split_run["overrides"][: -len(split(2, 2))], "train.grad_accum=2", *split(1, 1)]
    log = run_dir.parent / f"{run_dir.name}-resume.log"
    output = finish(torchrun(2, overrides, log, "--resume"), log)
    assert f"resumed from {checkpoint_root(run_dir) / f'step_{resumed_from:08d}'}" in output, output[-3000:]
    assert_resumed_like_the_reference(run_dir, resumed_from, accumulation_reference)


@pytest.mark.slow
def test_3_targets_feed_2_drafters_through_partial_rounds(tiny_lm_dir, small_conversations, tmp_path) -> None:
    """Two 5-batch epochs on 3 targets + 2 drafters: rounds of 2 + 2 + 1 (drafter 1 trains a zero-loss
    padding batch in the last), the targets take the batches in turn (2, 2, 1 per epoch), and the
    losses are those of colocated grad_accum=2. (The production 5 + 3 split's rounds are pinned without
    processes in tests/test_multinode.py; 8 torchrun workers here cost over a CPU-minute.)"""
    overrides = [*SMALL, f"data.train_files=['{small_conversations}']", "train.epochs=2"]
    run_dir = tmp_path / "split"
    log = tmp_path / "split.log"
    output = finish(torchrun(5, [*overrides, f"train.output_dir={run_dir}", *split(3, 2)], log), log)
    steps = logged_steps(run_dir)
    assert [step["step"] for step in steps] == [1, 2, 3, 4, 5, 6], output[-3000:]
    assert [step["drafter_batch_counts"] for step in steps] == [
        [1, 1],
        [2, 2],
        [3, 2],
        [4, 3],
        [5, 4],
        [6, 4],
    ]
    assert [step["target_batch_counts"] for step in steps][2::3] == [[2, 2, 1], [4, 4, 2]]  # each epoch's end
    assert len(steps[-1]["q_pre"]) == 3 and len(steps[-1]["q_hs"]) == 2

    reference = load_config(
        CONFIG, [*overrides, f"train.output_dir={tmp_path / 'reference'}", "train.grad_accum=2"]
    )
    reference_losses = one_thread(lambda: Trainer(reference, log=quiet).run()).losses
    assert [step["loss"] for step in steps] == pytest.approx(reference_losses, rel=1e-5)
