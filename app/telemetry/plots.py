"""PNG plots of a run's metrics.jsonl: loss, acc, eval tau (chain and tree) and throughput over steps.

A resumed run appends to metrics.jsonl again from its checkpoint's step, so a step can appear twice:
the later record wins (it is the one the surviving weights saw). A line cut short by a crash is skipped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from app.errors import UserError

METRICS_FILE = "metrics.jsonl"
PLOT_DIR = "plots"


def read_metrics(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training records, eval records) by step, the last record of each step winning."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise UserError(f"{path}: no metrics yet (the first log line writes it)")
    train: dict[int, dict[str, Any]] = {}
    evals: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            (evals if "eval" in record else train)[record["step"]] = record
    return [train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)]


def write_plots(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """One PNG per metric in `out_dir` (default RUN_DIR/plots); a metric without data is left out."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend, Agg rendering

    train, evals = read_metrics(run_dir)
    out_dir = out_dir or run_dir / PLOT_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in train]
    series = {
        "loss": ("loss", [r.get("loss") for r in train], steps),
        "acc": ("argmax accuracy of block slots", [r.get("acc") for r in train], steps),
        "tau": (
            "eval acceptance length tau",
            [r["eval"].get("tau") for r in evals],
            [r["step"] for r in evals],
        ),
        "tree_tau": (
            "eval tree acceptance length (DDTree, the configured budget)",
            [r["eval"].get("tree_tau") for r in evals],
            [r["step"] for r in evals],
        ),
        "tokens_per_s": ("throughput (tokens/s)", [r.get("tokens_per_s") for r in train], steps),
    }
    written = []
    for name, (title, values, xs) in series.items():
        points = [(x, y) for x, y in zip(xs, values, strict=True) if isinstance(y, int | float)]
        if not points:
            continue
        figure = Figure(figsize=(8, 4.5), dpi=100)
        axes = figure.add_subplot()
        if name == "loss":
            _plot_step_losses(axes, train)
        marker = "o" if len(points) < 30 else None
        axes.plot(*zip(*points, strict=True), marker=marker, linewidth=2, label="log line (window mean)")
        axes.set_xlabel("step")
        axes.set_ylabel(name)
        axes.set_title(f"{run_dir.resolve().name}: {title}")
        axes.grid(alpha=0.3)
        if name == "loss":
            axes.legend()
        path = out_dir / f"{name}.png"
        figure.savefig(path)
        written.append(path)
    return written


def _plot_step_losses(axes: Any, train: list[dict[str, Any]]) -> None:
    """Every step's own loss (a log line averages its window) as a thin line under the averages."""
    xs, ys = [], []
    for record in train:
        losses = record.get("step_losses") or []
        first = record["step"] - len(losses) + 1
        xs += range(first, record["step"] + 1)
        ys += losses
    if xs:
        axes.plot(xs, ys, linewidth=0.8, alpha=0.5, label="per step")
