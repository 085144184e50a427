"""`dflash prompts build`: the offline prompt corpus, its quotas, determinism, files and held-out split."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from app.datagen.corpus import DOMAIN_SHARES, build_corpus, source_groups, write_corpus
from app.datagen.prompts import load_prompts

COUNT = 1000
FILES = ("train.jsonl", "heldout.jsonl", "manifest.json")


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("corpus")
    write_corpus(out, seed=7, count=COUNT)
    return out


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def snapshot(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def test_every_domain_gets_its_quota_and_every_record_loads(corpus_dir: Path) -> None:
    manifest = json.loads((corpus_dir / "manifest.json").read_text())
    per_domain = Counter[str]()
    for split in ("train", "heldout"):
        records = read_jsonl(corpus_dir / f"{split}.jsonl")
        assert Counter(record["domain"] for record in records) == manifest["counts"][split]
        per_domain.update(record["domain"] for record in records)
        loaded = load_prompts([str(corpus_dir / f"{split}.jsonl")])
        assert (loaded.malformed, loaded.duplicates) == ([], [])
        assert [record.domain for record in loaded.records] == [record["domain"] for record in records]
        assert all(record.turns[-1].role == "assistant" for record in loaded.records)
    assert sum(per_domain.values()) == COUNT
    for domain, share in DOMAIN_SHARES.items():
        assert per_domain[domain] >= round(COUNT * share) - 1  # math takes the rounding remainder


def test_the_same_seed_writes_identical_bytes_and_another_seed_differs(
    corpus_dir: Path, tmp_path: Path
) -> None:
    write_corpus(tmp_path / "again", seed=7, count=COUNT)
    write_corpus(tmp_path / "other", seed=8, count=COUNT)
    assert snapshot(tmp_path / "again") == snapshot(corpus_dir)
    other = snapshot(tmp_path / "other")
    assert all(other[name] != snapshot(corpus_dir)[name] for name in FILES)
    manifest = json.loads(other["manifest.json"])
    assert manifest["sha256"]["train.jsonl"] != json.loads(snapshot(corpus_dir)["manifest.json"])["sha256"]


def test_held_out_sources_never_reach_the_training_split(corpus_dir: Path) -> None:
    heldout_sources = set(json.loads((corpus_dir / "manifest.json").read_text())["heldout_sources"])
    train = read_jsonl(corpus_dir / "train.jsonl")
    heldout = read_jsonl(corpus_dir / "heldout.jsonl")
    assert {record["source"] for record in train}.isdisjoint(record["source"] for record in heldout)
    train_groups = {group for record in train for group in source_groups(record["source"])}
    assert train_groups.isdisjoint(heldout_sources)
    assert all(heldout_sources.intersection(source_groups(record["source"])) for record in heldout)
    # a held-out package is held out whole: its docstring prompts too
    packages = {group.split(":", 1)[1] for group in heldout_sources if group.startswith("code/pkg:")}
    assert packages and {f"prose/docs:{package}" for package in packages} <= heldout_sources
    for axis in ("code/pkg:", "prose/topics:", "prose/template:", "math/family:"):
        assert any(group.startswith(axis) for group in heldout_sources), axis
    for records in (train, heldout):
        assert {record["domain"] for record in records} == set(DOMAIN_SHARES)
    texts = [record["messages"][-1]["content"] for record in train + heldout]
    assert len(texts) == len(set(texts))  # no prompt is in both splits, nor twice in one


def test_records_carry_sources_modes_and_the_installed_material(corpus_dir: Path) -> None:
    records = read_jsonl(corpus_dir / "train.jsonl") + read_jsonl(corpus_dir / "heldout.jsonl")
    for record in records:
        assert record["source"].startswith(f"{record['domain']}/")
        assert (record["mode"] == "system") == (record["messages"][0]["role"] == "system")
    assert {record["mode"] for record in records} == {"system", "plain"}
    texts = "\n".join(record["messages"][-1]["content"] for record in records)
    assert "Complete this Python function:\ndef " in texts or "Write the body of this function" in texts
    assert "```python\ndef " in texts and "$" in texts


def test_a_failed_write_leaves_the_previous_corpus_whole(
    corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "corpus"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    real_fsync, calls = os.fsync, []

    def full_disk_on_the_second_file(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_disk_on_the_second_file)
    with pytest.raises(OSError, match="No space"):
        write_corpus(out, seed=7, count=COUNT)
    assert snapshot(out) == {"notes.txt": b"mine"}  # no partial file, no temp file

    monkeypatch.setattr(os, "fsync", real_fsync)
    write_corpus(out, seed=7, count=COUNT)
    before = snapshot(out)
    calls.clear()
    monkeypatch.setattr(os, "fsync", full_disk_on_the_second_file)
    with pytest.raises(OSError):
        write_corpus(out, seed=8, count=COUNT)
    assert snapshot(out) == before  # the seed-7 corpus, all three files


def test_too_small_a_count_is_refused() -> None:
    from app.errors import UserError

    with pytest.raises(UserError, match="at least 1000"):
        build_corpus(seed=0, count=999)


def test_the_command_builds_a_corpus_and_reports_its_splits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from app.cli import main  # in this process: an interpreter start costs seconds on 2 cores

    out = tmp_path / "prompts"
    monkeypatch.setattr(
        sys, "argv", ["dflash", "prompts", "build", str(out), "--seed", "7", "--count", "1000"]
    )
    main()  # returns on exit status 0
    printed = capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    assert f"prompts: {sum(manifest['counts']['train'].values())} train + " in printed
    assert "prompts: heldout  code " in printed
    monkeypatch.setattr(sys, "argv", ["dflash", "prompts", "build", str(out), "--count", "10"])
    with pytest.raises(SystemExit) as refused:
        main()
    assert refused.value.code == 2 and "at least 1000" in capsys.readouterr().err


# The math prompts are a pure function of the seed (Python's `random`, the same on every machine and
# version): a corpus seed names the same problems everywhere, and a change to a family's wording or
# number ranges changes every corpus built from then on, so it must be deliberate: update the family's
# digest here (and say so in the change). 50 problems per family reach every branch of its draws.
MATH_DIGESTS = {
    "shopping": "dbddb9c6511e3d81",
    "unit-prices": "96f5ef114ba4efe9",
    "speed": "56bd412dfd978169",
    "travel-time": "6b95eaab6e2538df",
    "ages": "2e8a5d9c966e923e",
    "areas": "682c81de03793c47",
    "fences": "76ed19efe08e5348",
    "discounts": "6e2e5b0cf34386a0",
    "growth": "bc7d4bcfa8e8279f",
    "recipes": "7edb0e2f9bcac8dc",
    "work-rates": "8bacdde86d3c3efd",
    "interest": "36d45baef4296cc7",
    "averages": "dd97771d5cbb909f",
    "fractions": "4c5dd5085b442dce",
    "savings": "944a88d03905d29c",
    "probability": "8f3c58688ce72775",
    "durations": "19db250d678ae341",
}


def test_each_math_family_writes_the_same_problems_for_a_seed_as_before() -> None:
    import hashlib
    import random

    from app.datagen.corpus.arithmetic import FAMILIES, math_problem

    assert list(FAMILIES) == list(MATH_DIGESTS)  # a new family gets its digest; the order is the split's
    changed = {}
    for family, expected in MATH_DIGESTS.items():
        rng = random.Random(f"golden:{family}")
        problems = [math_problem(family, rng) for _ in range(50)]
        if hashlib.sha256("\n".join(problems).encode()).hexdigest()[:16] != expected:
            changed[family] = problems[0]
    assert not changed, f"these families now write other problems (the first shown): {changed}"
