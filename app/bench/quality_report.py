"""`dflash bench quality`'s table: per objective and domain each figure's mean and 95% interval over
the seeds, each objective against the baseline paired by seed, and the rank correlation between the
training metric and the held-out tree tau over each run's periodic evals."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from app.atomic import write_json_atomic
from app.bench.quality import QualityReport
from app.evaluate.predictability import describe_predictability

T_975 = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
    11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
    20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
    29: 2.045, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980,
}  # fmt: skip
"""Student's t at 0.975 by degrees of freedom (the 95% interval of a mean over the seeds); between
the entries above 30, and past 120, the next lower one's (a slightly wider interval, never narrower)."""


def t_975(degrees: int) -> float:
    """Student's t quantile at 0.975 for `degrees` of freedom (>= 1), from `T_975`."""
    return T_975[max(df for df in T_975 if df <= degrees)]


def interval(values: Sequence[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% interval (0 for a single value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, 0.0
    t = t_975(len(values) - 1)
    return mean, t * statistics.stdev(values) / math.sqrt(len(values))


def summarize(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """One objective's seeds, per domain (and "all"): each figure's mean and 95% half-width."""
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


def paired_change(
    baseline: dict[int, dict[str, Any]], other: dict[int, dict[str, Any]]
) -> dict[str, tuple[float, float]]:
    """Each headline figure of `other` against `baseline` over the seeds both ran, in percent: the mean
    of the per-seed relative changes and its 95% half-width (pairing by seed takes out what the seed
    does to both, e.g. its data order)."""
    seeds = sorted(set(baseline) & set(other))
    if not seeds:
        return {}
    change: dict[str, tuple[float, float]] = {}
    for column in _columns(baseline[seeds[0]]):
        ratios = [100 * (_figure(other[s], column) / _figure(baseline[s], column) - 1) for s in seeds]
        change[column] = interval(ratios)
    return change


def _columns(result: dict[str, Any]) -> list[str]:
    return ["tau", *(f"tree@{budget}" for budget in result["trees"])]


def _figure(result: dict[str, Any], column: str) -> float:
    return result["tau"] if column == "tau" else result["trees"][column.removeprefix("tree@")]["tau"]


def rank_correlation(pairs: Sequence[tuple[float, float]]) -> float | None:
    """Spearman's rho of the pairs (ties share their mean rank); None under three pairs or when a
    side is constant."""
    if len(pairs) < 3:
        return None
    xs, ys = _ranks([x for x, _ in pairs]), _ranks([y for _, y in pairs])
    if len(set(xs)) < 2 or len(set(ys)) < 2:
        return None
    return statistics.correlation(xs, ys)


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for position in range(start, end + 1):
            ranks[order[position]] = (start + end) / 2
        start = end + 1
    return ranks


def correlations(report: QualityReport) -> dict[str, dict[int, float | None]]:
    return {
        objective: {seed: rank_correlation(pairs) for seed, pairs in seeds.items()}
        for objective, seeds in report.evals.items()
    }


def format_table(report: QualityReport) -> list[str]:
    """Per objective the per-domain table and the gap between domains; each objective against the
    baseline; the training metric's rank correlation; the training streaks; the stages' wall time."""
    if not report.results:
        return ["bench quality: nothing evaluated"]
    lines: list[str] = []
    for objective, seeds in report.results.items():
        lines += _objective_table(objective, summarize(list(seeds.values())), len(seeds))
    baseline, *others = report.results
    lines += describe_predictability(target_predictability(report))
    for objective in others:
        change = paired_change(report.results[baseline], report.results[objective])
        cells = ", ".join(f"{column} {mean:+.1f}% +-{half:.1f}" for column, (mean, half) in change.items())
        lines.append(f"{objective} vs {baseline} (paired by seed, mean +- 95% interval): {cells}")
    for objective, seeds in correlations(report).items():
        values = ", ".join(f"seed {seed} {_rho(rho)}" for seed, rho in seeds.items())
        lines.append(
            f"{objective}: rank correlation of tree_streak with held-out tree tau over evals: {values}"
        )
    for objective, seeds in report.training.items():
        for seed, line in seeds.items():
            lines.append(f"{objective} seed {seed}: last training line {json.dumps(line)}")
    lines += [f"stage {name}: {seconds:.0f}s" for name, seconds in report.stage_seconds.items()]
    return lines


def target_predictability(report: QualityReport) -> dict[str, Any]:
    """How sure the target is of its own answers' tokens (the same prompts and answers in every eval of
    the benchmark, so any one of them says it)."""
    first = next(iter(next(iter(report.results.values())).values()))
    return first.get("target_predictability", {})


def _objective_table(objective: str, table: dict[str, Any], seeds: int) -> list[str]:
    columns = [key for key in table["all"] if key == "tau" or key.startswith("tree@")]
    lines = [
        f"objective {objective}: held-out acceptance over {seeds} seed(s) (mean +- 95% interval):",
        f"{'domain':<10} {'prompts':>7} " + " ".join(f"{c:>14}" for c in columns),
    ]
    for name, row in table.items():
        cells = " ".join(f"{row[c][0]:>7.3f} +-{row[c][1]:>5.3f}" for c in columns)
        lines.append(f"{name:<10} {row['prompts']:>7} {cells}")
    domains = [name for name in table if name != "all"]
    if len(domains) > 1:
        taus = [table[name]["tau"][0] for name in domains]
        lines.append(f"gap between the best and the worst domain (chain tau): {max(taus) - min(taus):.3f}")
    return lines


def _rho(rho: float | None) -> str:
    return "n/a (under 3 evals)" if rho is None else f"{rho:+.2f}"


def write_report(report: QualityReport, path: Path) -> None:
    baseline = next(iter(report.results), None)
    record = {
        "results": {o: {str(s): r for s, r in seeds.items()} for o, seeds in report.results.items()},
        "training": {o: {str(s): r for s, r in seeds.items()} for o, seeds in report.training.items()},
        "summary": {o: summarize(list(seeds.values())) for o, seeds in report.results.items()},
        "baseline": baseline,
        "paired_change_percent": {
            o: paired_change(report.results[baseline], seeds)
            for o, seeds in report.results.items()
            if o != baseline
        },
        "rank_correlation": {
            o: {str(s): rho for s, rho in seeds.items()} for o, seeds in correlations(report).items()
        },
        "target_predictability": target_predictability(report) if report.results else {},
        "evals": {o: {str(s): pairs for s, pairs in seeds.items()} for o, seeds in report.evals.items()},
        "stage_seconds": report.stage_seconds,
    }
    write_json_atomic(path, record)
