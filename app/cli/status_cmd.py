"""`dflash status RUN_DIR [--against OTHER_RUN] [--plot]`: how a run is doing and what changed.

Exit codes: 0 healthy (running, completed or stopped); 1 degraded, failed or stale; 2 no such run or
no status.json.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def status(
    run_dir: Annotated[Path, typer.Argument(help="Run directory (train.output_dir).")],
    against: Annotated[
        Path | None,
        typer.Option(
            "--against", help="Compare with this run instead of the newest healthy completed sibling."
        ),
    ] = None,
    plot: Annotated[
        bool,
        typer.Option("--plot", help="Also write PNG plots of loss, acc, tau and tok/s to RUN_DIR/plots."),
    ] = False,
) -> None:
    """Goal, progress, health, what changed since the last good run, last checkpoint, what to do next."""
    from app.errors import UserError
    from app.telemetry.status_report import render_status

    try:
        document, healthy = render_status(run_dir, against)
    except UserError:
        if not (plot and (run_dir / "metrics.jsonl").is_file()):
            raise
        # A run without a status file (started without telemetry) can still be plotted.
        _plot(run_dir)
        raise
    print(document, end="")
    if plot:
        _plot(run_dir)
    raise typer.Exit(0 if healthy else 1)


def _plot(run_dir: Path) -> None:
    from app.telemetry.plots import write_plots

    written = write_plots(run_dir)
    print(f"plots: {', '.join(str(path) for path in written) or 'no metrics to plot yet'}")
