"""`dflash datagen` with `datagen.engine = "local"`: the run's target answers in this process, the
records are the servers' engine's (domain included), and a rerun resumes: nothing lost, nothing twice."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from app.config import validate_config
from app.datagen.local import run_local_datagen
from app.errors import UserError
from app.model.target import load_target
from app.model.tiny_lm import chat_sample
from app.model.tiny_tokenizer import corpus_paragraphs
from tests.datagen_helpers import (
    REPO,
    kill_after_a_timed_shard,
    quiet_console,
    write_run_config,
)
from tests.helpers import dflash
from tests.test_speculative import greedy_reference


def write_prompts(path: Path, count: int = 6) -> Path:
    """`count` of the tiny target's own kind of prompt (a paragraph's opening words), then a record the
    local engine cannot answer (two assistant turns)."""
    paragraphs = [p for p in corpus_paragraphs() if len(p.split()) >= 24][:count]
    with open(path, "w") as handle:
        for index, paragraph in enumerate(paragraphs):
            record = {
                "id": f"p{index}",
                "messages": chat_sample(paragraph)[:1],
                "domain": "prose" if index % 2 else "code",
            }
            handle.write(json.dumps(record) + "\n")
        two_turns = [
            {"role": "user", "content": "Continue: one"},
            {"role": "assistant", "content": "x"},
            {"role": "user", "content": "Continue: two"},
        ]
        handle.write(json.dumps({"id": "multi", "messages": two_turns}) + "\n")
    return path


def config(tmp_path: Path, target: dict | None = None, train: dict | None = None, **datagen):
    """tiny-lm (or `target`) answering `write_prompts`' records on the CPU (or `train`'s device)."""
    return validate_config(
        {
            "target": target or {"builtin": "tiny-lm"},
            "drafter": {"num_layers": 1, "block_size": 4, "mask_token_id": 5},
            "train": train or {"device": "cpu"},
            "datagen": {
                "engine": "local",
                "prompts": [str(write_prompts(tmp_path / "prompts.jsonl"))],
                "output_dir": str(tmp_path / "out"),
                "max_tokens": 12,
                "local_rows": 4,
                "shard_size": 2,
                **datagen,
            },
        }
    )


def rows(output: Path) -> list[dict]:
    return [
        row for shard in sorted(output.glob("part-*.parquet")) for row in pq.read_table(shard).to_pylist()
    ]


def assert_greedy_answers(written: list[dict], run, tokenizer, device: str) -> None:
    """Each record's answer is the target's own greedy decode of its rendered prompt (eager, one
    prompt at a time), cut at the stop token; its finish reason and domain are the record's."""
    target = load_target(run, device)
    for row in written:
        user = row["messages"][0]["content"]
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
        )
        reference = greedy_reference(
            target, tokenizer(text, add_special_tokens=False)["input_ids"], 12, tokenizer.eos_token_id
        )
        stopped = reference[-1] == tokenizer.eos_token_id
        assert (
            row["messages"][1]["content"]
            == tokenizer.decode(reference[:-1] if stopped else reference, skip_special_tokens=True).strip()
        )
        assert row["finish_reasons"] == ["stop" if stopped else "length"]
        assert row["domain"] == ("prose" if int(row["id"][1]) % 2 else "code")
        assert row["messages"][1]["role"] == "assistant"


def test_the_targets_own_greedy_answers_in_datagen_records_and_a_rerun_resumes(tmp_path, tiny_lm_dir):
    run = config(tmp_path)
    report = run_local_datagen(run, quiet_console())
    assert (report.done, report.failed, report.resumed) == (6, 1, 0) and report.exit_code == 0
    written = rows(tmp_path / "out")
    assert sorted(row["id"] for row in written) == [f"p{i}" for i in range(6)]
    rejects = (tmp_path / "out" / ".datagen" / "rejects.jsonl").read_text()
    assert '"id": "multi"' in rejects and "answers one assistant turn" in rejects

    assert_greedy_answers(written, run, AutoTokenizer.from_pretrained(tiny_lm_dir), "cpu")
    assert all(row["model"] == "builtin:tiny-lm" for row in written)

    # a kill lost the last shard: the rerun answers exactly its records again, and only those
    shards = sorted((tmp_path / "out").glob("part-*.parquet"))
    lost = {row["id"] for row in pq.read_table(shards[-1]).to_pylist()}
    shards[-1].unlink()
    again = run_local_datagen(run, quiet_console())
    assert (again.done, again.resumed) == (len(lost), 6 - len(lost))
    assert sorted(rows(tmp_path / "out"), key=lambda r: r["id"]) == sorted(written, key=lambda r: r["id"])


def test_a_stop_signal_commits_the_answers_that_ended_and_the_rerun_answers_the_rest(
    tmp_path, tiny_lm_dir, monkeypatch
):
    """SIGTERM after the second answer (4 rows in flight, 6 prompts): the run ends with 2 records
    written, the 4 prompts in flight are not; the rerun answers exactly those, the same as one run."""
    import os

    from app.datagen.run import RegenerationRun

    whole = rows_of_one_run(tmp_path / "whole")
    answered, committed = RegenerationRun.answered, []

    def answered_then_stop(self, record, *args):
        answered(self, record, *args)
        committed.append(record.id)
        if len(committed) == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # the engine's own handler takes it

    monkeypatch.setattr(RegenerationRun, "answered", answered_then_stop)
    run = config(tmp_path)
    stopped = run_local_datagen(run, quiet_console())
    assert stopped.stopped_by == "SIGTERM" and (stopped.done, stopped.unfinished) == (2, 4)
    assert sorted(row["id"] for row in rows(tmp_path / "out")) == sorted(committed)
    monkeypatch.setattr(RegenerationRun, "answered", answered)
    rest = run_local_datagen(run, quiet_console())
    assert (rest.done, rest.resumed) == (4, 2)
    assert sorted_records(tmp_path / "out") == whole


def test_a_killed_run_kept_what_waited_flush_interval_s_and_its_rerun_owes_exactly_the_rest(
    tmp_path, tiny_lm_dir
):
    """`dflash datagen` on the local engine, SIGKILLed mid-run with shards of 1,000 records: what was
    answered before the last timed commit (`flush_interval_s`, 0.5 s) is on disk, the record that
    failed in an earlier run and is not yet answered is still a reject; the rerun answers exactly the
    missing records, and the committed shards stay as they were."""
    prompts = write_prompts(tmp_path / "many.jsonl", count=10)
    output = tmp_path / "out"
    (output / ".datagen").mkdir(parents=True)
    earlier = {"id": "p9", "source": "earlier", "reason": "an earlier failure", "model": None, "time": "x"}
    (output / ".datagen" / "rejects.jsonl").write_text(json.dumps(earlier) + "\n")
    datagen = {"engine": "local", "prompts": [str(prompts)], "output_dir": str(output), "max_tokens": 24}
    run_config = write_run_config(
        tmp_path / "run.toml", {**datagen, "local_rows": 1, "shard_size": 1000, "flush_interval_s": 0.5}
    )
    kept = kill_after_a_timed_shard(run_config, output, 180)
    kept_ids = [row["id"] for row in rows(output)]
    assert len(kept_ids) == len(set(kept_ids)) >= 1 and "p9" not in kept_ids
    assert {entry["id"] for entry in map(json.loads, (output / ".datagen" / "rejects.jsonl").open())} == {
        "p9",
        "multi",
    }  # carried while still owed, and this run's own failure

    rerun = run_local_datagen(config(tmp_path, prompts=[str(prompts)], max_tokens=24), quiet_console())
    assert (rerun.done, rerun.resumed, rerun.failed) == (10 - len(kept_ids), len(kept_ids), 1)
    assert sorted(row["id"] for row in rows(output)) == sorted(f"p{i}" for i in range(10))
    assert all((output / name).read_bytes() == data for name, data in kept.items())


def rows_of_one_run(root: Path) -> list[dict]:
    root.mkdir()
    run_local_datagen(config(root), quiet_console())
    return sorted_records(root / "out")


def sorted_records(output: Path) -> list[dict]:
    """The records by id, without `source` (it names the prompts file, which differs between runs)."""
    return sorted(
        ({k: v for k, v in row.items() if k != "source"} for row in rows(output)), key=lambda r: r["id"]
    )


def test_other_settings_are_refused_before_the_target_loads(tmp_path, tiny_lm_dir, capsys, monkeypatch):
    run_local_datagen(config(tmp_path, max_tokens=4), quiet_console())
    (tmp_path / "run.json").write_text(
        json.dumps(
            {
                "target": {"builtin": "tiny-lm"},
                "drafter": {"num_layers": 1, "block_size": 4, "mask_token_id": 5},
                "datagen": {
                    "engine": "local",
                    "prompts": [str(tmp_path / "prompts.jsonl")],
                    "output_dir": str(tmp_path / "out"),
                    "max_tokens": 6,
                },
            }
        )
    )
    done = dflash(capsys, monkeypatch, "datagen", str(tmp_path / "run.json"))
    assert done.returncode == 2
    assert "records made with other settings (max_tokens 4 -> 6)" in done.stderr


# The local engine's own settings, each changed alone (top_p < 1 it refuses outright; the model is
# the run's target), and how the refusal names it.
LOCAL_SETTING_CHANGES = {
    "temperature": (0.7, "temperature 0.0 -> 0.7"),
    "max_tokens": (6, "max_tokens 4 -> 6"),
    "seed": (5, "seed None -> 5"),
    "reasoning": ("drop", "reasoning 'keep' -> 'drop'"),
    "chat_template_kwargs": (
        {"enable_thinking": True},
        "chat_template_kwargs {} -> {'enable_thinking': True}",
    ),
}


@pytest.fixture(scope="module")
def finished_local_run(tmp_path_factory, tiny_lm_dir):
    """An output directory whose every record the local engine answered (one run for all the keys)."""
    root = tmp_path_factory.mktemp("local-settings")
    run_local_datagen(config(root, max_tokens=4), quiet_console())
    return root


@pytest.mark.parametrize("key", LOCAL_SETTING_CHANGES)
def test_the_local_engine_refuses_a_rerun_with_any_one_setting_changed(finished_local_run, key):
    recorded = json.loads((finished_local_run / "out" / ".datagen" / "manifest.json").read_text())
    assert set(recorded) == {*LOCAL_SETTING_CHANGES, "model", "top_p"}  # a new setting needs its row
    value, change = LOCAL_SETTING_CHANGES[key]
    with pytest.raises(UserError, match=re.escape(f"other settings ({change})")):
        run_local_datagen(config(finished_local_run, **{"max_tokens": 4, key: value}), quiet_console())


def test_the_local_engine_refuses_a_rerun_with_another_target(finished_local_run, tiny_lm_dir):
    """The same weights under another name are another model: the records name the one that wrote them."""
    other = config(finished_local_run, target={"path": str(tiny_lm_dir)}, max_tokens=4)
    with pytest.raises(
        UserError, match=re.escape(f"other settings (model 'builtin:tiny-lm' -> '{tiny_lm_dir}')")
    ):
        run_local_datagen(other, quiet_console())


def test_bench_decode_streams_the_config_s_prompts_and_profiles_its_step(tmp_path, tiny_lm_dir):
    """`dflash bench decode` on the local engine's own path: the prompts it renders (the two-turn record
    refused as datagen refuses it), the decode line, the step alone against the stream's, and a profile
    of the step's operators."""
    from app.bench.decode import run_decode_bench

    lines: list[str] = []
    run_decode_bench(config(tmp_path), count=7, profile_steps=8, log=lines.append)
    assert any(line.startswith("bench decode: 6 prompts of 7, shape DecodeShape(rows=4,") for line in lines)
    decoded = next(line for line in lines if line.startswith("decode: "))
    assert re.search(r"answer tokens in .* steps of 4 rows, [\d.]+ ms a step; answers filled \d+%", decoded)
    alone = re.fullmatch(
        r"bench decode: a step alone \(replayed back to back, the same rows\) ([\d.]+) ms, in the stream "
        r"([\d.]+) ms: (\d+)% of the stream's step is not the step itself",
        lines[-2],
    )
    assert alone and 0 <= int(alone[3]) < 100, lines[-2]
    # per step, as the stream's figure is: the same forward at the same rows, well within 3x of it
    assert 0 < float(alone[1]) < 3 * float(alone[2]), lines[-2]
    assert "8 decode steps" in lines[-1] and "aten::" in lines[-1]  # on a CPU: host operators by self time


REFUSAL_BEFORE_TORCH = """
import json, sys
from app.config import validate_config
from app.datagen.local import run_local_datagen
from app.errors import UserError
try:
    run_local_datagen(validate_config(json.loads(sys.argv[1])))
except UserError as error:
    print(json.dumps({"refused": str(error), "torch": "torch" in sys.modules}))
"""


@pytest.mark.parametrize(
    ("datagen", "refusal"),
    [
        ({"top_p": 0.5}, "datagen.top_p: the local engine samples from the whole distribution; set it to 1"),
        ({"prompts_text": ""}, "datagen.prompts: no usable prompt records in"),
    ],
    ids=["top_p", "no-prompts"],
)
def test_the_refusal_comes_before_torch_loads(tmp_path, datagen, refusal):
    """A bad input is one line at once, not after the seconds torch takes to load."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        datagen.pop("prompts_text", json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
    )
    run = {
        "target": {"builtin": "tiny-lm"},
        "drafter": {"num_layers": 1, "block_size": 4, "mask_token_id": 5},
        "datagen": {
            "engine": "local",
            "prompts": [str(prompts)],
            "output_dir": str(tmp_path / "out"),
            **datagen,
        },
    }
    done = subprocess.run(
        [sys.executable, "-c", REFUSAL_BEFORE_TORCH, json.dumps(run)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["refused"].startswith(refusal)
    assert result["torch"] is False
