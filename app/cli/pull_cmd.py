"""`dflash pull s3://bucket/prefix [--to RUN_DIR]`: restore a run directory from its S3 copy to resume it.

Exit codes: 0 restored; 1 S3 unreachable or failing; 2 a bad URI or no complete checkpoint there.
Credentials come from the environment or the standard AWS config; the endpoint from --endpoint-url or
AWS_ENDPOINT_URL.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer


def pull(
    uri: Annotated[str, typer.Argument(help="The run's storage.s3_uri (s3://bucket/prefix).")],
    to: Annotated[
        Path | None,
        typer.Option("--to", help="Run directory to restore into (default: runs/<last part of the prefix>)."),
    ] = None,
    endpoint_url: Annotated[
        str | None,
        typer.Option("--endpoint-url", help="S3-compatible endpoint (MinIO, Ceph, ...); default AWS."),
    ] = None,
) -> None:
    """Download the newest complete, verified checkpoint and the run files (config, fingerprint, status, metrics)."""
    from app.storage import StorageError, parse_s3_uri, pull_run

    location = parse_s3_uri(uri)
    run_dir = to or Path("runs") / (location.prefix.rsplit("/", 1)[-1] or location.bucket)
    try:
        pulled = pull_run(uri, run_dir, endpoint_url=endpoint_url)
    except StorageError as error:
        print(f"dflash: error: {error}", file=sys.stderr)
        raise typer.Exit(1) from None
    print(
        f"restored {pulled.checkpoint} (step {pulled.step}) and {', '.join(pulled.run_files) or 'no run files'}"
    )
    if pulled.latest_kept_local:
        print(f"note: {run_dir} already holds a newer checkpoint; `latest` still points at it")
    print(f"resume with: dflash train YOUR_CONFIG train.output_dir={run_dir} --resume")
