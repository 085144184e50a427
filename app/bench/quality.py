"""`dflash bench quality CONFIG`: how good a drafter the recipe trains, on a real target, per domain and
per training objective.

One command, every stage kept in `--workdir` so that a rerun resumes (a stage whose output is
complete is not run again):

1. prompts: the offline corpus (`app.datagen.corpus`), split by source into train and held-out;
2. data: the target's own answers to the training prompts (`datagen`, the config's engine: "local"
   answers in this process on the GPU) and to the eval prompts, the first `--eval-prompts` held-out
   records of each domain (the run's periodic eval reads them);
3. train: one run per arm and seed (`dflash train` in a child process with the arm's overrides, e.g.
   `train.objective=ce+tv`, and `train.seed`), up to `--jobs` of them at once on the one device;
4. eval: every run's drafter on the same held-out prompts (`dflash eval --json` in a child process, as
   many at once): chain tau, DDTree tau per budget, acceptance and top-k coverage per depth, per domain;
5. the table (`app.bench.quality_report`): each figure as the mean over seeds and its 95% interval, each
   arm against the first one paired by seed, and how well the training metric tracked the periodic eval.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.atomic import write_text_atomic
from app.config import load_config
from app.errors import UserError
from app.signals import stop_signals

DFLASH = [sys.executable, "-m", "app"]
"""How a child runs `dflash`: this interpreter, this checkout."""
Log = Callable[[str], None]
Arm = tuple[str, int]
"""One training run of the benchmark: its arm's name and its seed."""


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
    variants: dict[str, list[str]]
    """Each arm's name and its overrides over the recipe (e.g. "ce+tv": ["train.objective=ce+tv"]);
    the first is the baseline every other one is paired against."""
    jobs: int = 1
    """Training (and eval) runs at once on the one device: small drafters leave most of a GPU idle."""

    @property
    def prompts_dir(self) -> Path:
        return self.workdir / "prompts"

    @property
    def arms(self) -> list[Arm]:
        return [(name, seed) for name in self.variants for seed in self.seeds]

    def data_dir(self, split: str) -> Path:
        return self.workdir / "data" / split

    def run_dir(self, arm: Arm) -> Path:
        return self.workdir / "runs" / arm[0] / f"seed{arm[1]}"

    def eval_file(self, arm: Arm) -> Path:
        return self.workdir / "evals" / arm[0] / f"seed{arm[1]}.json"

    def stage_overrides(self) -> list[str]:
        """The config as every stage runs it: the user's overrides, then the workdir's paths."""
        return [
            *self.overrides,
            f"data.train_files=['{self.data_dir('train')}']",
            f"data.eval_files=['{self.data_dir('eval')}']",
            f"train.eval_prompts={self.eval_prompts}",
            "compile.cold_start=expected",  # each arm compiles once: a bench measures, it does not deploy
        ]


@dataclass
class QualityReport:
    """Per arm the eval's report, the run's last training line and its evals; wall time per stage."""

    results: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)
    training: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)
    evals: dict[str, dict[int, list[tuple[float, float]]]] = field(default_factory=dict)
    """(training tree_streak, held-out tree tau) at each periodic eval of each run."""
    stage_seconds: dict[str, float] = field(default_factory=dict)


def run_quality(plan: QualityPlan, log: Log = print) -> QualityReport:
    """Every stage of the module docstring, resuming where `plan.workdir` holds finished ones. A stop
    signal is passed on to the children (each checkpoints or commits, then exits) and no later stage
    starts: a rerun resumes (`STOP`)."""
    config = load_config(plan.config_file, plan.stage_overrides())
    if config.datagen.engine != "local" and config.target.builtin is None:
        log("bench quality: datagen goes through the configured servers (datagen.engine = servers)")
    with STOP.installed():
        return _run_stages(plan, log)


def _run_stages(plan: QualityPlan, log: Log) -> QualityReport:
    report = QualityReport()
    with _stage(report, "prompts", log):
        _build_prompts(plan, log)
    with _stage(report, "data", log):
        for split in ("train", "eval"):
            _regenerate(plan, split, log)
    with _stage(report, "train", log):
        run_children([(_label(arm), _train_command(plan, arm, log)) for arm in plan.arms], plan.jobs, log)
    with _stage(report, "eval", log):
        run_children([(_label(arm), _eval_command(plan, arm)) for arm in plan.arms], plan.jobs, log)
    for name, seed in plan.arms:
        arm = (name, seed)
        report.results.setdefault(name, {})[seed] = json.loads(plan.eval_file(arm).read_text())
        report.training.setdefault(name, {})[seed] = last_training_line(plan.run_dir(arm))
        report.evals.setdefault(name, {})[seed] = eval_trajectory(plan.run_dir(arm))
    return report


def _label(arm: Arm) -> str:
    return f"{arm[0]} seed {arm[1]}"


def _build_prompts(plan: QualityPlan, log: Log) -> None:
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


def _regenerate(plan: QualityPlan, split: str, log: Log) -> None:
    """`dflash datagen` over one split's prompts (resumable: a finished split costs a file scan)."""
    _child(_datagen_command(plan, split), log)


def _datagen_command(plan: QualityPlan, split: str) -> list[str]:
    prompts = plan.prompts_dir / f"{split}.jsonl"
    overrides = [
        *plan.stage_overrides(),
        f"datagen.prompts=['{prompts}']",
        f"datagen.output_dir={plan.data_dir(split)}",
        # the eval split's few hundred answers take seconds; compiling their step took a minute
        *(["datagen.local_decode=eager"] if split == "eval" else []),
    ]
    return ["datagen", plan.config_file, *overrides]


def _train_command(plan: QualityPlan, arm: Arm, log: Log) -> list[str] | None:
    """`dflash train` for one arm (resumed from its checkpoints), or None when it is trained. A run
    (re)trained here loses its stale eval."""
    run_dir = plan.run_dir(arm)
    status = run_dir / "status.json"
    if status.is_file() and json.loads(status.read_text()).get("state") == "completed":
        log(f"bench quality: {_label(arm)}: {run_dir} is trained")
        return None
    plan.eval_file(arm).unlink(missing_ok=True)
    overrides = [
        *plan.stage_overrides(),
        *plan.variants[arm[0]],
        f"train.seed={arm[1]}",
        f"train.output_dir={run_dir}",
    ]
    resume = ["--resume"] if (run_dir / "checkpoints").is_dir() else []
    return ["train", plan.config_file, *overrides, *resume]


def _eval_command(plan: QualityPlan, arm: Arm) -> list[str] | None:
    """`dflash eval` of one arm's drafter on the eval split, its report to `eval_file`; None when there."""
    out = plan.eval_file(arm)
    if out.is_file():
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    return [
        "eval",
        str(plan.run_dir(arm)),
        f"--data={plan.prompts_dir / 'eval.jsonl'}",
        f"--prompts={plan.eval_prompts}",
        f"--max-new-tokens={plan.max_new_tokens}",
        f"--tree-budget={','.join(map(str, plan.budgets))}",
        f"--json={out}",
    ]


def run_children(commands: list[tuple[str, list[str] | None]], jobs: int, log: Log) -> None:
    """`dflash` children, up to `jobs` at once, each line of their output prefixed with its label (they
    share the compile cache, whose entries are written atomically). Every child runs to its end; then
    any failure is ours."""
    pending = [(label, arguments) for label, arguments in commands if arguments is not None]
    if not pending:
        return
    lock = threading.Lock()

    def run(label: str, arguments: list[str]) -> str | None:
        def prefixed(line: str) -> None:
            with lock:
                log(f"[{label}] {line}" if jobs > 1 else line)

        try:
            _child(arguments, prefixed)
        except UserError as error:
            return f"{label}: {error}"
        return None

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        failures = list(pool.map(lambda item: run(*item), pending))
    STOP.check()  # one line for the stop, not one per child
    failed = [failure for failure in failures if failure]
    if failed:
        raise UserError("; ".join(failed))


def _child(arguments: list[str], log: Log) -> None:
    """`dflash ARGUMENTS` in a child process, its output passed on line by line; its failure is ours."""
    command = [*DFLASH, *arguments]
    STOP.check()
    log(f"bench quality: $ dflash {' '.join(arguments)}")
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as child:
        assert child.stdout is not None
        with STOP.watching(child):
            for line in child.stdout:
                log(line.rstrip("\n"))
    STOP.check()
    if child.returncode != 0:
        raise UserError(
            f"bench quality: `dflash {arguments[0]}` exited {child.returncode} (its output is above)"
        )


def _metric_records(run_dir: Path) -> list[dict[str, Any]]:
    metrics = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []


def last_training_line(run_dir: Path) -> dict[str, Any]:
    """The run's last logged training metrics (metrics.jsonl): its `streak` and `tree_streak` say what
    training saw, to set beside the held-out tau. Each is its last logged value: a run's final window
    can be too short to hold a tree round (its `tree_streak` is null)."""
    last: dict[str, Any] = {}
    for record in _metric_records(run_dir):
        if "streak" in record:
            for key in ("step", "loss", "acc", "streak", "tree_streak"):
                if record.get(key) is not None:
                    last[key] = record[key]
    return last


def eval_trajectory(run_dir: Path) -> list[tuple[float, float]]:
    """At each periodic eval: the training `tree_streak` last logged before it and the held-out tree tau
    it measured (whether the training metric ranks checkpoints as the eval does)."""
    pairs, streak = [], None
    for record in _metric_records(run_dir):
        if "tree_streak" in record:
            streak = record["tree_streak"]
        tree_tau = record.get("eval", {}).get("tree_tau")
        if tree_tau is not None and streak is not None:
            pairs.append((float(streak), float(tree_tau)))
    return pairs


class StopRelay:
    """A stop signal to the benchmark (SIGTERM, SIGINT: a scheduler's or a call's time limit) goes on to
    every live child, whose own handler checkpoints the training run or commits datagen's finished
    answers before it exits. The benchmark keeps relaying their output until they have, then stops
    with one line instead of starting the next child or stage; the same command resumes.
    Without it the children would die with the parent's pipe, mid-save."""

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None
        self._children: set[subprocess.Popen] = set()
        self._lock = threading.RLock()  # re-entrant: the handler can interrupt the main thread holding it

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        self.signal = None
        with stop_signals(self._relay):
            yield

    @contextlib.contextmanager
    def watching(self, child: subprocess.Popen) -> Iterator[None]:
        with self._lock:
            self._children.add(child)
            if self.signal is not None:  # the signal came while this child started
                child.send_signal(self.signal)
        try:
            yield
        finally:
            with self._lock:
                self._children.discard(child)

    def check(self) -> None:
        if self.signal is not None:
            raise UserError(
                f"bench quality: stopped by {self.signal.name} (the runs checkpointed, the datagen "
                "answers that ended are kept); the same command resumes"
            )

    def _relay(self, sig: signal.Signals) -> None:
        self.signal = sig
        with self._lock:
            for child in self._children:
                child.send_signal(sig)


STOP = StopRelay()
"""The benchmark's one relay: signal handlers belong to the process."""


class _stage:
    """Times a stage into the report and says when it starts and ends."""

    def __init__(self, report: QualityReport, name: str, log: Log) -> None:
        self.report, self.name, self.log = report, name, log

    def __enter__(self) -> None:
        self.started = time.monotonic()
        self.log(f"bench quality: {self.name} ...")

    def __exit__(self, *exc: object) -> None:
        seconds = time.monotonic() - self.started
        self.report.stage_seconds[self.name] = seconds
        if exc[0] is None:
            self.log(f"bench quality: {self.name} done in {seconds:.0f}s")
