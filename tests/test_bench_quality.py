"""`dflash bench quality`'s own parts: the eval split it carves from the corpus, the stages it skips on a
rerun, a failing stage, and the table (means and 95% intervals over seeds, per domain). The stages'
commands are tested where they live (datagen, train, eval); the whole benchmark ran on an H200
(BENCHMARKS.md, 2026-12-03)."""

from __future__ import annotations

import json
import math

import pytest

from app.bench.quality import (
    QualityPlan,
    QualityReport,
    _build_prompts,
    _child,
    _train,
    format_table,
    interval,
)
from app.errors import UserError


def plan(tmp_path, **fields) -> QualityPlan:
    values = {
        "config_file": "configs/smollm2-quality.toml",
        "overrides": [],
        "workdir": tmp_path,
        "seeds": [0, 1],
        "prompt_count": 1000,
        "eval_prompts": 3,
        "max_new_tokens": 16,
        "budgets": [16, 64],
    }
    return QualityPlan(**{**values, **fields})


def test_the_interval_is_students_t_over_the_seeds():
    assert interval([2.5]) == (2.5, 0.0)
    mean, half = interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and math.isclose(half, 4.303 / math.sqrt(3))
    assert math.isclose(interval([1.0, 3.0])[1], 12.706)


def test_the_eval_split_is_the_first_prompts_of_each_held_out_domain(tmp_path):
    quality = plan(tmp_path)
    _build_prompts(quality, lambda line: None)
    held_out = [
        json.loads(line) for line in (tmp_path / "prompts" / "heldout.jsonl").read_text().splitlines()
    ]
    chosen = [json.loads(line) for line in (tmp_path / "prompts" / "eval.jsonl").read_text().splitlines()]
    for domain in ("code", "prose", "math"):
        first = [record["id"] for record in held_out if record["domain"] == domain][:3]
        assert [record["id"] for record in chosen if record["domain"] == domain] == first
    assert len(chosen) == 9
    assert "data.eval_files=['%s']" % (tmp_path / "data" / "eval") in quality.stage_overrides()


def test_a_trained_seed_is_not_trained_again_and_a_failing_stage_stops_the_benchmark(tmp_path):
    quality = plan(tmp_path)
    run_dir = quality.run_dir(0)
    run_dir.mkdir(parents=True)
    (run_dir / "status.json").write_text(json.dumps({"state": "completed"}))
    lines: list[str] = []
    _train(quality, 0, lines.append)
    assert lines == [f"bench quality: seed 0: {run_dir} is trained"]
    with pytest.raises(UserError, match=r"`dflash config` exited 2 \(its output is above\)"):
        _child(["config", "show", str(tmp_path / "missing.toml")], lines.append)
    assert any("missing.toml" in line for line in lines)  # the child's own error line was passed on


def seed_report(tau: float, tree: float, domains: dict[str, tuple[float, float]]) -> dict:
    def part(chain: float, tree_tau: float) -> dict:
        return {
            "tau": chain,
            "prompts": 3,
            "trees": {"64": {"tau": tree_tau, "top_k": 8, "rounds": 10}},
            "per_depth": {"top1": [0.5, None], "accepted": [0.4, 0.1]},
        }

    return {**part(tau, tree), "domains": {name: part(*values) for name, values in domains.items()}}


def test_the_table_has_each_domain_s_mean_and_interval_and_the_gap():
    report = QualityReport(
        seeds={
            0: seed_report(2.0, 3.0, {"code": (1.5, 2.5), "prose": (2.5, 3.5)}),
            1: seed_report(2.2, 3.2, {"code": (1.7, 2.7), "prose": (2.7, 3.7)}),
        },
        training={0: {"step": 10, "streak": 1.5}},
        stage_seconds={"eval": 12.0},
    )
    lines = format_table(report)
    half = 12.706 * 0.1 * math.sqrt(2) / math.sqrt(2)  # t(1) x stdev of (2.0, 2.2) / sqrt(2)
    assert lines[2].split()[:2] == ["all", "3"]
    assert lines[2].split()[2:4] == ["2.100", f"+-{half:.3f}"]
    assert lines[3].startswith("code") and "1.600" in lines[3] and "2.600" in lines[3]
    assert "gap between the best and the worst domain (chain tau): 1.000" in lines
    assert 'seed 0: last training line {"step": 10, "streak": 1.5}' in lines and "stage eval: 12s" in lines
