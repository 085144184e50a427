"""The compile-start benchmark's report: medians of cold and warm starts, counters, kernel tuning.

The starts themselves need a GPU (the benchmark runs them on the GPU machine); this checks what it
makes of their results, and that bad input stops it before the first start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.bench.compile_start import format_table, start_names


def start(first_step: float, hits: int, misses: int, tuning: float) -> dict:
    marks = {
        "imports": 3.5,
        "models_built": 4.0,
        "prepared": first_step - 1.0,
        "first_optimizer_step": first_step,
    }
    counters = {
        "fxgraph_cache_hit": hits,
        "fxgraph_cache_miss": misses,
        "fxgraph_cache_bypass": 0,
        "autograd_cache_hit": hits,
        "autograd_cache_miss": misses,
        "autograd_cache_bypass": 0,
    }
    steady = {"steps": 3, "mean_step_s": 0.18, "recompile_failure": None, "graphs_compiled": 0}
    return {
        "marks_s": marks,
        "kernel_tuning_s": tuning,
        "compile": {"warmup_counters": counters},
        "steady": steady,
    }


def test_ratio_is_median_warm_over_median_cold():
    assert start_names("cold", 3) == ["cold", "cold2", "cold3"]
    assert start_names("warm", 1) == ["warm"]
    results = {
        "cold": start(40.0, 0, 10, 2.8),
        "cold2": start(52.0, 0, 10, 3.3),
        "cold3": start(48.0, 0, 10, 3.1),
        "warm": start(10.5, 10, 0, 0.4),
        "warm2": start(10.1, 10, 0, 0.4),
        "warm3": start(11.3, 10, 0, 0.4),
        "warm4": {"failed": "exit 1"},
    }
    table = format_table(results)
    assert (
        "warm / cold start->first step: 22% (median of 3 warm starts 10.5s, of 3 cold starts 48.0s;" in table
    )
    assert "warm 10.1-11.3s, cold 40.0-52.0s" in table
    assert "warm4  exit 1" in table
    assert (
        "warm2 start: imports +3.5s, models_built +0.5s, prepared +5.1s, first_optimizer_step +1.0s, "
        in table
    )
    assert "(of which kernel tuning 0.40s)" in table and "(of which kernel tuning 3.30s)" in table
    cold_row = next(line for line in table.splitlines() if line.startswith("cold2 "))
    assert "0/10/0" in cold_row and "52.0s" in cold_row


@pytest.mark.parametrize(
    ("overrides", "workdir", "message"),
    [
        ([], "/tmp/dflash-compile-start", "--workdir: /tmp/dflash-compile-start is under /tmp"),
        (["train.nope=1"], "{home}/compile-start", "unknown key 'train.nope'"),
    ],
)
def test_bad_input_is_refused_in_one_line_before_any_start_runs(tmp_path, overrides, workdir, message):
    """Every start child would otherwise fail on it one after the other, each with a traceback."""
    workdir = workdir.format(home=tmp_path)
    env = {**os.environ, "HOME": str(tmp_path)}
    command = [sys.executable, "-m", "app.bench.compile_start", "run", "configs/qwen3-8b-h200.toml"]
    done = subprocess.run(
        [*command, *overrides, "--workdir", workdir], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert "===" not in done.stdout  # no start ran
    assert not Path(workdir).exists()
