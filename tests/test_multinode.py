"""Beyond one box: role placement over nodes, who feeds whom, and real two-node jobs on one machine.

The end-to-end tests run two torchrun agents (two "nodes" of 2 processes each) that meet at a c10d
rendezvous on 127.0.0.1, gloo on CPU, with 3 targets + 1 drafter: node 0 runs drafter 0 and target 0,
node 1 targets 1 and 2, so two of the three targets feed the drafter across the node boundary. The
run trains bit for bit what the one-process reference trains (the single-node split is proven equal
to it in tests/test_distributed.py), node 1 is killed whole after step 2 and brings node 0 down
naming it, and the run resumes on one node of 4 processes to end like the reference. A second
two-node job, 2 targets + 2 drafters (one of each per node), has its drafters on both nodes: their
gradients average across the node boundary, and it trains what the reference trains too.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from app.checkpoint.store import checkpoint_root
from app.config import load_config
from app.config.schema import TopologyConfig
from app.data.batching import BatchPlanner, DataCursor
from app.data.shapes import TargetShapes
from app.errors import UserError
from app.pipeline.assignment import Feeding, RoundPlanner
from app.pipeline.launch import Endpoint, torchrun_options, wait_until_reachable
from app.pipeline.roles import layout_for, layout_from_environment
from tests.datagen_server import free_port
from tests.helpers import SMALL
from tests.jobs import (
    CONFIG,
    KILL_RUN_STEPS,
    ROOT,
    agent,
    assert_resumed_like_the_reference,
    finish,
    kill_node,
    logged_steps,
    split,
    torchrun,
    workers,
)

# ---- placement and feeding (no processes) -------------------------------------------------------------


def test_placement_spreads_the_drafters_over_the_nodes_in_rank_order() -> None:
    def placed(targets: int, drafters: int, nodes: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        topology = TopologyConfig(
            target_ranks=targets,
            drafter_ranks=drafters,
            nnodes=nodes,
            nproc_per_node=(targets + drafters) // nodes,
        )
        layout = layout_for(topology, 0, targets + drafters, 0)
        return layout.drafter_ranks, layout.target_ranks

    assert placed(5, 3, 1) == ((0, 1, 2), (3, 4, 5, 6, 7))  # one node: as it always was
    assert placed(10, 6, 2) == ((0, 1, 2, 8, 9, 10), (3, 4, 5, 6, 7, 11, 12, 13, 14, 15))
    assert placed(3, 1, 2) == ((0,), (1, 2, 3))
    assert placed(1, 3, 2) == ((0, 1, 2), (3,))  # node 0 takes the remainder first

    topology = TopologyConfig(target_ranks=10, drafter_ranks=6, nnodes=2, nproc_per_node=8)
    layouts = [layout_for(topology, rank, 16, rank % 8) for rank in range(16)]
    assert [layout.node for layout in layouts] == [0] * 8 + [1] * 8
    assert [layout.role[0] for layout in layouts] == list("dddtttttdddttttt")
    assert [layout.index for layout in layouts] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4, 5, 5, 6, 7, 8, 9]
    assert [layout.is_logger for layout in layouts] == [True] + [False] * 15
    assert layouts[0].drafter_nodes == (0, 0, 0, 1, 1, 1)
    assert layouts[0].target_nodes == (0,) * 5 + (1,) * 5
    assert layouts[11].name == "target 5 (rank 11, node 1)"


def planner(batches: int = 400) -> BatchPlanner:
    lengths = np.random.default_rng(0).integers(20, 250, size=batches)
    return BatchPlanner(lengths, shapes=TargetShapes((64, 128, 256), 256, 8), bucket_window=64, seed=3)


def test_each_node_feeds_its_own_drafters_when_the_nodes_run_the_same_split() -> None:
    """10 targets + 6 drafters on 2 nodes of 5 + 3: no batch leaves its node, every target produces
    its share; on one node the producer of batch i is target i mod T, as it always was."""
    topology = TopologyConfig(target_ranks=10, drafter_ranks=6, nnodes=2, nproc_per_node=8)
    layout = layout_for(topology, 0, 16, 0)
    rounds = RoundPlanner.for_layout(planner(), layout, grad_accum=2)
    deliveries = list(rounds.deliveries(DataCursor(), 2, rounds.total_steps(2)))
    assert all(layout.target_nodes[d.target] == layout.drafter_nodes[d.drafter] for d in deliveries)
    counts = np.bincount([d.target for d in deliveries], minlength=10)
    assert counts.max() - counts.min() <= 2 * 2, counts  # balanced up to each epoch's short round
    assert {d.drafter for d in deliveries} == set(range(6))
    assert "0 of 30 pairs cross nodes: 0.00 of 12 batches per step" in rounds.feeding.describe(256, 128, 2)

    one_node = RoundPlanner(planner(), drafters=3, grad_accum=1, targets=5)
    assert all(d.target == d.batch.index % 5 for d in one_node.deliveries(DataCursor(), 2, 10**6))


def test_a_node_short_of_targets_is_fed_evenly_by_the_others() -> None:
    """3 targets + 1 drafter on 2 nodes of 2: node 0's target 0 takes its third of the batches, spread
    over the cycle; targets 1 and 2 on node 1 take the rest in turn."""
    feeding = Feeding.build(drafter_nodes=(0,), target_nodes=(0, 1, 1), size=2)
    assert feeding.cycle == ((1, 2), (0, 1), (2, 0))
    assert feeding.pairs() == {(0, 0): 2, (1, 0): 2, (2, 0): 2}
    assert feeding.describe(256, 128, 4) == (
        "features: node 0 = drafters 0 + targets 0 | node 1 = drafters none + targets 1,2; feeding t0->d0 "
        "t1->d0 t2->d0; 2 of 3 pairs cross nodes: 1.33 of 2 batches per step, 0.17 MB per step across "
        "nodes (256 tokens x 128 (K x hidden) x 4 B per batch)"
    )
    spread = Feeding.build(drafter_nodes=(0, 0, 1), target_nodes=(0, 1, 1, 1, 1), size=3)
    shares = np.bincount([t for row in spread.cycle for t in row], minlength=5)
    assert shares.tolist() == [3, 3, 3, 3, 3]
    assert all(t != 0 for row in spread.cycle for t in row[2:])  # node 1's drafter: its own targets only


def test_torchrun_of_another_node_shape_is_refused(monkeypatch) -> None:
    """4 processes started as 1 node x 2 by 2 agents would be placed as another layout: refused."""
    topology = TopologyConfig(target_ranks=1, drafter_ranks=1, nnodes=2, nproc_per_node=1)
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "GROUP_WORLD_SIZE": "1",
                        "LOCAL_WORLD_SIZE": "2"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    with pytest.raises(UserError) as refused:
        layout_from_environment(topology)
    assert str(refused.value) == (
        "topology: the config lays out nnodes 2 x nproc_per_node 1 but torchrun started 1 node x 2 "
        "(GROUP_WORLD_SIZE=1, LOCAL_WORLD_SIZE=2); launch `torchrun --nnodes 2 --nproc-per-node 1` on each "
        "of the 2 nodes with one rendezvous (entrypoint.sh train does, from NNODES and RDZV_ENDPOINT)"
    )
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert layout_from_environment(topology).role == "drafter"


@pytest.mark.parametrize(
    ("name", "value", "least"),
    [("WORLD_SIZE", "abc", 1), ("RANK", "1.5", 0), ("LOCAL_RANK", "-1", 0), ("LOCAL_WORLD_SIZE", "", 1),
     ("GROUP_WORLD_SIZE", "0", 1)],
)  # fmt: skip
def test_a_torchrun_variable_that_is_no_integer_is_named(
    monkeypatch, name: str, value: str, least: int
) -> None:
    """Read with a bare int() these were a ValueError traceback; now one line naming the variable."""
    monkeypatch.setenv(name, value)
    with pytest.raises(UserError) as refused:
        layout_from_environment(TopologyConfig())
    assert str(refused.value) == (
        f"{name}={value}: expected an integer >= {least} (torchrun sets it in each process it starts; "
        f"outside torchrun, unset {name})"
    )


def test_every_batch_reaches_the_drafter_whose_round_slot_holds_it() -> None:
    """Epochs of many more rounds than drafters, 2 micro-batches per drafter: the deliveries a drafter
    rank keeps (the receive thread filters by `drafter`) are exactly its slots of every round, in its
    training order, on one node and on two."""
    two_nodes = layout_for(
        TopologyConfig(target_ranks=10, drafter_ranks=6, nnodes=2, nproc_per_node=8), 0, 16, 0
    )
    for rounds in (
        RoundPlanner(planner(), drafters=3, grad_accum=2, targets=5),
        RoundPlanner.for_layout(planner(), two_nodes, grad_accum=2),
    ):
        drafters = rounds.drafters
        every = list(rounds.rounds(DataCursor(), 2))
        assert len([r for r in every if r.epoch == 0]) > drafters
        deliveries = list(rounds.deliveries(DataCursor(), 2, len(every)))
        for drafter in range(drafters):
            kept = [d.batch for d in deliveries if d.drafter == drafter]
            assert kept == [b for r in every for b in r.for_drafter(drafter, drafters) if b is not None]


def test_every_node_checks_its_own_process_count_against_the_config(monkeypatch) -> None:
    """2 nodes x 2 configured, started as agents of 3 and 1 processes (torchrun lets agents differ):
    the world size and the node count match, the placement would not; every rank on either node
    refuses, not only rank 0's node."""
    topology = TopologyConfig(target_ranks=2, drafter_ranks=2, nnodes=2, nproc_per_node=2)
    for rank, local_rank, per_node in [(0, 0, 3), (2, 2, 3), (3, 0, 1)]:
        for name, value in {"RANK": rank, "WORLD_SIZE": 4, "LOCAL_RANK": local_rank, "GROUP_WORLD_SIZE": 2,
                            "LOCAL_WORLD_SIZE": per_node}.items():  # fmt: skip
            monkeypatch.setenv(name, str(value))
        with pytest.raises(
            UserError, match=rf"but torchrun started 2 nodes x {per_node} \(GROUP_WORLD_SIZE=2, "
        ):
            layout_from_environment(topology)


# ---- two torchrun agents, end to end ------------------------------------------------------------------


@pytest.mark.slow
def test_one_agent_started_for_a_two_node_config_is_refused_on_every_rank(tmp_path: Path) -> None:
    """The real torchrun sets the node shape: `--nnodes 1 --nproc-per-node 2` for 2 nodes x 1."""
    run_dir = tmp_path / "run"
    log = tmp_path / "torchrun.log"
    overrides = [f"train.output_dir={run_dir}", *split(1, 1, nodes=2)]
    output = finish(torchrun(2, overrides, log), log, timeout=300)
    refusal = "dflash: error: topology: the config lays out nnodes 2 x nproc_per_node 1 but torchrun started 1 node x 2"
    assert 1 <= output.count(refusal) <= 2, output  # the first to exit may stop the other before it prints
    assert f'File "{ROOT / "app"}' not in output  # no traceback through our code (torchrun prints its own)
    assert not run_dir.exists()


@pytest.fixture(scope="module")
def two_node_run(tiny_lm_dir, tiny_conversations, tmp_path_factory) -> dict:
    """3 targets + 1 drafter accumulating 2 batches, on 2 nodes x 2; node 1 (its agent and both workers)
    is SIGKILLed once step 2 is logged."""
    run_dir = tmp_path_factory.mktemp("two-nodes")
    logs = [run_dir.parent / f"{run_dir.name}-node{node}.log" for node in (0, 1)]
    overrides = [
        *SMALL, f"data.train_files=['{tiny_conversations}']", f"train.output_dir={run_dir}",
        f"train.max_steps={KILL_RUN_STEPS}", "train.grad_accum=2", "train.save_every=1", "train.keep_last=100",
        "topology.feature_queue=1", "topology.prefetch_batches=1", *split(3, 1, nodes=2),
    ]  # fmt: skip
    port = free_port()
    rendezvous = {"NNODES": "2", "RDZV_ENDPOINT": f"127.0.0.1:{port}", "RDZV_ID": run_dir.name}
    options = torchrun_options(load_config(CONFIG, overrides).topology, rendezvous)
    node_0 = agent(options, overrides, logs[0])
    # node 0 hosts the rendezvous (the first agent binds it) and is node rank 0 (ranked by pid)
    wait_until_reachable(Endpoint("127.0.0.1", port, "test"), wait_s=120)
    node_1 = agent(options, overrides, logs[1])
    deadline = time.monotonic() + 500
    while not logged_steps(run_dir) or logged_steps(run_dir)[-1]["step"] < 2:
        for node, process in enumerate((node_0, node_1)):
            assert process.poll() is None, (
                f"node {node} ended before step 2:\n{logs[node].read_text()[-4000:]}"
            )
        assert time.monotonic() < deadline, "no step 2 within 500 s"
        time.sleep(0.05)
    ranks = (sorted(workers(node_0)), sorted(workers(node_1)))
    kill_node(node_1)
    killed_at = time.monotonic()
    output = finish(node_0, logs[0], timeout=120)
    return {
        "run_dir": run_dir,
        "overrides": overrides,
        "options": options,
        "endpoint": rendezvous["RDZV_ENDPOINT"],
        "ranks": ranks,
        "returncode": node_0.returncode,
        "exit_seconds": time.monotonic() - killed_at,
        "output": output,
        "node_1_output": logs[1].read_text(),
    }


@pytest.mark.slow
def test_the_header_says_where_each_role_runs_and_what_crosses_nodes(two_node_run) -> None:
    assert two_node_run["options"] == [
        *("--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d"),
        *("--rdzv-endpoint", two_node_run["endpoint"], "--rdzv-id", two_node_run["run_dir"].name),
    ]
    assert two_node_run["ranks"] == ([0, 1], [2, 3])
    output, node_1 = two_node_run["output"], two_node_run["node_1_output"]
    # tiny-lm: hidden 128, one tapped layer (K = drafter.num_layers = 1), fp32 on CPU
    assert (
        "features: node 0 = drafters 0 + targets 0 | node 1 = drafters none + targets 1,2; feeding t0->d0 "
        "t1->d0 t2->d0; 2 of 3 pairs cross nodes: 1.33 of 2 batches per step, 0.17 MB per step across "
        "nodes (256 tokens x 128 (K x hidden) x 4 B per batch)"
    ) in output
    assert (
        "[target 0 (rank 1, node 0)] producing for 30 steps from epoch 0 batch 0 on node 0, for drafter 0"
        in output
    )
    assert (
        "[target 2 (rank 3, node 1)] producing for 30 steps from epoch 0 batch 0 on node 1, for drafter 0"
        in node_1
    )


@pytest.mark.slow
def test_two_nodes_train_what_one_process_trains(two_node_run, accumulation_reference) -> None:
    """Every checkpoint the two-node run wrote before the kill, weights and AdamW moments, and its
    losses are bit-identical to the reference's (features crossing nodes change nothing)."""
    run_dir = two_node_run["run_dir"]
    steps = logged_steps(run_dir)
    reference = logged_steps(accumulation_reference)
    assert len(steps) >= 2 and [s["loss"] for s in steps] == [s["loss"] for s in reference[: len(steps)]]
    # what the drafter received from each target: rounds 0 and 1 of the feeding cycle ((1, 2), (0, 1))
    assert [s["target_batch_counts"] for s in steps[:2]] == [[0, 1, 1], [1, 2, 1]]
    saved = sorted(checkpoint_root(run_dir).glob("step_*"))
    assert len(saved) >= 2
    for checkpoint in saved:
        mine = load_file(checkpoint / "model.safetensors")
        for name, weight in load_file(
            accumulation_reference / "checkpoints" / checkpoint.name / "model.safetensors"
        ).items():
            assert torch.equal(mine[name], weight), (checkpoint.name, name)
        state = torch.load(checkpoint / "optimizer.pt", weights_only=True)["state"]
        expected = torch.load(
            accumulation_reference / "checkpoints" / checkpoint.name / "optimizer.pt", weights_only=True
        )
        for index, moments in expected["state"].items():
            assert torch.equal(state[index]["exp_avg_sq"], moments["exp_avg_sq"]), (checkpoint.name, index)


@pytest.mark.slow
def test_a_dead_node_brings_the_other_down_naming_it(two_node_run) -> None:
    """Within the bound of one node's test (a killed target, tests/test_distributed.py), and the log
    of the surviving node says which rank of the lost node failed."""
    output = two_node_run["output"]
    assert two_node_run["returncode"] != 0
    assert two_node_run["exit_seconds"] < 60
    assert re.search(r"target [12] \(rank [23], node 1\) failed", output), output[-4000:]


@pytest.mark.slow
def test_resume_on_one_node_after_the_dead_node_ends_like_the_reference(
    two_node_run, accumulation_reference
) -> None:
    """The same 3 + 1 layout on one node of 4 processes continues the two-node run exactly."""
    run_dir = two_node_run["run_dir"]
    resumed_from = max(int(path.name.split("_")[1]) for path in checkpoint_root(run_dir).glob("step_*"))
    assert 2 <= resumed_from < KILL_RUN_STEPS
    overrides = [*two_node_run["overrides"][: -len(split(3, 1, nodes=2))], *split(3, 1)]
    log = run_dir.parent / f"{run_dir.name}-resume.log"
    output = finish(torchrun(4, overrides, log, "--resume"), log)
    assert f"resumed from {checkpoint_root(run_dir) / f'step_{resumed_from:08d}'}" in output, output[-3000:]
    assert (
        "node 0 = drafters 0 + targets 0,1,2; feeding t0->d0 t1->d0 t2->d0; 0 of 3 pairs cross nodes"
        in output
    )
    assert_resumed_like_the_reference(run_dir, resumed_from, accumulation_reference)


@pytest.mark.slow
def test_drafters_on_both_nodes_average_their_gradients_across_them(
    tiny_lm_dir, tiny_conversations, tmp_path: Path, accumulation_reference
) -> None:
    """2 + 2 on 2 nodes x 2: drafter 0 (node 0) and drafter 1 (node 1) each train one batch a step
    from their own node's target, DDP all-reduces across the nodes: the weights and losses of the
    first steps are bit-identical to the one-process run accumulating 2 batches a step (the same
    schedule: the job is stopped once they are written)."""
    steps = 3
    run_dir = tmp_path / "run"
    overrides = [
        *SMALL, f"data.train_files=['{tiny_conversations}']", f"train.output_dir={run_dir}",
        f"train.max_steps={KILL_RUN_STEPS}", "train.save_every=1", "train.keep_last=100", *split(2, 2, nodes=2),
    ]  # fmt: skip
    port = free_port()
    rendezvous = {"NNODES": "2", "RDZV_ENDPOINT": f"127.0.0.1:{port}", "RDZV_ID": run_dir.name}
    options = torchrun_options(load_config(CONFIG, overrides).topology, rendezvous)
    logs = [tmp_path / f"node{node}.log" for node in (0, 1)]
    nodes = [agent(options, overrides, logs[0])]
    wait_until_reachable(Endpoint("127.0.0.1", port, "test"), wait_s=120)
    nodes.append(agent(options, overrides, logs[1]))
    deadline = time.monotonic() + 300
    while len(logged_steps(run_dir)) < steps or not (checkpoint_root(run_dir) / f"step_{steps:08d}").is_dir():
        assert all(node.poll() is None for node in nodes), logs[0].read_text()[-4000:]
        assert time.monotonic() < deadline, f"no step {steps} within 300 s"
        time.sleep(0.05)
    for node in nodes:
        kill_node(node)
    assert "0 of 2 pairs cross nodes" in logs[0].read_text()  # each node feeds its own drafter
    reference = logged_steps(accumulation_reference)
    assert [s["loss"] for s in logged_steps(run_dir)[:steps]] == [s["loss"] for s in reference[:steps]]
    for step in range(1, steps + 1):
        name = f"step_{step:08d}"
        mine = load_file(checkpoint_root(run_dir) / name / "model.safetensors")
        for key, weight in load_file(
            accumulation_reference / "checkpoints" / name / "model.safetensors"
        ).items():
            assert torch.equal(mine[key], weight), (name, key)
