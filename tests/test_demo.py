"""`dflash demo`, shortened: its run is a run like any other, inspectable with `dflash status`."""

from __future__ import annotations

from pathlib import Path

from app.demo.run import run_demo
from app.telemetry.status import read_status
from tests.helpers import dflash


def test_the_demo_run_writes_status_and_plots(tiny_lm_dir, tmp_path: Path, capsys, monkeypatch) -> None:
    lines: list[str] = []
    result = run_demo(
        overrides=[
            f"data.train_files=['{tmp_path / 'regenerated'}']", f"train.output_dir={tmp_path / 'train'}",
            "train.epochs=1", "train.eval_every=0", "train.eval_prompts=2", "data.eval_holdout=4",
        ],
        prompts=40, max_new_tokens=16, log=lines.append,
    )  # fmt: skip
    # every regenerated answer is long enough to train on (2 x block size = 16 supervised tokens)
    (data,) = [line for line in lines if line.startswith("data (")]
    assert "40 records read, 0 malformed, 0 with < 16 supervised tokens, 40 kept" in data, data
    status = read_status(result.run_dir)
    assert status["state"] == "completed" and status["health"]["state"] == "healthy"
    assert {path.name for path in (result.run_dir / "plots").glob("*.png")} >= {"loss.png", "acc.png"}
    assert (
        lines[-1] == f"inspect the run: dflash status {result.run_dir} (plots in {result.run_dir / 'plots'})"
    )
    assert (result.export_dir / "config.json").is_file()
    # the demo exported its drafter: `dflash status` points at that export, not at `dflash export`
    shown = dflash(capsys, monkeypatch, "status", str(result.run_dir)).stdout
    assert f"serve the drafter exported in {result.export_dir}" in shown and "dflash export" not in shown
    # chain and tree (DDTree at the default budget) tau, before and after
    assert result.tree_tau_before is not None and result.tree_tau_after is not None
    done = next(line for line in lines if line.startswith("demo done in"))
    assert f"chain tau {result.tau_before:.2f}, tree tau {result.tree_tau_before:.2f} -> " in done
    assert f"chain tau {result.tau_after:.2f}, tree tau {result.tree_tau_after:.2f} (block size" in done
