"""Conversation files -> a tokenized, filtered dataset, built once and cached.

Sources are local only: jsonl / json / parquet / arrow files, directories of such shards, or
directories written by `datasets.save_to_disk`. Every record is normalised (`formats`), rendered
with the target's chat template and masked (`tokenize`); malformed records and conversations with
too little supervision are counted and skipped, never fatal. The result lives under
`data.cache_dir/<key>/`, where the key hashes the files (path, size, mtime), the tokenizer's content
and the config fields that shape tokenization, so a second load is a memory-mapped read.

This step needs only the tokenizer: a dataset that is empty after filtering fails here, before any
model is loaded.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import gzip
import hashlib
import json
import logging
import os
import shutil
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from datasets.exceptions import DatasetGenerationError
from transformers import PreTrainedTokenizerBase

from app.atomic import publish_directory, staging_directory
from app.config.schema import DataConfig, RunConfig
from app.data.formats import (
    Conversation,
    MalformedRecord,
    RecordFormat,
    detect_format,
    normalize_record,
    record_domain,
    require_format_column,
)
from app.data.sources import Source, resolve_sources, source_members
from app.data.textfiles import open_binary, require_utf8
from app.data.tokenize import ChatTokenizer, TokenizedSample
from app.errors import UserError
from app.locks import held
from app.paths import cache_root

log = logging.getLogger(__name__)

PIPELINE_VERSION = 2
"""Part of the cache key: bump it when tokenization semantics or the cached columns change so old
caches stop matching (2: the per-sample `domain` column)."""

MAX_EXAMPLES = 5
"""Malformed-record reasons kept in the summary (the counts are always complete)."""

SUMMARY_FILE = "summary.json"
LOCK_FILE = ".lock"
"""In the cache root: held by the one process tokenizing into it."""
JSON_LINE_COLUMN = "_json_line"
"""Raw-text column used when a json file has lines that are not valid JSON."""

TOKENIZED_FEATURES = datasets.Features(
    {
        "input_ids": datasets.List(datasets.Value("int32")),
        "loss_mask": datasets.List(datasets.Value("bool")),
        "length": datasets.Value("int32"),
        "supervised": datasets.Value("int32"),
        "truncated": datasets.Value("bool"),
        "status": datasets.Value("string"),
        "reason": datasets.Value("string"),
        "domain": datasets.Value("string"),
    }
)
BOOKKEEPING_COLUMNS = ["truncated", "status", "reason"]


@dataclass
class DataSummary:
    """What loading did to the data: every record is accounted for."""

    files: list[str]
    min_supervised_tokens: int
    records: int = 0
    malformed: int = 0
    malformed_examples: list[str] = field(default_factory=list)
    too_short: int = 0
    kept: int = 0
    truncated: int = 0
    tokens: int = 0
    supervised_tokens: int = 0
    cache_hit: bool = False
    cache_path: str = ""
    domains: dict[str, int] = field(default_factory=dict)
    """Kept samples per `domain` label; samples of records without one are not listed."""

    def describe(self) -> str:
        origin = "cache hit" if self.cache_hit else "tokenized"
        lines = [
            f"data ({origin}, {self.cache_path}): {self.records} records read, {self.malformed} malformed, "
            f"{self.too_short} with < {self.min_supervised_tokens} supervised tokens, {self.kept} kept "
            f"({self.truncated} truncated); {self.tokens} tokens, {self.supervised_tokens} supervised"
        ]
        if self.domains:
            lines.append(f"  domains: {self.domain_mix()}")
        lines += [f"  malformed: {example}" for example in self.malformed_examples]
        return "\n".join(lines)

    def domain_mix(self) -> str:
        """`code 41%, prose 35%, math 24%`: each domain's share of the kept samples, largest first;
        samples without a domain are `(none)`."""
        shares = sorted(self.domains.items(), key=lambda item: (-item[1], item[0]))
        unlabelled = self.kept - sum(self.domains.values())
        if unlabelled > 0:
            shares.append(("(none)", unlabelled))
        return ", ".join(f"{name} {count / max(self.kept, 1):.0%}" for name, count in shares)


@dataclass
class RecordLocator:
    """Maps a row of a source back to where it is for messages: the line of a JSON lines file, else the
    file of a multi-file source and the (0-based) record index in it."""

    files: list[str]
    starts: list[int]
    lines_of: Path | None = None
    """A JSON lines file: its rows are named by line number, as an editor shows them."""

    def __call__(self, row: int) -> str:
        if self.lines_of is not None:
            stat = self.lines_of.stat()
            return f"{self.files[0]} line {_record_lines(self.lines_of, stat.st_mtime_ns, stat.st_size)[row]}"
        file = bisect.bisect_right(self.starts, row) - 1
        return f"{self.files[file]} record {row - self.starts[file]}"


@functools.lru_cache(maxsize=4)
def _record_lines(path: Path, mtime_ns: int, size: int) -> list[int]:
    """The 1-based number of each line of a JSON lines file that holds a record: the json reader and
    the line-by-line fallback both skip blank lines. Read only once a record is malformed."""
    with open_binary(path) as handle:
        return [number for number, line in enumerate(handle, start=1) if line.strip()]


def _is_json_lines(path: Path) -> bool:
    """Whether a json file is JSON lines rather than one top-level array of records."""
    with open_binary(path) as handle:
        while chunk := handle.read(4096):
            if stripped := chunk.lstrip():
                return not stripped.startswith(b"[")
    return True


class TokenizedDataset:
    """Tokenized conversations: `input_ids`, `loss_mask`, `length`, `supervised`, `domain` per sample."""

    def __init__(self, rows: datasets.Dataset, summary: DataSummary) -> None:
        self.rows = rows
        self.summary = summary
        self.lengths: np.ndarray = rows.with_format("numpy", columns=["length"])[:]["length"].astype(np.int64)
        self._samples = rows.with_format("numpy", columns=["input_ids", "loss_mask"])

    def __len__(self) -> int:
        return len(self.rows)

    @functools.cached_property
    def domains(self) -> list[str]:
        """Each sample's `domain` label, in sample order ("" for a record without one); read from the
        rows, so a `select` is aligned by construction."""
        if "domain" not in self.rows.column_names:
            return [""] * len(self.rows)
        return self.rows.with_format("arrow", columns=["domain"])[:]["domain"].to_pylist()

    def fetch(self, indices: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(input_ids, loss_mask) of each sample, in the order asked."""
        columns = self._samples[list(indices)]
        return list(zip(columns["input_ids"], columns["loss_mask"], strict=True))

    def select(self, indices: Sequence[int]) -> TokenizedDataset:
        return TokenizedDataset(self.rows.select(indices), self.summary)


def load_tokenized(
    files: Sequence[str],
    data: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    min_supervised_tokens: int,
) -> TokenizedDataset:
    """Tokenize `files` with `tokenizer` (or read the cached result) and keep the trainable samples.

    `min_supervised_tokens` is 2 x drafter.block_size for training: fewer supervised tokens cannot
    fill a block. Raises `UserError` naming the files and counts when nothing is left.
    """
    if not files:
        raise UserError("data.train_files: no data files given")
    sources = resolve_sources(files)
    chat = ChatTokenizer(
        tokenizer, max_length=data.max_length, chat_template_kwargs=data.chat_template_kwargs
    )
    root = Path(data.cache_dir).expanduser() if data.cache_dir else cache_root() / "tokenized"
    key = cache_key(sources, tokenizer, data, min_supervised_tokens)
    final = root / key
    if (final / SUMMARY_FILE).is_file():
        return _cache_hit(final)
    with _building_in(root, data):
        # The lock holder is the only builder here, so a staging directory of this key is a killed
        # build's; and a process that waited for another one's build of this key reads it.
        if (final / SUMMARY_FILE).is_file():
            return _cache_hit(final)
        for abandoned in root.glob(f".{key}.*"):
            if abandoned.is_dir():
                shutil.rmtree(abandoned, ignore_errors=True)
        try:
            build = staging_directory(root / key)
        except OSError as error:
            raise _unwritable_cache(root, data, error) from None
        try:
            rows, summary = _tokenize_sources(sources, chat, data, min_supervised_tokens, build, key)
            summary.cache_path = str(final)
            rows.save_to_disk(str(build / "dataset"))
            (build / SUMMARY_FILE).write_text(json.dumps(asdict(summary), indent=1))
            shutil.rmtree(build / "work")
            if not publish_directory(build, final):  # a host not sharing the lock finished first
                log.info("tokenized data: another process finished %s first; using it", final)
        finally:
            shutil.rmtree(build, ignore_errors=True)
    log.info("tokenized data: %d of %d records kept, cached at %s", summary.kept, summary.records, final)
    return TokenizedDataset(datasets.load_from_disk(str(final / "dataset")), summary)


@contextlib.contextmanager
def _building_in(root: Path, data: DataConfig) -> Iterator[None]:
    """Hold the cache root's lock, so that one process tokenizes into it at a time; a root that cannot
    be made or written is the setting's one line."""
    with contextlib.ExitStack() as holding:
        try:
            root.mkdir(parents=True, exist_ok=True)
            holding.enter_context(
                held(root / LOCK_FILE, waiting=lambda waited: log.warning("tokenized data: %s", waited))
            )
        except OSError as error:
            raise _unwritable_cache(root, data, error) from None
        yield


def _unwritable_cache(root: Path, data: DataConfig, error: OSError) -> UserError:
    """The tokenized cache cannot be made or written (a read-only file system, no permission): the
    setting that put it there, not the OS's traceback."""
    setting = f"data.cache_dir = {data.cache_dir}" if data.cache_dir else f"DFLASH_CACHE ({root.parent})"
    return UserError(
        f"{setting}: cannot create or write the tokenized cache {root} ({error.strerror or error}); point "
        f"{'data.cache_dir' if data.cache_dir else 'DFLASH_CACHE'} at a writable directory"
    )


def _cache_hit(final: Path) -> TokenizedDataset:
    summary = DataSummary(**json.loads((final / SUMMARY_FILE).read_text()))
    summary.cache_hit = True
    log.info("tokenized data: cache hit at %s (%d samples)", final, summary.kept)
    return TokenizedDataset(datasets.load_from_disk(str(final / "dataset")), summary)


def min_supervised_tokens(config: RunConfig) -> int:
    """Supervised tokens a training sample needs: 2 x block_size (fewer cannot fill a block)."""
    return 2 * config.drafter.block_size


def load_training_data(
    config: RunConfig, tokenizer: PreTrainedTokenizerBase
) -> tuple[TokenizedDataset, TokenizedDataset]:
    """(train, eval) datasets of a run: eval from `data.eval_files`, else held out of the training files.

    Training samples need `min_supervised_tokens`; eval samples only need their prompt and one
    assistant turn.
    """
    data = config.data
    train = load_tokenized(
        data.train_files, data, tokenizer, min_supervised_tokens=min_supervised_tokens(config)
    )
    if data.eval_files:
        return train, load_tokenized(data.eval_files, data, tokenizer, min_supervised_tokens=1)
    return split_holdout(train, data.eval_holdout, config.train.seed)


def split_holdout(
    dataset: TokenizedDataset, count: int, seed: int
) -> tuple[TokenizedDataset, TokenizedDataset]:
    """Hold out `count` samples (a seeded choice) for eval; the rest trains."""
    if count >= len(dataset):
        raise UserError(
            f"data.eval_holdout = {count} leaves nothing to train on ({len(dataset)} samples kept); "
            f"lower it or set data.eval_files"
        )
    order = np.random.default_rng(seed % 2**64).permutation(len(dataset))
    held_out = np.sort(order[:count])
    train = np.sort(order[count:])
    return dataset.select(train.tolist()), dataset.select(held_out.tolist())


def cache_key(
    sources: Sequence[Source],
    tokenizer: PreTrainedTokenizerBase,
    data: DataConfig,
    min_supervised_tokens: int,
) -> str:
    """Hash of everything that shapes the tokenized result; any change is a cache miss."""
    files = []
    for source in sources:
        for member in source_members(source):
            stat = member.stat()
            files.append([str(member.resolve()), stat.st_size, stat.st_mtime_ns])
    identity = {
        "version": PIPELINE_VERSION,
        "files": files,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "format": data.format,
        "max_length": data.max_length,
        "chat_template_kwargs": data.chat_template_kwargs,
        "min_supervised_tokens": min_supervised_tokens,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:32]


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """Content hash of the tokenizer: vocabulary, merges, special tokens and chat template."""
    digest = hashlib.sha256()
    digest.update(tokenizer.backend_tokenizer.to_str().encode())
    digest.update(json.dumps(tokenizer.chat_template, sort_keys=True).encode())
    digest.update(json.dumps([tokenizer.pad_token, tokenizer.eos_token]).encode())
    return digest.hexdigest()


def _tokenize_sources(
    sources: list[Source],
    chat: ChatTokenizer,
    data: DataConfig,
    min_supervised_tokens: int,
    build: Path,
    key: str,
) -> tuple[datasets.Dataset, DataSummary]:
    """Tokenize every source into `build/work` (raw conversions included, so they go with it)."""
    summary = DataSummary(
        files=[source.label for source in sources], min_supervised_tokens=min_supervised_tokens
    )
    parts = []
    for number, source in enumerate(sources):
        raw, fmt, locate = _read_source(source, data.format, build / "work" / "raw")
        if len(raw) == 0:
            log.warning("data: %s holds no records", source.label)
            continue
        processes = data.num_proc or (min(os.cpu_count() or 1, 16) if len(raw) >= 4096 else 1)
        tokenized = raw.map(
            _tokenize_rows,
            batched=True,
            batch_size=256,
            with_indices=True,
            remove_columns=raw.column_names,
            features=TOKENIZED_FEATURES,
            fn_kwargs={"chat": chat, "fmt": fmt, "locate": locate, "min_supervised": min_supervised_tokens},
            num_proc=processes if processes > 1 else None,
            cache_file_name=str(build / "work" / f"source-{number}.arrow"),
            load_from_cache_file=False,
            new_fingerprint=f"dflash-{key}-{number}",
            desc=f"tokenizing {source.label}",
        )
        parts.append(_account(tokenized, summary))
    if summary.kept == 0:
        example = f"; e.g. {summary.malformed_examples[0]}" if summary.malformed_examples else ""
        raise UserError(
            f"no trainable conversations in {', '.join(summary.files)}: {summary.records} records read, "
            f"{summary.malformed} malformed, {summary.too_short} with fewer than {min_supervised_tokens} "
            f"supervised tokens{example}"
        )
    return datasets.concatenate_datasets(parts).remove_columns(BOOKKEEPING_COLUMNS), summary


def _read_source(
    source: Source, format_setting: str, raw_cache: Path
) -> tuple[datasets.Dataset, RecordFormat, RecordLocator]:
    """The raw records of a source, its record format and a locator for messages."""
    locator = RecordLocator([source.label], [0])
    try:
        if source.kind == "disk":
            raw = _single_split(datasets.load_from_disk(str(source.files[0])), source.label)
        elif source.kind == "json":
            require_utf8(source.files[0])
            if _is_json_lines(source.files[0]):
                locator = RecordLocator([source.label], [0], lines_of=source.files[0])
            # the json reader logs its parse error, which the fallback handles: its line would mislead
            reader_log = logging.getLogger("datasets.packaged_modules.json.json")
            level = reader_log.level
            reader_log.setLevel(logging.CRITICAL)
            try:
                raw = _load(source, raw_cache)
            # some lines are not JSON (keep the rest, count those), or the file is empty or blank
            except (DatasetGenerationError, StopIteration, ValueError):
                raw = _json_lines(source.files[0])
                if len(raw) and (error := _unreadable_json(source.files[0], raw)) is not None:
                    raise error from None
            finally:
                reader_log.setLevel(level)
        else:
            raw = _load(source, raw_cache)
            if source.kind == "parquet":
                counts = [pq.read_metadata(path).num_rows for path in source.files]
                locator = RecordLocator(
                    [str(path) for path in source.files], np.cumsum([0, *counts[:-1]]).tolist()
                )
    except UserError:
        raise
    except Exception as error:  # the readers raise many types for unreadable files; name the file instead
        raise UserError(f"{source.label}: cannot read it as {source.kind} data: {error}") from None
    if len(raw) == 0:
        return raw, "messages", locator  # nothing to detect; the caller skips it
    columns = _record_columns(raw)
    if format_setting == "auto":
        fmt = detect_format(columns, source.label)
    else:
        fmt = format_setting
        require_format_column(columns, fmt, source.label)
    return raw, fmt, locator


def _load(source: Source, raw_cache: Path) -> datasets.Dataset:
    return datasets.load_dataset(
        source.kind,
        data_files=[str(path) for path in source.files],
        split="train",
        cache_dir=str(raw_cache),
        features=_shard_features(source),
    )


def _shard_features(source: Source) -> datasets.Features | None:
    """The union of the columns of parquet shards whose columns differ, else None (the reader's own).

    A datagen directory resumed across a version that added a column (`domain`) holds shards with
    and without it; the reader casts every shard to the first one's columns and fails on the others.
    With the union, a shard's missing column reads as null.
    """
    if source.kind != "parquet" or len(source.files) < 2:
        return None
    schemas = [pq.read_schema(path) for path in source.files]
    if all(schema.equals(schemas[0]) for schema in schemas[1:]):
        return None
    try:
        return datasets.Features.from_arrow_schema(pa.unify_schemas(schemas))
    except (pa.ArrowException, TypeError, ValueError):
        return None  # columns of conflicting types: the reader's own error names the file


def _single_split(loaded: datasets.Dataset | datasets.DatasetDict, label: str) -> datasets.Dataset:
    if isinstance(loaded, datasets.Dataset):
        return loaded
    if "train" in loaded:
        return loaded["train"]
    if len(loaded) == 1:
        return next(iter(loaded.values()))
    raise UserError(f"{label}: a dataset dict with splits {sorted(loaded)}; expected one split or `train`")


def _json_lines(path: Path) -> datasets.Dataset:
    """Each non-blank line as raw text; `_tokenize_rows` parses them and counts the bad ones.

    Only for files `datasets` cannot parse, so holding the lines in memory is the rare case.
    """
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as handle:  # `require_utf8` has checked it
        lines = [line for line in handle if line.strip()]
    return datasets.Dataset.from_dict({JSON_LINE_COLUMN: lines})


def _unreadable_json(path: Path, lines: datasets.Dataset) -> UserError | None:
    """Why a json file the reader refused is not JSON lines to read one by one either, if it is not:
    a JSON array (its lines are no records), or a file with no line holding a JSON object, whose text
    stops being JSON at a line and column; or JSON values that are no objects."""
    with open_binary(path) as handle:
        text = handle.read().decode("utf-8")  # `require_utf8` has checked it
    try:
        json.loads(text)
        broken = None
    except json.JSONDecodeError as error:
        broken = error
    records = bool(_record_columns(lines))
    several_values = broken is not None and broken.msg == "Extra data"  # JSON lines, not one document
    if broken is not None and (text.lstrip().startswith("[") or not (records or several_values)):
        return UserError(
            f"{path}: not valid JSON: {broken.msg} (line {broken.lineno}, column {broken.colno})"
        )
    if not records:
        return UserError(f"{path}: no records: expected JSON objects, one per line or in a top-level array")
    return None


def _record_columns(raw: datasets.Dataset) -> list[str]:
    """Column names of a source; for raw json lines, the keys of its first parseable object."""
    if raw.column_names != [JSON_LINE_COLUMN]:
        return raw.column_names
    for line in raw[JSON_LINE_COLUMN]:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            return list(record)
    return []


def _tokenize_rows(
    batch: dict[str, list[Any]],
    indices: list[int],
    *,
    chat: ChatTokenizer,
    fmt: RecordFormat,
    locate: RecordLocator,
    min_supervised: int,
) -> dict[str, list[Any]]:
    """`datasets.map` body: raw records -> tokenized rows with a status and, if skipped, a reason."""
    records = [{column: values[row] for column, values in batch.items()} for row in range(len(indices))]
    outcomes: list[TokenizedSample | MalformedRecord | None] = []
    conversations: dict[int, Conversation] = {}
    domains: list[str] = []
    for record in records:
        domain = ""
        try:
            parsed = _parse(record)
            conversation = normalize_record(parsed, fmt)
            domain = record_domain(parsed)
            conversations[len(outcomes)] = conversation
            outcomes.append(None)
        except MalformedRecord as error:
            outcomes.append(error)
        domains.append(domain)
    for position, result in zip(conversations, chat.tokenize_many(list(conversations.values())), strict=True):
        outcomes[position] = result

    out: dict[str, list[Any]] = {name: [] for name in TOKENIZED_FEATURES}
    out["domain"] = domains
    for index, outcome in zip(indices, outcomes, strict=True):
        sample = outcome if isinstance(outcome, TokenizedSample) else TokenizedSample([], [])
        supervised = sample.supervised
        if isinstance(outcome, MalformedRecord):
            status, reason = "malformed", f"{locate(index)}: {outcome}"
        elif supervised < min_supervised:
            status, reason = "too_short", ""
        else:
            status, reason = "ok", ""
        out["input_ids"].append(sample.input_ids if status == "ok" else [])
        out["loss_mask"].append(sample.loss_mask if status == "ok" else [])
        out["length"].append(len(sample.input_ids))
        out["supervised"].append(supervised)
        out["truncated"].append(sample.truncated)
        out["status"].append(status)
        out["reason"].append(reason)
    return out


def _parse(record: dict[str, Any]) -> Any:
    if list(record) != [JSON_LINE_COLUMN]:
        return record
    try:
        return json.loads(record[JSON_LINE_COLUMN])
    except json.JSONDecodeError as error:
        raise MalformedRecord(f"not valid JSON ({error.msg} at column {error.colno})") from None


def _account(tokenized: datasets.Dataset, summary: DataSummary) -> datasets.Dataset:
    """Add a source's counts to the summary and return its kept rows."""
    columns = tokenized.with_format(
        "numpy", columns=["status", "length", "supervised", "truncated", "domain"]
    )[:]
    status = columns["status"].astype(str)
    kept = np.flatnonzero(status == "ok")
    malformed = np.flatnonzero(status == "malformed")
    summary.records += len(status)
    summary.malformed += len(malformed)
    summary.too_short += int((status == "too_short").sum())
    summary.kept += len(kept)
    summary.truncated += int(columns["truncated"][kept].sum())
    summary.tokens += int(columns["length"][kept].sum())
    summary.supervised_tokens += int(columns["supervised"][kept].sum())
    for domain, count in Counter(columns["domain"][kept].tolist()).items():
        if domain:
            summary.domains[domain] = summary.domains.get(domain, 0) + count
    room = MAX_EXAMPLES - len(summary.malformed_examples)
    if room > 0 and len(malformed):
        summary.malformed_examples += list(tokenized.select(malformed[:room].tolist())["reason"])
    return tokenized.select(kept.tolist())
