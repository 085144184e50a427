"""The plots' y-axes: a flat metric stays flat on the plot, a real change fills it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.telemetry.plots import metric_figures, run_title, y_limits


def test_an_accuracy_that_barely_moves_is_drawn_flat_inside_zero_to_one() -> None:
    low, high = y_limits("acc", [0.3000, 0.3002, 0.3004])
    assert high - low == pytest.approx(0.1) and low < 0.3000 and high > 0.3004
    assert y_limits("acc", [0.0, 0.0004]) == pytest.approx((0.0, 0.1))  # slid up to 0, not cut
    assert y_limits("acc", [0.9996, 1.0]) == pytest.approx((0.9, 1.0))
    assert y_limits("acc", [0.0, 1.0]) == (0.0, 1.0)  # never past the range of a fraction


def test_other_metrics_span_at_least_a_tenth_of_their_magnitude() -> None:
    low, high = y_limits("loss", [2.3400, 2.3404])
    assert high - low == pytest.approx(0.234, rel=1e-3) and low < 2.34 < 2.3404 < high
    low, high = y_limits("tokens_per_s", [21_500.0, 21_510.0])
    assert high - low == pytest.approx(2151.0)
    assert y_limits("loss", [0.0, 0.0]) == (-0.5, 0.5)
    assert y_limits("loss", [float("nan"), 3.0, float("inf")]) == pytest.approx((2.85, 3.15))


def test_a_real_change_fills_the_axis() -> None:
    """A collapse from 0.6 to 0.1 (or a loss falling from 10 to 2) is drawn across the plot's height."""
    low, high = y_limits("acc", [0.6, 0.35, 0.1])
    assert low == pytest.approx(0.075) and high == pytest.approx(0.625)
    low, high = y_limits("loss", [10.0, 2.0])
    assert low == pytest.approx(1.6) and high == pytest.approx(10.4)


def test_the_plots_use_those_limits(tmp_path: Path) -> None:
    """Each metric's axis holds what is drawn on it: the loss plot also every step's own loss."""
    records = [
        {"step": step, "loss": 2.34 + 1e-5 * step, "acc": 0.3 + 1e-5 * step, "tokens_per_s": 21_500.0,
         "step_losses": [2.34 + 0.3 * (step % 2)]}
        for step in range(1, 41)
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    figures = metric_figures(tmp_path)
    assert set(figures) == {"loss", "acc", "tokens_per_s"}
    for name, figure in figures.items():
        values = [record[name] for record in records]
        if name == "loss":
            values += [loss for record in records for loss in record["step_losses"]]
        assert figure.axes[0].get_ylim() == pytest.approx(y_limits(name, values)), name


def test_plots_are_titled_by_the_run_name_else_by_parent_and_directory(tmp_path: Path) -> None:
    """`seed0` alone tells nothing when many runs are plotted: the run's name, else parent/name."""
    run_dir = tmp_path / "arm-ce" / "seed0"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    assert metric_figures(run_dir)["loss"].axes[0].get_title() == "arm-ce/seed0: loss"
    (run_dir / "config.json").write_text(json.dumps({"telemetry": {"run_name": None}}))
    assert run_title(run_dir) == "arm-ce/seed0"
    (run_dir / "config.json").write_text(json.dumps({"telemetry": {"run_name": "ce, seed 0"}}))
    assert metric_figures(run_dir)["loss"].axes[0].get_title() == "ce, seed 0: loss"
