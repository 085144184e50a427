"""PNG plots of a run's metrics.jsonl: loss, acc, eval tau (chain and tree) and throughput over steps.

A resumed run appends to metrics.jsonl again from its checkpoint's step, so a step can appear twice:
the later record wins (it is the one the surviving weights saw). A line cut short by a crash is skipped.

Each plot is titled by the run (`run_title`): its `telemetry.run_name`, else its directory as
parent/name, so that plots of many runs (one directory per seed or arm) tell which run they show.

The y-axis never zooms into noise (`y_limits`): matplotlib's autoscale stretches any spread to the full
height, so an accuracy moving by 0.0004 would look like a collapse. A fraction (acc) spans at least
`MIN_FRACTION_SPAN` inside [0, 1]; every other metric at least `MIN_RELATIVE_SPAN` of its magnitude.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from app.errors import UserError

METRICS_FILE = "metrics.jsonl"
PLOT_DIR = "plots"
FRACTIONS = {"acc"}
"""Metrics in [0, 1]."""
MIN_FRACTION_SPAN = 0.1
"""Smallest y range of a fraction: a change of 0.01 stays a tenth of the plot's height."""
MIN_RELATIVE_SPAN = 0.1
"""Smallest y range of any other metric, relative to its largest magnitude (loss 2.34: at least 0.234)."""
MARGIN = 0.05
"""Room above and below the data, as a fraction of the range."""


def y_limits(name: str, values: Sequence[float]) -> tuple[float, float]:
    """The y range to plot `values` of metric `name` on: the data with a margin, widened about its
    middle to the metric's minimum span, a fraction's kept inside [0, 1]. Non-finite values are ignored."""
    finite = [float(v) for v in values if math.isfinite(v)]
    if not finite:
        return (0.0, 1.0)
    low, high = min(finite), max(finite)
    pad = (high - low) * MARGIN
    low, high = low - pad, high + pad
    magnitude = max(abs(v) for v in finite)
    floor = MIN_FRACTION_SPAN if name in FRACTIONS else (MIN_RELATIVE_SPAN * magnitude or 1.0)  # 0s: unit
    if high - low < floor:
        middle = (low + high) / 2
        low, high = middle - floor / 2, middle + floor / 2
    if name in FRACTIONS:  # slide the range into [0, 1] rather than cut it
        span = min(high - low, 1.0)
        low = min(max(low, 0.0), 1.0 - span)
        high = low + span
    return low, high


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


def run_title(run_dir: Path) -> str:
    """The run's `telemetry.run_name` (from its config.json) when set, else its directory as parent/name:
    `seed0` alone says nothing beside the other arms' `seed0`."""
    try:
        name = json.loads((run_dir / "config.json").read_text())["telemetry"]["run_name"]
    except (OSError, ValueError, KeyError, TypeError):  # no readable config: the directory names it
        name = None
    if isinstance(name, str) and name:
        return name
    resolved = run_dir.resolve()
    return f"{resolved.parent.name}/{resolved.name}"


def write_plots(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """One PNG per metric in `out_dir` (default RUN_DIR/plots); a metric without data is left out."""
    out_dir = out_dir or run_dir / PLOT_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, figure in metric_figures(run_dir).items():
        path = out_dir / f"{name}.png"
        figure.savefig(path)
        written.append(path)
    return written


def metric_figures(run_dir: Path) -> dict[str, Any]:
    """A matplotlib Figure per metric with data, by metric name."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend, Agg rendering

    train, evals = read_metrics(run_dir)
    run = run_title(run_dir)
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
        "tokens_per_s": (
            "throughput (tokens/s of training time: evals and saves left out)",
            [r.get("tokens_per_s") for r in train],
            steps,
        ),
    }
    figures = {}
    for name, (title, values, xs) in series.items():
        points = [(x, y) for x, y in zip(xs, values, strict=True) if isinstance(y, int | float)]
        if not points:
            continue
        figure = Figure(figsize=(8, 4.5), dpi=100)
        axes = figure.add_subplot()
        plotted = [y for _, y in points]
        if name == "loss":
            plotted += _plot_step_losses(axes, train)
        marker = "o" if len(points) < 30 else None
        axes.plot(*zip(*points, strict=True), marker=marker, linewidth=2, label="log line (window mean)")
        axes.set_ylim(*y_limits(name, plotted))
        axes.set_xlabel("step")
        axes.set_ylabel(name)
        axes.set_title(f"{run}: {title}")
        axes.grid(alpha=0.3)
        if name == "loss":
            axes.legend()
        figures[name] = figure
    return figures


def _plot_step_losses(axes: Any, train: list[dict[str, Any]]) -> list[float]:
    """Every step's own loss (a log line averages its window) as a thin line under the averages;
    returns the losses plotted."""
    xs, ys = [], []
    for record in train:
        losses = record.get("step_losses") or []
        first = record["step"] - len(losses) + 1
        xs += range(first, record["step"] + 1)
        ys += losses
    if xs:
        axes.plot(xs, ys, linewidth=0.8, alpha=0.5, label="per step")
    return ys
