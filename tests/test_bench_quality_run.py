"""A whole `dflash bench quality` on the CPU: every stage in a real `dflash` child (datagen, train, eval)
over a seeded random-weight target, one arm and one seed at the smallest shapes. The drafter learns
nothing in two steps; what is checked is the driver: the stages' order and commands, what the report
gathers from each run, and where it keeps them; then a rerun, which finds every stage done (what a rerun
skips is tested a stage at a time in tests/test_bench_quality.py)."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import time

import pytest
import yaml

from app.bench.quality import QualityPlan, run_quality
from app.errors import UserError
from tests.helpers import random_target_config

DOMAINS = ("code", "math", "prose")
SMALLEST = [
    "datagen.engine=local",
    "datagen.local_decode=eager",  # a compiled CPU decode costs a minute here, and is tested elsewhere
    "datagen.max_tokens=20",  # every random answer runs to its end: 20 >= 2 blocks of supervised tokens
    "train.max_steps=2",
    "train.eval_every=2",
    "train.eval_max_new_tokens=4",
    "train.save_every=2",
    "telemetry.log_every=1",
]


def prompt_record(domain: str, number: int) -> str:
    content = f"Explain {domain} example {number}: what does the tensor hold after the loop?"
    message = {"role": "user", "content": content}
    return json.dumps({"id": f"{domain}-{number}", "domain": domain, "messages": [message]}) + "\n"


@pytest.fixture
def staged_plan(tmp_path, tiny_tokenizer_dir) -> QualityPlan:
    """A benchmark whose prompts stage is already done (a manifest, 6 training and 2 held-out prompts per
    domain): the corpus takes 1000 prompts at least, and answering them all on a CPU takes minutes."""
    config = random_target_config(tiny_tokenizer_dir, tmp_path / "unused-data", tmp_path / "unused-run")
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    prompts = tmp_path / "work" / "prompts"
    prompts.mkdir(parents=True)
    (prompts / "train.jsonl").write_text("".join(prompt_record(d, n) for n in range(6) for d in DOMAINS))
    (prompts / "heldout.jsonl").write_text(
        "".join(prompt_record(d, 100 + n) for n in range(2) for d in DOMAINS)
    )
    (prompts / "manifest.json").write_text("{}")
    return QualityPlan(
        config_file=str(config_file),
        overrides=SMALLEST,
        workdir=tmp_path / "work",
        seeds=[3],
        prompt_count=1000,
        eval_prompts=1,
        max_new_tokens=4,
        budgets=[2, 4],
        variants={"base": []},
    )


def commands(lines: list[str]) -> list[list[str]]:
    """Each child's command line, as the benchmark logged it before starting it."""
    return [
        line.split("$ dflash ", 1)[1].split() for line in lines if line.startswith("bench quality: $ dflash ")
    ]


def test_a_whole_benchmark_runs_each_stage_in_a_child_and_reports_what_each_run_measured(staged_plan):
    plan, arm = staged_plan, ("base", 3)
    lines: list[str] = []
    started = time.monotonic()
    report = run_quality(plan, lines.append)
    elapsed = time.monotonic() - started

    stages = ["prompts", "data", "train", "eval"]
    assert not [line for line in lines if "configured servers" in line]  # the override made it local
    assert [line for line in lines if re.fullmatch(r"bench quality: \w+ \.\.\.", line)] == [
        f"bench quality: {stage} ..." for stage in stages
    ]
    assert [
        m[1] for line in lines if (m := re.fullmatch(r"bench quality: (\w+) done in \d+s", line))
    ] == stages
    assert list(report.stage_seconds) == stages
    assert all(0 <= s <= elapsed for s in report.stage_seconds.values())
    assert report.stage_seconds["train"] > 1  # a real training child, timed
    # the training split's answers, then the eval split's (eagerly), then the arm's run and its eval
    ran = commands(lines)
    assert [command[0] for command in ran] == ["datagen", "datagen", "train", "eval"]
    assert f"datagen.prompts=['{plan.prompts_dir / 'train.jsonl'}']" in ran[0]
    assert f"datagen.output_dir={plan.data_dir('eval')}" in ran[1] and "datagen.local_decode=eager" in ran[1]
    assert "train.seed=3" in ran[2] and "--resume" not in ran[2]
    assert ran[3][1] == str(plan.run_dir(arm))
    # the eval split: the first held-out prompt of each domain
    eval_split = (plan.prompts_dir / "eval.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in eval_split] == [f"{d}-100" for d in DOMAINS]
    assert any(plan.data_dir("eval").iterdir()) and any(plan.data_dir("train").iterdir())

    # what the report holds: the eval's own file, the run's last training line and its periodic evals
    result = report.results["base"][3]
    assert result == json.loads(plan.eval_file(arm).read_text())
    assert result["step"] == 2 and result["prompts"] == 3 and set(result["domains"]) == set(DOMAINS)
    assert set(result["trees"]) == {"2", "4"}
    assert report.training["base"][3]["step"] == 2 and "streak" in report.training["base"][3]
    ((streak, tree_tau),) = report.evals["base"][3]  # eval_every=2 over 2 steps: one periodic eval
    assert streak >= 0 and tree_tau >= 1
    assert set(report.results) == set(report.training) == set(report.evals) == {"base"}

    # a rerun finds every stage done: each split's datagen resumes to nothing, the arm is trained and
    # evaluated, and the report is gathered again from the same files
    again: list[str] = []
    assert run_quality(plan, again.append).results == report.results
    assert [command[0] for command in commands(again)] == ["datagen", "datagen"]
    assert f"bench quality: base seed 3: {plan.run_dir(arm)} is trained" in again


def test_a_benchmark_whose_datagen_goes_through_servers_says_so_then_builds_its_corpus(staged_plan):
    """The recipe's own engine (servers, tiny.toml's default) over a target that is not built in: the
    first line says where the answers come from. No prompts are staged: the corpus is written and its
    counts logged. The training split's output folder is a file, so the first datagen child refuses at
    once and the benchmark stops there."""
    plan = dataclasses.replace(staged_plan, overrides=[o for o in SMALLEST if not o.startswith("datagen.")])
    shutil.rmtree(plan.prompts_dir)
    plan.data_dir("train").parent.mkdir(parents=True)
    plan.data_dir("train").write_text("not a folder")
    lines: list[str] = []
    with pytest.raises(UserError, match="`dflash datagen` exited 2"):
        run_quality(plan, lines.append)
    assert lines[0] == "bench quality: datagen goes through the configured servers (datagen.engine = servers)"
    manifest = json.loads((plan.prompts_dir / "manifest.json").read_text())
    counts = [
        json.loads(line.split(": ", 2)[2]) for line in lines if line.startswith("bench quality: prompts: ")
    ]
    assert counts == [manifest["counts"]]
    assert (plan.prompts_dir / "eval.jsonl").is_file()
    ended = [m[1] for line in lines if (m := re.fullmatch(r"bench quality: (\w+) done in \d+s", line))]
    assert ended == ["prompts"]  # the data stage failed: it is not said to be done
    assert "datagen.output_dir: cannot create" in lines[-1]  # the child's own refusal, relayed
