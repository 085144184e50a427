"""`dflash bench quality CONFIG`: how good a drafter the recipe trains, on a real target, per domain.

One command, every stage kept in `--workdir` so that a rerun resumes (a stage whose output is
complete is not run again):

1. prompts: the offline corpus (`app.datagen.corpus`), split by source into train and held-out;
2. data: the target's own answers to the training prompts (`datagen`, the config's engine: "local"
   answers in this process on the GPU) and to the eval prompts, the first `--eval-prompts` held-out
   records of each domain (the run's periodic eval reads them);
3. train: one run per seed (`dflash train` in a child process, the seed in `train.seed`);
4. eval: every seed's drafter on the same held-out prompts, `--eval-prompts` per domain: the target's
   greedy answers are decoded once and each drafter's rounds replayed over them
   (`app.evaluate.evaluator.Evaluator`); chain tau, DDTree tau per budget, acceptance and top-k
   coverage per depth, per domain;
5. the table: each figure as the mean over seeds and its 95% interval (Student's t), beside the
   runs' last training `streak` / `tree_streak` and each stage's wall time; JSON in `--out`.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.atomic import write_json_atomic, write_text_atomic
from app.config import RunConfig, load_config
from app.errors import UserError

T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
"""Student's t at 0.975 by degrees of freedom (the 95% interval of a mean over a few seeds); 1.96 beyond."""


@dataclass
class QualityPlan:
    """What the benchmark runs and where everything goes."""

    config_file: str
    overrides: list[str]
    workdir: Path
    seeds: list[int]
    prompt_count: int
    eval_prompts: int
    max_new_tokens: int
    budgets: list[int]

    @property
    def prompts_dir(self) -> Path:
        return self.workdir / "prompts"

    def data_dir(self, split: str) -> Path:
        return self.workdir / "data" / split

    def run_dir(self, seed: int) -> Path:
        return self.workdir / "runs" / f"seed{seed}"

    def stage_overrides(self) -> list[str]:
        """The config as every stage runs it: the user's overrides, then the workdir's paths."""
        return [
            *self.overrides,
            f"data.train_files=['{self.data_dir('train')}']",
            f"data.eval_files=['{self.data_dir('eval')}']",
            f"train.eval_prompts={self.eval_prompts}",
        ]


@dataclass
class QualityReport:
    """Per seed the eval's report and the run's last training line; wall time per stage."""

    seeds: dict[int, dict[str, Any]] = field(default_factory=dict)
    training: dict[int, dict[str, Any]] = field(default_factory=dict)
    stage_seconds: dict[str, float] = field(default_factory=dict)


def run_quality(plan: QualityPlan, log: Callable[[str], None] = print) -> QualityReport:
    """Every stage of the module docstring, resuming where `plan.workdir` holds finished ones."""
    config = load_config(plan.config_file, plan.stage_overrides())
    if config.datagen.engine != "local" and config.target.builtin is None:
        log("bench quality: datagen goes through the configured servers (datagen.engine = servers)")
    report = QualityReport()
    with _stage(report, "prompts", log):
        _build_prompts(plan, log)
    with _stage(report, "data", log):
        for split in ("train", "eval"):
            _regenerate(plan, split, log)
    for seed in plan.seeds:
        with _stage(report, f"train seed {seed}", log):
            _train(plan, seed, log)
        report.training[seed] = last_training_line(plan.run_dir(seed))
    with _stage(report, "eval", log):
        report.seeds = _evaluate(plan, config, log)
    return report


def _build_prompts(plan: QualityPlan, log: Callable[[str], None]) -> None:
    """The corpus, then its eval split: the first `eval_prompts` held-out records of each domain (the
    prompts every eval of the benchmark measures, periodic and final)."""
    from app.evaluate.prompts import first_per_domain

    if not (plan.prompts_dir / "manifest.json").is_file():
        from app.datagen.corpus import write_corpus

        manifest = write_corpus(plan.prompts_dir, seed=0, count=plan.prompt_count)
        log(f"bench quality: prompts: {json.dumps(manifest['counts'])}")
    lines = (plan.prompts_dir / "heldout.jsonl").read_text().splitlines()
    chosen = first_per_domain([json.loads(line).get("domain") or "" for line in lines], plan.eval_prompts)
    write_text_atomic(plan.prompts_dir / "eval.jsonl", "".join(lines[i] + "\n" for i in chosen))


def _regenerate(plan: QualityPlan, split: str, log: Callable[[str], None]) -> None:
    """`dflash datagen` over one split's prompts (resumable: a finished split costs a file scan)."""
    prompts = plan.prompts_dir / f"{split}.jsonl"
    overrides = [
        *plan.stage_overrides(),
        f"datagen.prompts=['{prompts}']",
        f"datagen.output_dir={plan.data_dir(split)}",
    ]
    _child(["datagen", plan.config_file, *overrides], log)


def _train(plan: QualityPlan, seed: int, log: Callable[[str], None]) -> None:
    run_dir = plan.run_dir(seed)
    overrides = [*plan.stage_overrides(), f"train.seed={seed}", f"train.output_dir={run_dir}"]
    status = run_dir / "status.json"
    if status.is_file() and json.loads(status.read_text()).get("state") == "completed":
        log(f"bench quality: seed {seed}: {run_dir} is trained")
        return
    resume = ["--resume"] if (run_dir / "checkpoints").is_dir() else []
    _child(["train", plan.config_file, *overrides, *resume], log)


def _child(arguments: list[str], log: Callable[[str], None]) -> None:
    """`dflash ARGUMENTS` in a child process, its output passed on line by line; its failure is ours."""
    command = [sys.executable, "-m", "app", *arguments]
    log(f"bench quality: $ dflash {' '.join(arguments)}")
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as child:
        assert child.stdout is not None
        for line in child.stdout:
            log(line.rstrip("\n"))
    if child.returncode != 0:
        raise UserError(
            f"bench quality: `dflash {arguments[0]}` exited {child.returncode} (its output is above)"
        )


def _evaluate(plan: QualityPlan, config: RunConfig, log: Callable[[str], None]) -> dict[int, dict[str, Any]]:
    from app.evaluate.evaluator import Evaluator
    from app.evaluate.prompts import prompts_from_file
    from app.export import load_trained_drafter
    from app.model.target import load_target
    from app.train.setup import load_tokenizer, pick_device

    tokenizer = load_tokenizer(config)
    held_out = prompts_from_file(
        plan.prompts_dir / "eval.jsonl", tokenizer, plan.eval_prompts, config.data.chat_template_kwargs
    )
    device = pick_device(config.train.device)
    target = load_target(config, device)
    evaluator = Evaluator(
        config,
        target,
        tokenizer,
        held_out.ids,
        plan.max_new_tokens,
        plan.budgets,
        domains=held_out.domains,
        progress=log,
    )
    reports = {}
    for seed in plan.seeds:
        drafter = load_trained_drafter(plan.run_dir(seed)).build(target, device)
        started = time.monotonic()
        result = evaluator(drafter)
        log(f"bench quality: seed {seed}: {result.summary_line()} ({time.monotonic() - started:.1f}s)")
        reports[seed] = result.report()
    return reports


def last_training_line(run_dir: Path) -> dict[str, Any]:
    """The run's last logged training metrics (metrics.jsonl): its `streak` and `tree_streak` say what
    training saw, to set beside the held-out tau."""
    metrics = run_dir / "metrics.jsonl"
    last: dict[str, Any] = {}
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            record = json.loads(line)
            if "streak" in record:
                last = {
                    key: record[key]
                    for key in ("step", "loss", "acc", "streak", "tree_streak")
                    if key in record
                }
    return last


# ---- the table ----------------------------------------------------------------------------------------


def interval(values: Sequence[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% interval (0 for a single value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, 0.0
    t = T_975.get(len(values) - 1, 1.96)
    return mean, t * statistics.stdev(values) / math.sqrt(len(values))


def summarize(report: QualityReport) -> dict[str, Any]:
    """Per domain (and "all"): each figure's mean and 95% half-width over the seeds."""
    per_seed = list(report.seeds.values())
    names = ["all", *per_seed[0].get("domains", {})] if per_seed else []
    table: dict[str, Any] = {}
    for name in names:
        parts = [seed if name == "all" else seed["domains"][name] for seed in per_seed]
        row = {"tau": interval([p["tau"] for p in parts]), "prompts": parts[0]["prompts"]}
        for budget in parts[0]["trees"]:
            row[f"tree@{budget}"] = interval([p["trees"][budget]["tau"] for p in parts])
        for key in ("top1", "top4", "top8", "accepted"):
            depths = [p["per_depth"].get(key, []) for p in parts]
            if all(depths):
                row[f"{key}_per_depth"] = [
                    interval(known)[0] if (known := [d[i] for d in depths if d[i] is not None]) else None
                    for i in range(len(depths[0]))
                ]
        table[name] = row
    return table


def format_table(report: QualityReport) -> list[str]:
    """The per-domain table, the gap between domains and the training streaks."""
    table = summarize(report)
    if not table:
        return ["bench quality: nothing evaluated"]
    columns = [key for key in table["all"] if key == "tau" or key.startswith("tree@")]
    lines = [
        f"held-out acceptance over {len(report.seeds)} seed(s) (mean +- 95% interval):",
        f"{'domain':<10} {'prompts':>7} " + " ".join(f"{c:>14}" for c in columns),
    ]
    for name, row in table.items():
        cells = " ".join(f"{row[c][0]:>7.3f} +-{row[c][1]:>5.3f}" for c in columns)
        lines.append(f"{name:<10} {row['prompts']:>7} {cells}")
    domains = [name for name in table if name != "all"]
    if len(domains) > 1:
        taus = [table[name]["tau"][0] for name in domains]
        lines.append(f"gap between the best and the worst domain (chain tau): {max(taus) - min(taus):.3f}")
    for seed, line in report.training.items():
        lines.append(f"seed {seed}: last training line {json.dumps(line)}")
    lines += [f"stage {name}: {seconds:.0f}s" for name, seconds in report.stage_seconds.items()]
    return lines


def write_report(report: QualityReport, path: Path) -> None:
    record = {
        "seeds": {str(seed): value for seed, value in report.seeds.items()},
        "training": {str(seed): value for seed, value in report.training.items()},
        "summary": summarize(report),
        "stage_seconds": report.stage_seconds,
    }
    write_json_atomic(path, record)


class _stage:
    """Times a stage into the report and says when it starts and ends."""

    def __init__(self, report: QualityReport, name: str, log: Callable[[str], None]) -> None:
        self.report, self.name, self.log = report, name, log

    def __enter__(self) -> None:
        self.started = time.monotonic()
        self.log(f"bench quality: {self.name} ...")

    def __exit__(self, *exc: object) -> None:
        seconds = time.monotonic() - self.started
        self.report.stage_seconds[self.name] = seconds
        if exc[0] is None:
            self.log(f"bench quality: {self.name} done in {seconds:.0f}s")
