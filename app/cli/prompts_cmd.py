"""`dflash prompts build OUT_DIR`: an offline prompt corpus with a domain on every record, split by source."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from app.cli.arguments import require_importable_stack

group = typer.Typer(help="Prompt corpora for datagen, built from what is installed.", no_args_is_help=True)


@group.command("build")
def build(
    out_dir: Annotated[
        str,
        typer.Argument(
            help="Directory for train.jsonl, heldout.jsonl and manifest.json (files there are replaced)."
        ),
    ],
    seed: Annotated[int, typer.Option("--seed", help="Draws the prompts and the held-out sources.")] = 0,
    count: Annotated[
        int | None,
        typer.Option("--count", help="Prompts in all, both splits (default 50000, at least 1000)."),
    ] = None,
) -> None:
    """Build code, prose and math prompts offline, split by source into train and held-out files.

    Held-out packages, topic groups, templates and problem families never appear in train.jsonl. Same
    seed, same installed packages: byte-identical files. Regenerate train.jsonl's answers with
    `dflash datagen`; measure acceptance per domain on heldout.jsonl.
    """
    from pathlib import Path

    require_importable_stack()
    from app.datagen.corpus import DEFAULT_COUNT, write_corpus  # imported here: `dflash --help` stays fast

    started = time.monotonic()
    manifest = write_corpus(out_dir, seed=seed, count=DEFAULT_COUNT if count is None else count)
    elapsed = time.monotonic() - started
    counts = manifest["counts"]
    totals = {split: sum(domains.values()) for split, domains in counts.items()}
    print(
        f"prompts: {totals['train']} train + {totals['heldout']} held-out prompts in {Path(out_dir)} "
        f"({elapsed:.1f} s, seed {seed})"
    )
    for split, domains in counts.items():
        print(f"prompts: {split:<8} " + ", ".join(f"{domain} {number}" for domain, number in domains.items()))
    print(
        f"prompts: {len(manifest['heldout_sources'])} source groups held out (listed in manifest.json); "
        f"{len(manifest['packages'])} packages scanned"
    )
