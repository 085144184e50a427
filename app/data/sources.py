"""Which files a `data.*_files` entry names, grouped into what is read as one `datasets.Dataset`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from app.errors import UserError

SourceKind = Literal["json", "parquet", "arrow", "disk"]
SHARD_KINDS: tuple[tuple[str, SourceKind], ...] = (
    (".parquet", "parquet"),
    (".arrow", "arrow"),
    (".jsonl", "json"),
    (".jsonl.gz", "json"),
    (".json", "json"),
    (".json.gz", "json"),
)


@dataclass
class Source:
    """Files read as one `datasets.Dataset`."""

    kind: SourceKind
    files: list[Path]
    label: str
    """How messages name it: the file or directory the user listed."""


def source_members(source: Source) -> list[Path]:
    """Every file a source reads (a saved dataset's directory: each file in it), in a stable order."""
    members = []
    for path in source.files:
        members += sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return members


def resolve_sources(files: Sequence[str]) -> list[Source]:
    """What to read for each configured path; a path that cannot be data is a `UserError`."""
    sources = []
    for entry in files:
        path = Path(entry).expanduser()
        if not path.exists():
            raise UserError(f"data file not found: {entry}")
        if path.is_file():
            kind = _shard_kind(path)
            if kind is None:
                raise UserError(
                    f"{entry}: unsupported data file (expected .jsonl, .json, .parquet, .arrow "
                    f"or a directory)"
                )
            sources.append(Source(kind, [path], str(path)))
        elif any((path / marker).is_file() for marker in ("state.json", "dataset_dict.json")):
            sources.append(Source("disk", [path], str(path)))
        else:
            sources += _shard_sources(path)
    return sources


def require_records(files: Sequence[str]) -> None:
    """Before anything loads (`dflash train` checks it before torch): the training files exist and not
    every one of them is blank (a blank file among others is counted and skipped when the data loads).
    A file that holds no record for another reason is found only when it is read."""
    from app.data.textfiles import is_blank

    members = [member for source in resolve_sources(files) for member in source_members(source)]
    text = [member for member in members if _shard_kind(member) == "json"]
    if members and len(text) == len(members) and all(is_blank(member) for member in text):
        raise UserError(
            f"data.train_files: {', '.join(map(str, text))}: blank (only whitespace), so there is nothing to "
            "train on; point data.train_files at the regenerated data"
        )


def _shard_kind(path: Path) -> SourceKind | None:
    return next((kind for suffix, kind in SHARD_KINDS if path.name.endswith(suffix)), None)


def _shard_sources(directory: Path) -> list[Source]:
    """A directory of shards: files of one kind only (parquet first), so a side file such as a
    datagen rejects log next to parquet shards is never read as training data."""
    shards = sorted(
        path
        for path in directory.rglob("*")
        if path.is_file() and not any(part.startswith(".") for part in path.relative_to(directory).parts)
    )
    for wanted in ("parquet", "arrow", "json"):
        chosen = [path for path in shards if _shard_kind(path) == wanted]
        if not chosen:
            continue
        if wanted == "parquet":  # one dataset: datagen writes many small shards of one schema
            return [Source("parquet", chosen, str(directory))]
        return [Source(wanted, [path], str(path)) for path in chosen]
    raise UserError(f"{directory}: no .parquet, .arrow, .jsonl or .json files inside")
