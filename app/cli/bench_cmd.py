"""`dflash bench drafter|target|tree|pipeline|checkpoint|data|quality|decode|windows`: benchmarks at a run config's exact shapes, their
data, and a finished run judged per log window."""

from __future__ import annotations

from typing import Annotated

import typer

from app.cli.arguments import CONFIG_FORMS, Overrides, int_list, require_importable_stack
from app.config import load_config
from app.errors import UserError

group = typer.Typer(help="Benchmarks at a config's exact shapes.", no_args_is_help=True)


@group.callback()
def _check_stack() -> None:
    """Before any benchmark imports the stack."""
    require_importable_stack()


@group.command("drafter")
def drafter(
    config: Annotated[str, typer.Argument(help=f"Run config: {CONFIG_FORMS}.")],
    overrides: Overrides = None,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Timed steps.")] = 10,
    warmup: Annotated[
        int, typer.Option("--warmup", min=1, help="Untimed steps first (the first one compiles).")
    ] = 3,
    peak_tflops: Annotated[
        float,
        typer.Option(
            "--peak-tflops", min=0.001, help="Peak to compare with (H200 bf16 matmul, measured: 790)."
        ),
    ] = 790.0,
    profile: Annotated[
        int,
        typer.Option(
            "--profile",
            min=0,
            help="Also list one step's N most expensive GPU kernels (host operators on a CPU) and "
            "its N costliest matmul shapes with their TFLOP/s.",
        ),
    ] = 0,
) -> None:
    """Time drafter forward + backward + chunked loss steps; print throughput, FLOPs, memory, compile time."""
    from app.bench.drafter import format_report, run_drafter_bench  # torch loads only for this command

    resolved = load_config(config, overrides or [])
    result = run_drafter_bench(
        resolved, steps=steps, warmup=warmup, peak_tflops=peak_tflops, profile_rows=profile
    )
    print(format_report(result))


@group.command("target")
def target(
    config: Annotated[str, typer.Argument(help=f"Run config: {CONFIG_FORMS}.")],
    overrides: Overrides = None,
    shapes: Annotated[
        int | None, typer.Option("--shapes", min=1, help="Shapes of the run's set, spread (default: all).")
    ] = None,
    modes: Annotated[
        str, typer.Option("--modes", help="Comma-separated: eager, compiled, cudagraph.")
    ] = "eager,compiled,cudagraph",
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Timed forwards per shape (median).")] = 3,
    peak_tflops: Annotated[
        float, typer.Option("--peak-tflops", min=0.001, help="Peak to compare with (H200 bf16: 790).")
    ] = 790.0,
    profile: Annotated[
        int,
        typer.Option("--profile", min=0, help="Also list each mode's N most expensive GPU kernels."),
    ] = 0,
) -> None:
    """Time the frozen target's forward per batch shape of the run: eager, compiled, CUDA-graphed."""
    from app.bench.target import bench_shapes, format_report, run_target_bench

    resolved = load_config(config, overrides or [])
    chosen = [mode.strip() for mode in modes.split(",") if mode.strip()]
    result = run_target_bench(
        resolved,
        bench_shapes(resolved, shapes),
        chosen,
        repeats,
        peak_tflops,
        log=lambda line: print(line, flush=True),
        profile_rows=profile,
    )
    print(format_report(result))


@group.command("tree")
def tree(
    config: Annotated[
        str, typer.Argument(help=f"Run config ({CONFIG_FORMS}); its target must be attention-only.")
    ],
    overrides: Overrides = None,
    budgets: Annotated[
        str, typer.Option("--budgets", help="Comma-separated tree budgets (nodes).")
    ] = "16,64,256",
    top_k: Annotated[int, typer.Option("--top-k", min=1, help="Tokens per depth the tree grows from.")] = 8,
    context: Annotated[int, typer.Option("--context", min=1, help="Tokens in the target's KV cache.")] = 2048,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Timed calls per part (median).")] = 20,
) -> None:
    """Time a DDTree round's parts: the drafter's block, the tree's construction per budget, its verification forward."""
    from app.bench.tree import format_report, run_tree_bench

    resolved = load_config(config, overrides or [])
    print(format_report(run_tree_bench(resolved, int_list(budgets, "--budgets", 1), top_k, context, repeats)))


@group.command("pipeline")
def pipeline(
    config: Annotated[str, typer.Argument(help=f"Run config ({CONFIG_FORMS}); its topology is what runs.")],
    overrides: Overrides = None,
    steps: Annotated[int, typer.Option("--steps", min=2, help="Training steps of the pipeline run.")] = 200,
    workdir: Annotated[
        str, typer.Option("--workdir", help="Where the run directory (metrics, torchrun.log) goes.")
    ] = "runs/bench",
    out: Annotated[str | None, typer.Option("--out", help="Also write the report as JSON here.")] = None,
) -> None:
    """The pipeline end to end under torchrun vs each stage alone: per-role throughput, queues, efficiency."""
    from pathlib import Path

    from app.atomic import write_json_atomic
    from app.bench.pipeline import format_report, run_pipeline_bench

    report = run_pipeline_bench(config, overrides or [], steps, Path(workdir))
    if report is None:
        print(
            "bench pipeline: this node's ranks are done; the report is printed on the node of drafter rank 0"
        )
        return
    print(format_report(report))
    if out:
        write_json_atomic(Path(out), report)


@group.command("checkpoint")
def checkpoint(
    config: Annotated[str, typer.Argument(help=f"Run config: {CONFIG_FORMS}.")],
    overrides: Overrides = None,
    workdir: Annotated[
        str, typer.Option("--workdir", help="Scratch dir on the disk checkpoints go to (emptied after).")
    ] = "runs/bench/checkpoint",
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Saves each way (median).")] = 3,
) -> None:
    """How long a checkpoint holds training: written in place vs in the background (the trainer's way)."""
    from pathlib import Path

    from app.bench.checkpoint import format_report, run_checkpoint_bench

    print(format_report(run_checkpoint_bench(load_config(config, overrides or []), Path(workdir), repeats)))


@group.command("data")
def data(
    out_dir: Annotated[str, typer.Argument(help="Directory for tokenizer/ and train.jsonl.")],
    conversations: Annotated[int, typer.Option("--conversations", min=1, help="Records to write.")] = 2000,
    mean_words: Annotated[
        int, typer.Option("--mean-words", min=8, help="Mean assistant-turn length in words.")
    ] = 800,
) -> None:
    """Write a tokenizer and synthetic conversations for throughput runs with a random-weight target.

    Use them as `target.tokenizer=OUT/tokenizer data.train_files=['OUT/train.jsonl']`.
    """
    from pathlib import Path

    from app.bench.synthetic_data import write_benchmark_data

    tokenizer_dir, data_file = write_benchmark_data(Path(out_dir), conversations, mean_words)
    print(f"target.tokenizer={tokenizer_dir} data.train_files=['{data_file}']")


@group.command("quality")
def quality(
    config: Annotated[
        str, typer.Argument(help=f"Run config ({CONFIG_FORMS}), e.g. configs/smollm2-quality.toml.")
    ],
    overrides: Overrides = None,
    workdir: Annotated[
        str, typer.Option("--workdir", help="Prompts, data, runs and the report; a rerun resumes here.")
    ] = "runs/quality",
    seeds: Annotated[str, typer.Option("--seeds", help="Training seeds, comma-separated.")] = "0,1,2",
    prompts: Annotated[
        int, typer.Option("--prompts", min=1000, help="Prompts in the corpus, both splits.")
    ] = 50000,
    eval_prompts: Annotated[
        int, typer.Option("--eval-prompts", min=1, help="Held-out prompts per domain.")
    ] = 40,
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", min=1, help="Tokens per held-out answer.")
    ] = 256,
    budgets: Annotated[
        str, typer.Option("--tree-budget", help="DDTree node budgets, comma-separated.")
    ] = "16,64,256",
    objectives: Annotated[
        str | None,
        typer.Option(
            "--objectives",
            help="One arm per train.objective, comma-separated (e.g. ce,ce+tv,ce+acceptance,ce+tree); the first "
            "arm is the baseline the others are compared with, paired by seed.",
        ),
    ] = None,
    arm: Annotated[
        list[str] | None,
        typer.Option(
            "--arm",
            help="An arm as 'NAME OVERRIDE...' (e.g. 'lr3e-3 train.lr=3e-3'), after the --objectives arms; "
            "repeatable. With neither option, one arm: the config as it is.",
        ),
    ] = None,
    jobs: Annotated[
        int, typer.Option("--jobs", min=1, help="Training (and eval) runs at once on the device.")
    ] = 1,
    out: Annotated[
        str | None, typer.Option("--out", help="The report as JSON (default WORKDIR/quality.json).")
    ] = None,
) -> None:
    """Train drafters on a real target and measure their held-out acceptance per domain.

    With the config's recipe: prompts, the target's own answers, one run per objective and seed, chain
    and DDTree tau with 95% intervals, each objective against the first paired by seed."""
    from pathlib import Path

    from app.bench.quality import QualityPlan, run_quality

    plan = QualityPlan(
        config_file=config,
        overrides=overrides or [],
        workdir=Path(workdir),
        seeds=int_list(seeds, "--seeds", 0),
        prompt_count=prompts,
        eval_prompts=eval_prompts,
        max_new_tokens=max_new_tokens,
        budgets=int_list(budgets, "--tree-budget", 1),
        variants=_variants(config, overrides or [], objectives, arm or []),
        jobs=jobs,
    )
    report = run_quality(plan, log=lambda line: print(line, flush=True))
    # the table's module imports torch (through the eval's predictability): after the run, so that a bad
    # option or override is refused at once rather than after the seconds torch takes to load
    from app.bench.quality_report import format_table, write_report

    for line in format_table(report):
        print(line, flush=True)
    write_report(report, Path(out) if out else plan.workdir / "quality.json")


def _variants(
    config: str, overrides: list[str], objectives: str | None, arms: list[str]
) -> dict[str, list[str]]:
    """The arms of `--objectives` then `--arm`, each checked as the config loads it (one line naming
    the bad override); with neither, one arm named after the config's objective."""
    variants = {
        name: [f"train.objective={name}"] for name in (objectives or "").replace(" ", "").split(",") if name
    }
    for text in arms:
        name, *settings = text.split()
        if not settings or "=" in name or name in variants:
            raise UserError(
                f"--arm {text!r}: expected 'NAME OVERRIDE...' with a new name, e.g. 'lr3e-3 train.lr=3e-3'"
            )
        variants[name] = settings
    if objectives and len(variants) < len(objectives.split(",")):
        raise UserError(f"--objectives: each objective once, got {objectives!r}")
    for settings in variants.values():
        load_config(config, [*overrides, *settings])
    return variants or {load_config(config, overrides).train.objective: []}


@group.command("decode")
def decode(
    config: Annotated[
        str,
        typer.Argument(
            help=f"Run config ({CONFIG_FORMS}) with datagen.prompts, e.g. configs/smollm2-quality.toml."
        ),
    ],
    overrides: Overrides = None,
    count: Annotated[
        int, typer.Option("--count", min=1, help="Prompts decoded (the first of datagen.prompts).")
    ] = 2048,
    profile_steps: Annotated[
        int, typer.Option("--profile-steps", min=0, help="Then profile this many decode steps (0: none).")
    ] = 20,
) -> None:
    """The local datagen engine's decoder on the config's prompts: tokens/s, row fill, step time, kernels.

    It decodes the first `--count` prompts of datagen.prompts at the config's datagen shape, then
    profiles `--profile-steps` decode steps."""
    from app.bench.decode import run_decode_bench  # torch loads only for this command

    run_decode_bench(
        load_config(config, overrides or []), count, profile_steps, lambda line: print(line, flush=True)
    )


@group.command("windows")
def windows(
    run_dir: Annotated[str, typer.Argument(help="A run directory (train.output_dir) with metrics.jsonl.")],
    from_step: Annotated[
        int, typer.Option("--from-step", min=0, help="First step judged (after warm-up).")
    ] = 5,
    out: Annotated[str | None, typer.Option("--out", help="Also write the report as JSON here.")] = None,
) -> None:
    """A run per log window: tok/s min/median/max, reserved memory, library JIT and other health events."""
    from pathlib import Path

    from app.atomic import write_json_atomic
    from app.bench.windows import format_windows, window_report

    report = window_report(Path(run_dir), from_step)
    print(format_windows(report))
    if out:
        write_json_atomic(Path(out), report)
