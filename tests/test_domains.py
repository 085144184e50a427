"""The `domain` label of a prompt record: through datagen's shards into the tokenized training data."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from app.config.schema import DataConfig
from app.data.dataset import DataSummary, TokenizedDataset, load_tokenized
from app.datagen import run_datagen
from app.datagen.prompts import load_prompts
from app.datagen.store import SHARD_SCHEMA
from tests.datagen_helpers import make_config, output_rows, quiet_console, write_jsonl
from tests.datagen_server import ScriptedServer

DOMAINS = ["code", "prose", "math", None, "prose", "code", "math", "math", None, "code"]
"""Record i's domain (None: the record has no `domain` field)."""


def labelled_prompts(domains: list[str | None]) -> list[dict[str, Any]]:
    """Records whose user turn names their index (`q007`), so a tokenized sample can be traced back."""
    records = []
    for index, domain in enumerate(domains):
        record: dict[str, Any] = {
            "id": f"r{index}",
            "messages": [{"role": "user", "content": f"q{index:03d} please answer this question"}],
        }
        if domain is not None:
            record["domain"] = domain
        records.append(record)
    return records


def load(files: list[str], tmp_path: Path, tokenizer: Any) -> TokenizedDataset:
    data = DataConfig(cache_dir=str(tmp_path / "cache"), max_length=256, token_budget=512)
    return load_tokenized(files, data, tokenizer, min_supervised_tokens=1)


def record_indices(dataset: TokenizedDataset, tokenizer: Any) -> list[int]:
    """Which prompt record each sample was made from, read from its tokens."""
    texts = [tokenizer.decode(ids) for ids, _ in dataset.fetch(range(len(dataset)))]
    return [int(re.search(r"q(\d{3})", text).group(1)) for text in texts]  # type: ignore[union-attr]


def test_domains_go_through_datagen_shards_into_the_tokenized_data_and_survive_select(
    scripted: ScriptedServer, tmp_path: Path, tiny_tokenizer: Any
) -> None:
    output = tmp_path / "regenerated"
    prompts = write_jsonl(tmp_path / "p.jsonl", labelled_prompts(DOMAINS))
    report = run_datagen(make_config(prompts, output, [scripted.url], shard_size=3), quiet_console())
    assert report.done == len(DOMAINS)
    assert {row["id"]: row["domain"] for row in output_rows(output)} == {
        f"r{index}": domain for index, domain in enumerate(DOMAINS)
    }

    dataset = load([str(output)], tmp_path, tiny_tokenizer)
    origin = record_indices(dataset, tiny_tokenizer)
    assert sorted(origin) == list(range(len(DOMAINS)))
    assert dataset.domains == [DOMAINS[index] or "" for index in origin]
    assert dataset.summary.domains == {"code": 3, "prose": 2, "math": 3}
    assert "  domains: code 30%, math 30%, prose 20%, (none) 20%" in dataset.summary.describe()

    order = [7, 2, 9, 0, 4]
    chosen = dataset.select(order)
    assert chosen.domains == [dataset.domains[index] for index in order]
    assert chosen.domains == [DOMAINS[index] or "" for index in record_indices(chosen, tiny_tokenizer)]
    nested = chosen.select([4, 1])
    assert nested.domains == [dataset.domains[4], dataset.domains[2]]


def test_a_domain_that_is_not_a_string_is_a_malformed_record_named_by_its_place(
    tmp_path: Path, tiny_tokenizer: Any
) -> None:
    records = labelled_prompts(["code", "prose", "math"])
    records[1]["domain"] = 7
    path = write_jsonl(tmp_path / "p.jsonl", records)
    loaded = load_prompts([str(path)])
    assert [record.domain for record in loaded.records] == ["code", "math"]
    assert [(skip.source, skip.reason) for skip in loaded.malformed] == [
        (f"{path}:2", "`domain` must be a string, got int 7")
    ]

    for record, answer in zip(records, ("one two three", "four five six", "seven eight"), strict=True):
        record["messages"].append({"role": "assistant", "content": answer})
    dataset = load([str(write_jsonl(tmp_path / "c.jsonl", records))], tmp_path, tiny_tokenizer)
    assert (dataset.summary.kept, dataset.summary.malformed) == (2, 1)
    assert dataset.summary.malformed_examples == [
        f"{tmp_path / 'c.jsonl'} line 2: `domain` must be a string, got int 7"
    ]
    assert dataset.domains == ["code", "math"]


def test_records_without_a_domain_keep_their_old_behaviour(tmp_path: Path) -> None:
    records = labelled_prompts([None, ""])
    loaded = load_prompts([str(write_jsonl(tmp_path / "p.jsonl", records))])
    assert [record.domain for record in loaded.records] == [None, None]
    summary = DataSummary(files=[], min_supervised_tokens=1, kept=4)
    assert "domains" not in summary.describe()


def test_shards_written_before_the_domain_column_still_resume_and_load(
    scripted: ScriptedServer, tmp_path: Path, tiny_tokenizer: Any
) -> None:
    """A datagen run resumed across the upgrade: an old shard without `domain` before new ones with it."""
    output = tmp_path / "regenerated"
    output.mkdir()
    old_schema = pa.schema([column for column in SHARD_SCHEMA if column.name != "domain"])
    done = [
        {
            "id": f"r{index}",
            "messages": [
                {
                    "role": "user",
                    "content": f"q{index:03d} please answer this question",
                    "reasoning_content": None,
                },
                {"role": "assistant", "content": "an answer from before", "reasoning_content": None},
            ],
            "reasoning_content": [None, None],
            "finish_reasons": ["stop"],
            "model": "scripted-model",
            "source": f"p.jsonl:{index + 1}",
        }
        for index in range(3)
    ]
    pq.write_table(pa.Table.from_pylist(done, schema=old_schema), output / "part-000000.parquet")
    prompts = write_jsonl(tmp_path / "p.jsonl", labelled_prompts(DOMAINS))
    report = run_datagen(make_config(prompts, output, [scripted.url], shard_size=4), quiet_console())
    assert (report.resumed, report.done) == (3, len(DOMAINS) - 3)

    dataset = load([str(output)], tmp_path, tiny_tokenizer)
    origin = record_indices(dataset, tiny_tokenizer)
    assert sorted(origin) == list(range(len(DOMAINS)))
    expected = ["" if index < 3 else DOMAINS[index] or "" for index in origin]
    assert dataset.domains == expected
