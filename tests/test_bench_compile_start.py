"""The compile-start benchmark's report: medians of cold and warm starts, counters, kernel tuning.

The starts themselves need a GPU (the benchmark runs them on the GPU machine); this checks what it
makes of their results."""

from __future__ import annotations

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
