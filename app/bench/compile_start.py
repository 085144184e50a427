"""Process start -> first optimizer step, cold (no cache) vs warm (baked cache, empty inductor dir).

    python -m app.bench.compile_start run CONFIG [overrides] --workdir DIR [--steps 100]
        [--cold-starts 1] [--warm-starts 3] [--out FILE]

Fresh processes, one after the other, each on the config's exact shapes:
1. cold: no baked cache, an empty inductor dir (what the incident's restart looked like); with
   `--cold-starts` N, N of them (`cold`, `cold2`, ...), each into the emptied dir;
2. build: `dflash build-cache` into DIR/compile_cache, compiling in DIR/inductor;
3. warm: the baked cache loaded into DIR/inductor emptied (a fresh container: the path the build
   compiled in, nothing in it), then `--steps` steady-state steps under the fail_on_recompile stance,
   each on a new packed row (new documents and anchors);
4. `--warm-starts` - 1 more warm starts, each into DIR/inductor emptied again.
The ratio is median warm / median cold: single starts vary (cold ones by 10 s and more on a 16-core
host, with inductor's compile workers).
Each start process builds what the trainer builds (target, drafter, fused AdamW), calls
`prepare_compiled_training`, and times until its first optimizer step has finished on the GPU.
Context features come from real target forwards of random tokens: one before the first step (as the
trainer's first batch), a second one after it; the steady-state steps alternate between the two (the
recompile question does not depend on their values). Prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.bench.child import emit, run_child
from app.errors import UserError

if TYPE_CHECKING:
    import torch

    from app.config import RunConfig
    from app.model.target import TargetModel
    from app.train.step import DrafterStep

SPAWNED_AT = "DFLASH_BENCH_SPAWNED_AT"
FEATURE_POOL = 2


def main() -> None:
    args = build_parser().parse_args()
    try:
        run_phase(args)
    except UserError as error:
        print(f"compile_start: error: {error}", file=sys.stderr)
        sys.exit(2)


def run_phase(args: argparse.Namespace) -> None:
    if args.phase == "start":
        emit(run_start(args.config, args.overrides, args.steps))
    elif args.phase == "build":
        emit(run_build(args.config, args.overrides))
    else:
        orchestrate(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "phase", choices=["run", "start", "build"], help="run: all three; start/build: one child process."
    )
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument(
        "--workdir", type=Path, required=True, help="Persistent scratch dir (not under /tmp)."
    )
    parser.add_argument("--steps", type=int, default=100, help="Steady-state steps of the warm run.")
    parser.add_argument("--cold-starts", type=int, default=1, help="Cold starts to take the median of.")
    parser.add_argument("--warm-starts", type=int, default=3, help="Warm starts to take the median of.")
    parser.add_argument("--out", type=Path, help="Also write the results as JSON here.")
    return parser


def orchestrate(args: argparse.Namespace) -> None:
    workdir = check_inputs(args)
    workdir.mkdir(parents=True, exist_ok=True)
    cold_inductor, inductor = workdir / "inductor-cold", workdir / "inductor"
    cold = [f"compile.cache_dir={workdir / 'no_cache'}", f"compile.inductor_dir={cold_inductor}"]
    baked = [f"compile.cache_dir={workdir / 'compile_cache'}", f"compile.inductor_dir={inductor}"]
    results: dict[str, Any] = {}
    plan = [
        (name, ["start", "--steps", "3"], cold, cold_inductor)
        for name in start_names("cold", args.cold_starts)
    ]
    plan.append(("build", ["build"], baked, None))
    for name in start_names("warm", args.warm_starts):
        steps = args.steps if name == "warm" else 3
        plan.append((name, ["start", "--steps", str(steps)], baked, inductor))
    for name, phase_args, overrides, emptied in plan:
        print(f"=== {name}", flush=True)
        if emptied is not None:
            shutil.rmtree(emptied, ignore_errors=True)
        results[name] = _child(phase_args, args.config, [*args.overrides, *overrides], workdir)
        if args.out:
            args.out.write_text(json.dumps(results, indent=2, default=str))
    print(format_table(results))


def check_inputs(args: argparse.Namespace) -> Path:
    """The absolute workdir, after the checks every child would otherwise fail on one by one, each
    with its traceback: the config and its overrides load, and the workdir (which holds the inductor
    dirs) is not under /tmp."""
    from app.config import load_config
    from app.env.fingerprint import is_under_tmp

    load_config(args.config, args.overrides)
    workdir = args.workdir.absolute()
    if is_under_tmp(str(workdir)):
        raise UserError(f"--workdir: {workdir} is under /tmp, where cleanups delete compiled kernels")
    return workdir


def start_names(kind: str, count: int) -> list[str]:
    """`warm` (the one with the steady-state steps), then `warm2`, `warm3`, ...; the same for `cold`."""
    return [kind, *(f"{kind}{index}" for index in range(2, count + 1))]


def _child(phase_args: list[str], config: str, overrides: list[str], workdir: Path) -> dict[str, Any]:
    phase, *options = phase_args  # argparse wants the options after the positionals
    command = [sys.executable, "-m", "app.bench.compile_start", phase, config, *overrides]
    command += [*options, "--workdir", str(workdir)]
    result = run_child(command, env={**os.environ, SPAWNED_AT: repr(time.time())})
    return result or {"failed": "no result line"}


def run_start(config_path: str, overrides: list[str], steps: int) -> dict[str, Any]:
    """One training start as the trainer does it, then `steps` steady-state steps."""
    spawned_at = float(os.environ.get(SPAWNED_AT, time.time()))
    import torch

    from app.compile.guard import RecompileError, read_counters
    from app.compile.prepare import prepare_compiled_training
    from app.config import load_config
    from app.model.drafter import DFlashDrafter, DrafterArch
    from app.model.target import load_target
    from app.train.step import DrafterStep

    marks = {"imports": time.time() - spawned_at}
    config = load_config(config_path, overrides)
    device = torch.device("cuda", torch.cuda.current_device())
    torch.empty(1, device=device)  # the CUDA context, on its own mark
    marks["cuda_ready"] = time.time() - spawned_at
    target = load_target(config, device)
    torch.cuda.synchronize(device)
    marks["target_built"] = time.time() - spawned_at
    drafter = DFlashDrafter(DrafterArch.from_config(config, target), seed=config.train.seed, device=device)
    drafter_step = DrafterStep(config, drafter, target, device)
    marks["models_built"] = time.time() - spawned_at
    report = prepare_compiled_training(config, drafter_step, log=print)
    marks["prepared"] = time.time() - spawned_at
    feature_pool = [_target_features(config, target, seed=0)]
    marks["features_ready"] = time.time() - spawned_at
    step = _train_step(config, drafter_step)

    loss = step(0, feature_pool[0])
    loss.item()
    marks["first_optimizer_step"] = time.time() - spawned_at
    feature_pool += [_target_features(config, target, seed) for seed in range(1, FEATURE_POOL)]

    before = read_counters()
    recompile_failure = None
    started = time.perf_counter()
    done_steps = 0
    try:
        for index in range(1, steps + 1):
            step(index, feature_pool[index % FEATURE_POOL])
            done_steps += 1
    except RecompileError as error:
        recompile_failure = str(error)
    torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - started
    return {
        "marks_s": marks,
        "kernel_tuning_s": _kernel_tuning_s(),
        "compile": report.to_dict(),
        "steady": {
            "steps": done_steps,
            "mean_step_s": elapsed / done_steps if done_steps else None,
            "recompile_failure": recompile_failure,
            "graphs_compiled": (read_counters() - before).unique_graphs,
        },
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
    }


def _kernel_tuning_s() -> float:
    """Seconds inductor spent benchmarking kernel launch configs in this process: near 0 on a warm
    start whose tuned configs were found (dynamo's own timing table; internal, hence the default)."""
    from torch._dynamo import utils

    return sum(
        getattr(utils, "compilation_time_metrics", {}).get("CachingAutotuner.benchmark_all_configs", [])
    )


def run_build(config_path: str, overrides: list[str]) -> dict[str, Any]:
    spawned_at = float(os.environ.get(SPAWNED_AT, time.time()))
    from app.compile.build import build_cache
    from app.config import load_config
    from app.train.step import DrafterStep

    result = build_cache(load_config(config_path, overrides), DrafterStep, force=True)
    manifest = result.entry.manifest
    return {
        "wall_s": time.time() - spawned_at,
        "key": result.entry.key,
        "measured": manifest["measured"],
        "counters": manifest["build"]["counters"],
        "artifact_bytes": manifest["artifacts"]["bytes"],
        "artifact_entries": manifest["artifacts"]["entries"],
    }


def _train_step(config: RunConfig, drafter_step: DrafterStep) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """The trainer's step on a fresh synthetic row each time (the trainer's rows differ too)."""
    import torch

    from app.data.batch import FeatureBatch
    from app.data.synthetic import synthetic_row

    generator = torch.Generator().manual_seed(7)
    vocab_size = drafter_step.drafter.arch.vocab_size

    def step(index: int, features: torch.Tensor) -> torch.Tensor:
        row = synthetic_row(
            config.data.token_budget,
            config.train.anchors,
            vocab_size,
            document_length=config.data.max_length,
            generator=generator,
        ).to(drafter_step.device)
        out = drafter_step.backward(FeatureBatch(row=row, features=features))
        drafter_step.apply(config.train.lr)
        return out.loss.detach()

    return step


def _target_features(config: RunConfig, target: TargetModel, seed: int) -> torch.Tensor:
    """`[token_budget, K*H]` features of one target forward over random tokens (zero-padded to the budget)."""
    import torch

    from app.compile.warmup import random_target_batch

    budget, length = config.data.token_budget, config.data.max_length
    rows = max(1, budget // length)
    features = target.features(random_target_batch(target, rows, length, seed)).reshape(rows * length, -1)[
        :budget
    ]
    if features.shape[0] < budget:
        features = torch.cat([features, features.new_zeros(budget - features.shape[0], features.shape[1])])
    return features


def format_table(results: dict[str, Any]) -> str:
    starts = [name for name in results if name != "build"]  # cold, cold2, ..., warm, warm2, ... in run order
    lines = [
        f"{'run':<6} {'start->1st step':>16} {'prepare':>9} {'fx hit/miss/byp':>16} {'aot hit/miss/byp':>17} "
        f"{'steady steps':>12} {'ms/step':>8} {'recompiles':>10}"
    ]
    for name in starts:
        result = results[name]
        if "marks_s" not in result:
            lines.append(f"{name:<6} {result.get('failed', 'not run')}")
            continue
        counters = result["compile"]["warmup_counters"]
        steady = result["steady"]
        fx = f"{counters['fxgraph_cache_hit']}/{counters['fxgraph_cache_miss']}/{counters['fxgraph_cache_bypass']}"
        aot = f"{counters['autograd_cache_hit']}/{counters['autograd_cache_miss']}/{counters['autograd_cache_bypass']}"
        recompiles = steady["graphs_compiled"] + (1 if steady["recompile_failure"] else 0)
        step_ms = f"{steady['mean_step_s'] * 1e3:.0f}" if steady["mean_step_s"] else "-"
        lines.append(
            f"{name:<6} {result['marks_s']['first_optimizer_step']:>15.1f}s "
            f"{result['marks_s']['prepared'] - result['marks_s']['models_built']:>8.1f}s {fx:>16} {aot:>17} "
            f"{steady['steps']:>12} {step_ms:>8} {recompiles:>10}"
        )
    first_step = {
        name: results[name]["marks_s"]["first_optimizer_step"]
        for name in starts
        if "marks_s" in results[name]
    }
    warm = [seconds for name, seconds in first_step.items() if name.startswith("warm")]
    cold = [seconds for name, seconds in first_step.items() if name.startswith("cold")]
    if cold and warm:
        warm_s, cold_s = statistics.median(warm), statistics.median(cold)
        lines.append(
            f"warm / cold start->first step: {warm_s / cold_s:.0%} (median of {len(warm)} warm starts "
            f"{warm_s:.1f}s, of {len(cold)} cold starts {cold_s:.1f}s; warm {min(warm):.1f}-{max(warm):.1f}s, "
            f"cold {min(cold):.1f}-{max(cold):.1f}s)"
        )
    for name in starts:
        marks = results[name].get("marks_s")
        if marks:
            phases, previous = [], 0.0
            for mark, at in marks.items():  # in the order the start reached them
                phases.append(f"{mark} +{at - previous:.1f}s")
                previous = at
            tuning = results[name].get("kernel_tuning_s")
            if tuning is not None:
                phases.append(f"(of which kernel tuning {tuning:.2f}s)")
            lines.append(f"{name} start: {', '.join(phases)}")
    build = results.get("build") or {}
    if "measured" in build:
        measured = build["measured"]
        lines.append(
            f"build-cache: {build['wall_s']:.1f}s wall, cold compile {measured['cold_compile_s']:.1f}s, "
            f"drafter step {measured['drafter_step_s'] * 1e3:.0f} ms, target forward "
            f"{(measured['target_forward_s'] or 0) * 1e3:.0f} ms, artifacts {build['artifact_bytes'] / 1e6:.1f} MB "
            f"{build['artifact_entries']}, key {build['key']}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
