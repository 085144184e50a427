"""The caches in `compile_cache/` measured against this machine (and config): which one fits, and why
the others do not. Used by the trainer (to name the nearest cache when none matches) and the doctor."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from app.compile.artifacts import CacheEntry, list_entries
from app.compile.key import KeyFields, diff_fields
from app.config.schema import RunConfig


@dataclass(frozen=True)
class CacheStatus:
    """One entry and the key fields where it differs from this machine/run (empty: it matches)."""

    entry: CacheEntry
    differences: list[str]

    @property
    def matches(self) -> bool:
        return not self.differences


def survey_caches(
    cache_dir: Path, fields: KeyFields, groups: tuple[str, ...] | None = None
) -> tuple[list[CacheStatus], list[str]]:
    """Every entry compared with `fields` on the `groups` prefixes (None: all); plus unusable entries."""
    entries, broken = list_entries(cache_dir)
    statuses = [CacheStatus(entry, diff_fields(fields, entry.fields, groups)) for entry in entries]
    return sorted(statuses, key=lambda status: len(status.differences)), broken


def nearest_mismatch(cache_dir: Path, fields: KeyFields) -> CacheStatus | None:
    """The entry that differs from `fields` in the fewest key fields, if there is any entry."""
    statuses, _ = survey_caches(cache_dir, fields)
    return statuses[0] if statuses else None


def survey_this_machine(
    cache_dir: Path, config: RunConfig | None
) -> tuple[str | None, list[CacheStatus], list[str]]:
    """What the doctor shows: this run's key (with a config), each cache's differences, unusable ones.

    Without a config only the machine, inductor and code fields are compared (shapes need the config).
    """
    import torch

    from app.compile.key import MACHINE_GROUPS, cache_key, key_fields, machine_key_fields
    from app.model.drafter import DrafterArch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if config is None:
        statuses, broken = survey_caches(cache_dir, machine_key_fields(device), MACHINE_GROUPS)
        return None, statuses, broken
    fields = key_fields(config, DrafterArch.from_config(config), device)
    statuses, broken = survey_caches(cache_dir, fields)
    return cache_key(fields), statuses, broken
