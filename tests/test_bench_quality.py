"""`dflash bench quality`'s own parts: the eval split it carves from the corpus, the stages it skips on a
rerun, children run several at once, a failing stage, and the table (means and 95% intervals over seeds,
per domain; objectives paired by seed; the training metric's rank correlation with the eval). The
stages' commands are tested where they live (datagen, train, eval); the whole benchmark ran on an H200
(BENCHMARKS.md, 2026-12-03)."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys

import pytest

from app.bench import quality, quality_report
from app.bench.quality import (
    QualityPlan,
    QualityReport,
    _build_prompts,
    _datagen_command,
    _eval_command,
    _train_command,
    eval_trajectory,
    last_training_line,
    run_children,
)
from app.bench.quality_report import (
    format_table,
    interval,
    paired_change,
    rank_correlation,
    summarize,
    write_report,
)
from app.cli.bench_cmd import _variants
from app.config import load_config
from app.errors import UserError
from tests.helpers import ROOT


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
        "variants": {"ce": [], "ce+tv": ["train.objective=ce+tv"]},
    }
    return QualityPlan(**{**values, **fields})


def test_the_interval_is_students_t_over_the_seeds():
    assert interval([2.5]) == (2.5, 0.0)
    mean, half = interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and math.isclose(half, 4.303 / math.sqrt(3))
    assert math.isclose(interval([1.0, 3.0])[1], 12.706)


def test_eleven_seeds_take_students_t_at_ten_degrees_not_the_normal_1_96():
    values = [float(v) for v in range(11)]
    assert interval(values) == pytest.approx((5.0, 2.228 * statistics.stdev(values) / math.sqrt(11)))


def test_the_eval_split_is_the_first_prompts_of_each_held_out_domain(tmp_path):
    quality = plan(tmp_path)
    lines: list[str] = []
    _build_prompts(quality, lines.append)
    manifest = json.loads((tmp_path / "prompts" / "manifest.json").read_text())
    assert (manifest["seed"], manifest["count"]) == (0, 1000)  # every benchmark holds out the same sources
    counts = {split: manifest["counts"][split] for split in ("train", "heldout")}  # the file sorts its keys
    assert lines == [f"bench quality: prompts: {json.dumps(counts)}"]
    held_out = [
        json.loads(line) for line in (tmp_path / "prompts" / "heldout.jsonl").read_text().splitlines()
    ]
    chosen = [json.loads(line) for line in (tmp_path / "prompts" / "eval.jsonl").read_text().splitlines()]
    for domain in ("code", "prose", "math"):
        first = [record["id"] for record in held_out if record["domain"] == domain][:3]
        assert [record["id"] for record in chosen if record["domain"] == domain] == first
    assert len(chosen) == 9
    # a rerun keeps the corpus it finds (its manifest says it is whole) and carves the eval split again
    with (tmp_path / "prompts" / "train.jsonl").open("a") as train:
        train.write('{"id": "kept"}\n')
    (tmp_path / "prompts" / "eval.jsonl").unlink()
    _build_prompts(quality, lines.append)
    assert len(lines) == 1 and (tmp_path / "prompts" / "train.jsonl").read_text().endswith('{"id": "kept"}\n')
    assert len((tmp_path / "prompts" / "eval.jsonl").read_text().splitlines()) == 9
    assert "data.train_files=['%s']" % (tmp_path / "data" / "train") in quality.stage_overrides()
    assert "data.eval_files=['%s']" % (tmp_path / "data" / "eval") in quality.stage_overrides()
    assert load_config(quality.config_file, quality.stage_overrides()).compile.cold_start == "expected"


def test_the_eval_split_is_answered_eagerly_and_the_training_split_by_the_compiled_step(tmp_path):
    """The eval split's answers take seconds: compiling their decode step first took a minute."""
    quality = plan(tmp_path)
    for split, decode in (("train", "compiled"), ("eval", "eager")):
        command = _datagen_command(quality, split)
        assert command[:2] == ["datagen", quality.config_file]
        config = load_config(command[1], command[2:])
        assert config.datagen.local_decode == decode
        assert config.datagen.prompts == [str(tmp_path / "prompts" / f"{split}.jsonl")]
        assert config.datagen.output_dir == str(tmp_path / "data" / split)


def test_a_trained_arm_is_not_trained_again_and_a_retrained_one_loses_its_stale_eval(tmp_path):
    quality = plan(tmp_path)
    trained, fresh = ("ce", 0), ("ce+tv", 1)
    quality.run_dir(trained).mkdir(parents=True)
    (quality.run_dir(trained) / "status.json").write_text(json.dumps({"state": "completed"}))
    lines: list[str] = []
    assert _train_command(quality, trained, lines.append) is None
    assert lines == [f"bench quality: ce seed 0: {quality.run_dir(trained)} is trained"]
    quality.eval_file(fresh).parent.mkdir(parents=True)
    quality.eval_file(fresh).write_text("{}")  # an eval of an earlier, unfinished training
    command = _train_command(quality, fresh, lines.append)
    assert command is not None and not quality.eval_file(fresh).exists()
    assert command[:2] == ["train", quality.config_file]
    assert {"train.objective=ce+tv", "train.seed=1", f"train.output_dir={tmp_path}/runs/ce+tv/seed1"} <= set(
        command
    )
    assert "--resume" not in command
    (quality.run_dir(fresh) / "checkpoints").mkdir(parents=True)
    assert _train_command(quality, fresh, lines.append)[-1] == "--resume"


def test_arms_come_from_objectives_then_arm_options_each_checked_as_the_config_loads_it():
    config = "configs/smollm2-quality.toml"
    assert _variants(config, [], "ce, ce+tv", ["lr3 train.lr=3e-3 train.epochs=1"]) == {
        "ce": ["train.objective=ce"],
        "ce+tv": ["train.objective=ce+tv"],
        "lr3": ["train.lr=3e-3", "train.epochs=1"],
    }
    assert _variants(config, ["train.objective=ce+tv"], None, []) == {"ce+tv": []}
    for objectives, arms, message in [
        ("ce,ce", [], "--objectives: each objective once"),
        ("ce", ["ce train.lr=1"], "--arm 'ce train.lr=1': expected 'NAME OVERRIDE...' with a new name"),
        (None, ["lr3"], "--arm 'lr3': expected"),
        ("ce,bogus", [], "train.objective: must be one of"),
        (None, ["big train.lr=-1"], "train.lr: must be > 0"),
    ]:
        with pytest.raises(UserError, match=re.escape(message)):
            _variants(config, [], objectives, arms)


REFUSED_BEFORE_TORCH = """
import sys
from app.cli import main
sys.argv = ["dflash", "bench", "quality", *sys.argv[1:]]
try:
    main()
except SystemExit as done:
    print("exit", done.code, "torch" in sys.modules)
"""


@pytest.mark.parametrize(
    "arguments",
    [["train.nope=1"], ["--arm", "lr3"], ["--objectives", "ce,bogus"], ["--seeds", "0,x"]],
    ids=["override", "arm", "objective", "seeds"],
)
def test_a_bad_option_or_override_is_refused_in_one_line_before_torch_loads(tmp_path, arguments):
    """Seconds, not the twenty torch and the model code take to import on a CPU."""
    command = [sys.executable, "-c", REFUSED_BEFORE_TORCH, "configs/tiny.toml", "--workdir", str(tmp_path)]
    done = subprocess.run([*command, *arguments], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.stdout.strip() == "exit 2 False", done.stdout + done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith("dflash: error: ")
    assert not any(tmp_path.iterdir())  # nothing started


def test_an_arm_s_eval_reads_the_eval_split_and_is_skipped_once_written(tmp_path):
    quality = plan(tmp_path)
    assert _eval_command(quality, ("ce", 0))[:2] == ["eval", str(tmp_path / "runs" / "ce" / "seed0")]
    command = _eval_command(quality, ("ce", 1))  # its folder is there already: the seed before made it
    assert command[:2] == ["eval", str(tmp_path / "runs" / "ce" / "seed1")]
    assert f"--data={tmp_path}/prompts/eval.jsonl" in command and "--tree-budget=16,64" in command
    assert f"--json={tmp_path}/evals/ce/seed1.json" in command and "--prompts=3" in command
    quality.eval_file(("ce", 1)).write_text("{}")
    assert _eval_command(quality, ("ce", 1)) is None


def test_children_run_several_at_once_labelled_and_a_failure_stops_the_stage_after_all_ran(tmp_path):
    lines: list[str] = []
    config = ["config", "show", "configs/tiny.toml"]
    missing = ["config", "show", str(tmp_path / "missing.toml")]
    children = [("good", config), ("skipped", None), ("bad", missing), ("late", config), ("worse", missing)]
    exited = "bench quality: `dflash config` exited 2 \\(its output is above\\)"
    with pytest.raises(UserError, match=rf"^bad: {exited}; worse: {exited}$"):
        run_children(children, jobs=2, log=lines.append)
    assert any(line.startswith("[bad] dflash: error: ") for line in lines)  # the child's stderr, relayed
    assert any(line.startswith("[good] bench quality: $ dflash config show") for line in lines)
    assert any(line.startswith("[late] ") and "block_size" in line for line in lines)  # ran after the failure
    assert any(line.startswith("[bad] ") and "missing.toml" in line for line in lines)  # its own error line
    assert not any("skipped" in line for line in lines)


def test_one_child_at_a_time_is_relayed_as_it_prints_and_a_fresh_relay_has_no_stop(monkeypatch):
    """With --jobs 1 no label: the lines are the child's own, trailing spaces and all."""
    monkeypatch.setattr(
        quality, "DFLASH", [sys.executable, "-c", "print('spaces kept  '); print('ends in X')"]
    )
    lines: list[str] = []
    run_children([("only", ["show"])], jobs=1, log=lines.append)
    assert lines == ["bench quality: $ dflash show", "spaces kept  ", "ends in X"]
    quality.StopRelay().check()  # no signal yet: nothing to stop for


def seed_report(tau: float, tree: float, domains: dict[str, tuple[float, float]]) -> dict:
    def part(chain: float, tree_tau: float) -> dict:
        return {
            "tau": chain,
            "prompts": 3,
            "trees": {"64": {"tau": tree_tau, "top_k": 8, "rounds": 10}},
            "per_depth": {"top1": [0.5, None], "accepted": [0.4, 0.1]},
        }

    return {**part(tau, tree), "domains": {name: part(*values) for name, values in domains.items()}}


def test_the_table_has_each_objective_s_domains_with_mean_interval_and_gap_and_the_paired_change():
    report = QualityReport(
        results={
            "ce": {
                0: seed_report(2.0, 3.0, {"code": (1.5, 2.5), "prose": (2.5, 3.5)}),
                1: seed_report(2.2, 3.2, {"code": (1.7, 2.7), "prose": (2.7, 3.7)}),
            },
            "ce+tv": {
                0: seed_report(2.0, 3.3, {"code": (1.5, 2.5), "prose": (2.5, 3.5)}),
                1: seed_report(2.2, 3.2, {"code": (1.7, 2.7), "prose": (2.7, 3.7)}),
            },
        },
        training={"ce": {0: {"step": 10, "streak": 1.5}}},
        evals={"ce": {0: [(1.0, 2.0), (2.0, 2.5), (3.0, 2.4)]}},
        stage_seconds={"eval": 12.0},
    )
    sure = {"tokens": 30, "entropy_bits": 1.25, "top1_prob": 0.7, "sure": 0.5, "unsure": 0.2}
    report.results["ce"][0]["target_predictability"] = {"all": sure}
    lines = format_table(report)
    half = 12.706 * 0.1 * math.sqrt(2) / math.sqrt(2)  # t(1) x stdev of (2.0, 2.2) / sqrt(2)
    assert "target's answers, all: 30 tokens, entropy 1.25 bits/token, top-1 probability 0.70; " in "".join(
        lines
    )
    assert lines[0] == "objective ce: held-out acceptance over 2 seed(s) (mean +- 95% interval):"
    assert lines[2].split()[:2] == ["all", "3"]
    assert lines[2].split()[2:4] == ["2.100", f"+-{half:.3f}"]
    assert lines[3].startswith("code") and "1.600" in lines[3] and "2.600" in lines[3]
    assert lines.count("gap between the best and the worst domain (chain tau): 1.000") == 2
    # tree@64: +10% on seed 0, 0% on seed 1 -> +5% +- t(1) x stdev(10, 0) / sqrt(2)
    paired = next(line for line in lines if line.startswith("ce+tv vs ce"))
    assert f"tree@64 +5.0% +-{12.706 * 5:.1f}" in paired and "tau +0.0% +-0.0" in paired
    assert "ce: rank correlation of tree_streak with held-out tree tau over evals: seed 0 +0.50" in lines
    assert 'ce seed 0: last training line {"step": 10, "streak": 1.5}' in lines and "stage eval: 12s" in lines


def test_the_paired_change_is_per_seed_relative_and_skips_seeds_one_side_lacks():
    baseline = {0: seed_report(2.0, 4.0, {}), 1: seed_report(2.0, 4.0, {}), 2: seed_report(1.0, 1.0, {})}
    other = {0: seed_report(2.2, 4.4, {}), 1: seed_report(2.2, 4.8, {})}
    change = paired_change(baseline, other)
    assert change["tau"] == pytest.approx((10.0, 0.0))
    assert change["tree@64"] == pytest.approx((15.0, 12.706 * statistics.stdev([10.0, 20.0]) / math.sqrt(2)))


def test_the_rank_correlation_is_spearman_with_tied_ranks():
    assert rank_correlation([(1, 10), (2, 20), (3, 30), (4, 40)]) == pytest.approx(1.0)
    assert rank_correlation([(1, 40), (2, 30), (3, 20), (4, 10)]) == pytest.approx(-1.0)
    # ties share the mean rank: x ranks (0.5, 0.5, 2, 3), y ranks (0, 1, 2, 3)
    expected = statistics.correlation([0.5, 0.5, 2, 3], [0, 1, 2, 3])
    assert rank_correlation([(5, 1), (5, 2), (6, 3), (7, 4)]) == pytest.approx(expected)
    assert rank_correlation([(1, 1), (2, 2)]) is None and rank_correlation([(1, 1), (1, 2), (1, 3)]) is None


def test_the_eval_trajectory_pairs_each_eval_with_the_training_metric_logged_before_it(tmp_path):
    records = [
        {"step": 50, "loss": 3.0, "streak": 0.5, "tree_streak": 1.0},
        {"step": 100, "eval": {"tau": 1.2, "tree_tau": 1.5}},
        {"step": 100, "loss": 2.9, "streak": 0.6, "tree_streak": 1.2},
        {"step": 150, "loss": 2.8, "streak": 0.7, "tree_streak": 1.4},
        {"step": 200, "eval": {"tau": 1.3, "tree_tau": 1.7}},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert eval_trajectory(tmp_path) == [(1.0, 1.5), (1.4, 1.7)]
    assert eval_trajectory(tmp_path / "missing") == []
    with (tmp_path / "metrics.jsonl").open("a") as metrics:  # a last window too short for a tree round
        metrics.write(
            json.dumps({"step": 210, "loss": 2.7, "acc": 0.4, "streak": 0.8, "tree_streak": None}) + "\n"
        )
    assert last_training_line(tmp_path) == {
        "step": 210,
        "loss": 2.7,
        "acc": 0.4,
        "streak": 0.8,
        "tree_streak": 1.4,
    }


def test_a_stop_signal_reaches_the_live_children_which_finish_and_no_later_child_starts(monkeypatch):
    """SIGTERM to the benchmark (a call's time limit): each running child gets it and its handler runs
    to the end (a training run's checkpoint) while the benchmark relays its output; the child waiting
    for a slot never starts; the stage stops with one line."""
    child = (
        "import signal, sys, time\n"
        "def stop(*_):\n"
        "    time.sleep(0.3)\n"  # the checkpoint being written
        "    print('checkpointed', sys.argv[1], flush=True)\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('started', sys.argv[1], flush=True)\n"
        "time.sleep(60)\n"
    )
    monkeypatch.setattr(quality, "DFLASH", [sys.executable, "-c", child])
    # a relay of its own: the signal it records would otherwise stop whichever test runs children next
    monkeypatch.setattr(quality, "STOP", quality.StopRelay())
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        if (
            sum(line.startswith("[") and " started " in line for line in lines) == 2
            and "stopping" not in lines
        ):
            lines.append("stopping")
            os.kill(os.getpid(), signal.SIGTERM)

    children = [("a", ["a"]), ("b", ["b"]), ("c", ["c"])]
    with quality.STOP.installed(), pytest.raises(UserError) as stopped:
        run_children(children, jobs=2, log=log)
    assert str(stopped.value) == (
        "bench quality: stopped by SIGTERM (the runs checkpointed, the datagen answers that ended are "
        "kept); the same command resumes"
    )
    assert {"[a] checkpointed a", "[b] checkpointed b"} <= set(lines)
    assert not any(line.startswith("[c]") for line in lines)
    assert signal.getsignal(signal.SIGTERM) is not quality.STOP._relay  # handlers restored after


def test_a_summary_of_one_seed_keeps_its_figures_and_a_result_without_domains_has_only_all():
    one = seed_report(2.0, 3.0, {"code": (1.5, 2.5)})
    row = {"prompts": 3, "top1_per_depth": [0.5, None], "accepted_per_depth": [0.4, 0.1]}
    assert summarize([one]) == {
        "all": {"tau": (2.0, 0.0), "tree@64": (3.0, 0.0), **row},
        "code": {"tau": (1.5, 0.0), "tree@64": (2.5, 0.0), **row},
    }
    plain = {key: value for key, value in one.items() if key != "domains"}
    assert list(summarize([plain, plain])) == ["all"] and summarize([]) == {}
    # per depth: the mean over the seeds that reached that depth; a figure one seed lacks is left out
    other = seed_report(2.0, 3.0, {})
    other["per_depth"] = {"top1": [0.7, 0.3], "top4": [0.9]}
    summary = summarize([plain, other])["all"]
    assert summary["top1_per_depth"] == pytest.approx([0.6, 0.3]) and "top4_per_depth" not in summary
    one["per_depth"] = {"top1": [0.5], "top4": [0.7], "top8": [0.8], "accepted": [0.4]}
    assert [(key, value) for key, value in summarize([one])["all"].items() if key.endswith("_per_depth")] == [
        ("top1_per_depth", [0.5]),
        ("top4_per_depth", [0.7]),
        ("top8_per_depth", [0.8]),
        ("accepted_per_depth", [0.4]),
    ]


def test_a_pairing_over_one_common_seed_and_a_rank_correlation_of_two_distinct_values():
    change = paired_change(
        {3: seed_report(2.0, 4.0, {})}, {3: seed_report(2.5, 3.0, {}), 4: seed_report(9, 9, {})}
    )
    assert change == {"tau": pytest.approx((25.0, 0.0)), "tree@64": pytest.approx((-25.0, 0.0))}
    two_xs = [(1, 1), (1, 2), (2, 3)]
    assert rank_correlation(two_xs) == pytest.approx(statistics.correlation([0.5, 0.5, 2], [0, 1, 2]))
    assert rank_correlation([(y, x) for x, y in two_xs]) == pytest.approx(rank_correlation(two_xs))


def test_the_table_of_one_domain_has_no_gap_and_an_undefined_correlation_says_why():
    assert format_table(QualityReport()) == ["bench quality: nothing evaluated"]
    seeds = {0: seed_report(2.0, 3.0, {"code": (2.0, 3.0)}), 1: seed_report(2.0, 3.0, {"code": (2.0, 3.0)})}
    report = QualityReport(
        results={"ce": seeds, "tv": {0: seed_report(2.2, 3.3, {}), 1: seed_report(2.2, 3.3, {})}},
        evals={"tv": {0: [(1.0, 2.0)], 1: [(1.0, 2.0), (2.0, 3.0), (3.0, 4.0)]}},
    )
    lines = format_table(report)
    assert lines[1] == "domain     prompts            tau        tree@64"
    assert not any(line.startswith("gap") or line.startswith("target's") for line in lines)
    assert "tv vs ce (paired by seed, mean +- 95% interval): tau +10.0% +-0.0, tree@64 +10.0% +-0.0" in lines
    assert (
        "tv: rank correlation of tree_streak with held-out tree tau over evals: seed 0 n/a (under 3 evals), seed 1 +1.00"
        in lines
    )


def test_the_report_file_has_the_results_their_summary_and_the_comparisons(tmp_path):
    seeds = {0: seed_report(2.0, 3.0, {}), 1: seed_report(2.2, 3.2, {})}
    seeds[0]["target_predictability"] = {"all": {"tokens": 30}}
    report = QualityReport(
        results={"ce": seeds, "tv": {1: seed_report(2.2, 3.52, {})}},
        training={"ce": {1: {"step": 10}}},
        evals={"ce": {0: [(1.0, 2.0), (2.0, 2.5), (3.0, 2.4)]}},
        stage_seconds={"eval": 12.0},
    )
    write_report(report, tmp_path / "quality.json")
    written = json.loads((tmp_path / "quality.json").read_text())
    assert written["results"] == {
        "ce": {"0": seeds[0], "1": seeds[1]},
        "tv": {"1": seed_report(2.2, 3.52, {})},
    }
    assert written["training"] == {"ce": {"1": {"step": 10}}} and written["stage_seconds"] == {"eval": 12.0}
    assert written["summary"]["ce"] == json.loads(json.dumps(summarize([seeds[0], seeds[1]])))
    assert written["baseline"] == "ce" and list(written["paired_change_percent"]) == ["tv"]
    assert written["paired_change_percent"]["tv"] == {
        "tau": [0.0, 0.0],
        "tree@64": pytest.approx([10.0, 0.0]),
    }
    assert written["rank_correlation"] == {"ce": {"0": pytest.approx(0.5)}}
    assert written["target_predictability"] == {"all": {"tokens": 30}}
    assert written["evals"] == {"ce": {"0": [[1.0, 2.0], [2.0, 2.5], [3.0, 2.4]]}}
    write_report(QualityReport(), tmp_path / "empty.json")
    empty = json.loads((tmp_path / "empty.json").read_text())
    assert empty["baseline"] is None and empty["target_predictability"] == {} and empty["summary"] == {}


def student_t_cdf_above_zero(t: float, degrees: int, steps: int = 20000) -> float:
    """P(0 <= T <= t) for Student's t with `degrees` of freedom: its density, integrated by Simpson's rule."""
    scale = math.exp(math.lgamma((degrees + 1) / 2) - math.lgamma(degrees / 2)) / math.sqrt(degrees * math.pi)

    def density(x: float) -> float:
        return scale * (1 + x * x / degrees) ** (-(degrees + 1) / 2)

    h = t / steps
    inner = sum((4 if i % 2 else 2) * density(i * h) for i in range(1, steps))
    return (density(0) + inner + density(t)) * h / 3


def test_the_t_quantile_is_students_and_never_too_narrow_for_any_seed_count() -> None:
    """The intervals over 11-30 seeds used 1.96 (4-12% too narrow): every tabled quantile is the 0.975
    point of Student's t by its definition (to the table's 3 decimals), and a seed count between the
    entries gets the next lower one's, which is wider, never narrower."""
    for degrees in quality_report.T_975:
        assert student_t_cdf_above_zero(quality_report.T_975[degrees], degrees) == pytest.approx(
            0.475, abs=2e-4
        )
    for degrees in range(1, 200):
        assert student_t_cdf_above_zero(quality_report.t_975(degrees), degrees) >= 0.475 - 2e-4, degrees
