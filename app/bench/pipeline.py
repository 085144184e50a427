"""`dflash bench pipeline CONFIG`: the training pipeline end to end against each of its stages alone.

Two fresh processes at the config's exact shapes, one after the other:
1. stages: one process on one device times the target forward over the run's own first target
   batches (its data, its length buckets and padding) and the drafter's optimizer step, compiled
   as training compiles it (from the baked cache when present);
2. pipeline: torchrun runs `dflash train` with the config's topology for `--steps` steps (on several
   nodes: the bench runs on each, joined by the rendezvous in the environment, like `entrypoint.sh train`).
From the run's metrics.jsonl after `telemetry.warmup_steps`: batches/s per role, tokens/s, queue
depths per rank, the share of time each target rank spent in its forward and each drafter rank
waited for features. A stage's capacity is its ranks / seconds per batch, and the pipeline cannot beat
its slowest stage, so efficiency = drafter batches/s measured / the slowest stage's capacity. A
colocated rank runs both stages in turn: its capacity is 1 / (target forward + drafter step).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.bench.child import emit, run_child
from app.config import RunConfig, load_config
from app.errors import UserError
from app.pipeline.launch import torchrun_options

if TYPE_CHECKING:
    import torch

    from app.pipeline.features import PackedForward

STAGE_STEPS = 10
"""Timed drafter steps of the stages process (after its warm-up)."""
TARGET_STAGE_BATCHES = 30
"""Target batches of the run's first epoch plan timed by the stages process (after one warm-up forward)."""


def run_pipeline_bench(
    config_path: str, overrides: list[str], steps: int, workdir: Path
) -> dict[str, Any] | None:
    """Both measurements and their comparison; the run directory is a fresh one under `workdir`.

    A multi-node topology runs with this node's rendezvous (`app.pipeline.launch`): the same command on
    every node, with the same NNODES and RDZV_ENDPOINT (or MASTER_ADDR, MASTER_PORT and NODE_RANK). The
    node of drafter rank 0 reports, with the stages measured on its own device (nodes alike); the
    others return None once their ranks are done."""
    config = load_config(config_path, [*overrides, f"train.max_steps={steps}"])
    topology = config.topology
    # First, before anything loads: a bad rendezvous is one line, a joining node waits for the host.
    launch = [sys.executable, "-m", "torch.distributed.run", *torchrun_options(topology, os.environ)]
    # On several nodes each runs its own bench (and may share the workdir): one run directory per node.
    suffix = f"-{socket.gethostname()}-{os.getpid()}" if topology.nnodes > 1 else ""
    run_dir = workdir.absolute() / (time.strftime("pipeline-%Y%m%d-%H%M%S") + suffix)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    print("=== stages alone (one process, one device)", flush=True)
    stages = run_child([sys.executable, "-m", "app.bench.pipeline", config_path, *overrides])
    if "failed" in stages:
        raise UserError(f"bench pipeline: the stages process failed ({stages['failed']})")
    print(f"=== pipeline: {_describe(config)} under torchrun, {steps} steps, in {run_dir}", flush=True)
    train_overrides = [
        *overrides,
        f"train.max_steps={steps}",
        f"train.output_dir={run_dir}",
        "train.eval_every=0",
        f"train.save_every={steps}",
        "telemetry.wandb=disabled",
    ]
    launch += ["-m", "app", "train", config_path]
    run_dir.mkdir()
    outcome = run_child([*launch, *train_overrides], log=run_dir / "torchrun.log")
    if "failed" in outcome:
        raise UserError(f"bench pipeline: the training job failed ({outcome['failed']})")
    if not (run_dir / "metrics.jsonl").exists() and topology.nnodes > 1:
        return None  # drafter rank 0, which logs, ran on another node: the report is that node's
    steady = steady_state(read_train_records(run_dir / "metrics.jsonl"), config.telemetry.warmup_steps)
    return {"config": config_path, "overrides": overrides, "topology": _describe(config),
            "stages": stages, "pipeline": steady, "capacity": stage_capacity(config, stages, steady)}  # fmt: skip


def measure_stages(config: RunConfig) -> dict[str, Any]:
    """The stages process: host preparation, target forward and drafter step alone, on this process's
    device, each compiled (or graphed) as training runs it."""
    import torch

    from app.compile.prepare import prepare_compiled_training
    from app.compile.warmup import time_training_steps
    from app.model.drafter import DFlashDrafter, DrafterArch
    from app.model.loading import pick_device
    from app.model.target import load_target
    from app.pipeline.features import eager_forward
    from app.train.step import DrafterStep

    device = pick_device(config.train.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    target = load_target(config, device)
    drafter = DFlashDrafter(DrafterArch.from_config(config, target), seed=config.train.seed, device=device)
    step = DrafterStep(config, drafter, target, device)
    report = prepare_compiled_training(config, step, print, target)
    timing = time_training_steps(config, step, target, steps=STAGE_STEPS)
    soft = config.train.soft_targets > 0
    forward = report.target_forward or eager_forward(target, final_hidden=soft)
    host_s, forward_s = time_run_batches(config, forward, device)
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "host_prepare_s": host_s,
        "target_forward_s": forward_s,
        "target_forward_full_batch_s": timing.target_forward_s,
        "drafter_step_s": timing.drafter_step_s,
        "compile": report.to_dict(),
    }


def time_run_batches(config: RunConfig, forward: PackedForward, device: torch.device) -> tuple[float, float]:
    """Mean seconds per batch over the first `TARGET_STAGE_BATCHES` batches of the run's epoch 0 plan
    (the shapes and padding the run's producers see, not a full batch): of their preparation on the
    host (collate, pack, index; a data thread's work in the run) and of the target's forward and gather
    onto the packed row (`forward`, the run's: eager or CUDA graphs)."""
    from app.compile.warmup import synchronize
    from app.data.batching import BatchPlanner, DataCursor
    from app.data.tokenize import pad_token_id
    from app.pipeline.features import features_on_device
    from app.pipeline.inputs import load_run_inputs
    from app.pipeline.prefetch import BatchPreparer

    inputs = load_run_inputs(config, with_target=False)  # the target is the caller's, on its device
    assert inputs.train_data is not None
    planner = BatchPlanner.from_config(inputs.train_data.lengths, config.data, config.train.seed)
    prepare = BatchPreparer(
        inputs.train_data, planner.shapes, token_budget=config.data.token_budget, anchors=config.train.anchors,
        pad_token_id=pad_token_id(inputs.tokenizer), seed=config.train.seed, device=device,
    )  # fmt: skip
    planned = list(itertools.islice(planner.batches(DataCursor(), 1), TARGET_STAGE_BATCHES))
    started = time.perf_counter()
    prepared = [prepare(batch) for batch in planned]
    host_s = (time.perf_counter() - started) / len(prepared)
    width = config.data.token_budget  # any: the timing keeps the whole packed output
    features_on_device(forward, prepared[0], device, width)  # untimed: a first call
    synchronize(device)
    started = time.perf_counter()
    for batch in prepared:
        features_on_device(forward, batch, device, width)
    synchronize(device)
    return host_s, (time.perf_counter() - started) / len(prepared)


def read_train_records(path: Path) -> list[dict[str, Any]]:
    """The training log records of a run's metrics.jsonl (eval records left out)."""
    if not path.is_file():
        raise UserError(f"{path}: no metrics; did the training job log anything?")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [record for record in records if "drafter_batch_counts" in record]


def steady_state(records: list[dict[str, Any]], warmup_steps: int) -> dict[str, Any]:
    """Rates between the first and the last log record after warm-up; queue depths averaged per rank.

    Batch counts, target forward seconds and drafter wait seconds are cumulative in each record, so
    differences over the window are exact; tokens/s and queue depths are per log window.
    """
    steady = [record for record in records if record["step"] > warmup_steps]
    if len(steady) < 2:
        logged = f"steps {records[0]['step']}-{records[-1]['step']}" if records else "nothing"
        raise UserError(
            f"bench pipeline: {len(steady)} log lines after telemetry.warmup_steps={warmup_steps} (the run "
            f"logged {logged}); raise --steps (and train.epochs) or lower telemetry.log_every"
        )
    first, last = steady[0], steady[-1]
    seconds = last["elapsed_s"] - first["elapsed_s"]

    def growth(field: str) -> list[float]:
        return [after - before for before, after in zip(first[field], last[field], strict=True)]

    windows = steady[1:]  # each covers its own log window; the first one's window reaches into warm-up
    return {
        "steps": [first["step"], last["step"]],
        "seconds": seconds,
        "drafter_batches_per_s": sum(growth("drafter_batch_counts")) / seconds,
        "target_batches_per_s": sum(growth("target_batch_counts")) / seconds,
        "tokens_per_s": statistics.fmean(record["tokens_per_s"] for record in windows),
        "drafter_batches_per_rank": growth("drafter_batch_counts"),
        "q_pre": _mean_per_rank(windows, "q_pre"),
        "q_hs": _mean_per_rank(windows, "q_hs"),
        "target_busy": [busy / seconds for busy in growth("target_forward_s")],
        "drafter_waiting": [waited / seconds for waited in growth("feature_wait_s")],
    }


def stage_capacity(config: RunConfig, stages: dict[str, Any], steady: dict[str, Any]) -> dict[str, Any]:
    """Batches/s each stage could sustain alone with this topology's ranks, and the efficiency."""
    topology = config.topology
    target_s, drafter_s = stages["target_forward_s"], stages["drafter_step_s"]
    if topology.target_ranks == 0:
        capacities = {"colocated": topology.drafter_ranks / (target_s + drafter_s)}
    else:
        capacities = {
            "target": topology.target_ranks / target_s,
            "drafter": topology.drafter_ranks / drafter_s,
        }
    slowest = min(capacities, key=capacities.__getitem__)
    return {
        "batches_per_s": capacities,
        "slowest_stage": slowest,
        "efficiency": steady["drafter_batches_per_s"] / capacities[slowest],
    }


def format_report(report: dict[str, Any]) -> str:
    stages, steady, capacity = report["stages"], report["pipeline"], report["capacity"]
    first, last = steady["steps"]
    lines = [
        f"pipeline {report['topology']}, {report['config']} on {stages['device']} (torch {stages['torch']})",
        f"stages alone: target forward {stages['target_forward_s'] * 1e3:.1f} ms/batch over the run's "
        f"first {TARGET_STAGE_BATCHES} batches ({stages['target_forward_full_batch_s'] * 1e3:.1f} ms over one "
        f"unpadded full batch), drafter step {stages['drafter_step_s'] * 1e3:.1f} ms/batch; host preparation "
        f"{stages['host_prepare_s'] * 1e3:.1f} ms/batch (a data thread's, overlapped in the run)",
        "capacity: "
        + ", ".join(f"{stage} {value:.2f} b/s" for stage, value in capacity["batches_per_s"].items()),
        f"end to end (steps {first}-{last}, {steady['seconds']:.1f}s): tgt={steady['target_batches_per_s']:.2f}b/s "
        f"dft={steady['drafter_batches_per_s']:.2f}b/s ({steady['tokens_per_s'] / 1e3:.1f}Ktok/s)",
        f"per drafter rank: {steady['drafter_batches_per_rank']} batches; "
        f"waiting for features {_percentages(steady['drafter_waiting'])} of the time",
        f"queues (mean): q_pre={_rounded(steady['q_pre'])} q_hs={_rounded(steady['q_hs'])}",
    ]
    if steady["target_busy"]:
        lines.append(f"target ranks in their forward: {_percentages(steady['target_busy'])} of the time")
    lines.append(
        f"efficiency: {capacity['efficiency']:.0%} of the slowest stage ({capacity['slowest_stage']}, "
        f"{capacity['batches_per_s'][capacity['slowest_stage']]:.2f} b/s)"
    )
    return "\n".join(lines)


def _describe(config: RunConfig) -> str:
    topology = config.topology
    nodes = f" on {topology.nnodes} nodes" if topology.nnodes > 1 else ""
    if topology.target_ranks == 0:
        return f"{topology.drafter_ranks} colocated rank{'s' if topology.drafter_ranks > 1 else ''}{nodes}"
    return f"{topology.target_ranks} target + {topology.drafter_ranks} drafter ranks{nodes}"


def _mean_per_rank(records: list[dict[str, Any]], field: str) -> list[float]:
    return [statistics.fmean(values) for values in zip(*(record[field] for record in records), strict=True)]


def _rounded(values: list[float]) -> str:
    return "[" + ",".join(f"{value:.1f}" for value in values) + "]"


def _percentages(values: list[float]) -> str:
    return "[" + ",".join(f"{value:.0%}" for value in values) + "]"


def main() -> None:
    """The stages process (run by `run_pipeline_bench`): prints its result line."""
    parser = argparse.ArgumentParser(description="Time the target forward and the drafter step alone.")
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    emit(measure_stages(load_config(args.config, args.overrides)))


if __name__ == "__main__":
    main()
