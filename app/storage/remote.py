"""A run directory's copy on S3: the layout, how it is written so that nothing partial is trusted, and read.

Layout below the prefix (the run directory's own):

    config.json fingerprint.json environment.jsonl status.json          run files, refreshed every round
    metrics.jsonl wandb_id
    checkpoints/step_00000500/<files>                                   uploaded and verified first,
    checkpoints/step_00000500/manifest.json                             then the manifest,
    checkpoints/latest                                                  then the pointer
    exports/<name>/<files>, exports/<name>/manifest.json                the same rule

A reader trusts a checkpoint only once its manifest exists and every file it downloads matches it, so a
crash or an outage mid-upload leaves nothing a reader would use. Files already on the server with the
right checksum are not sent again, so a retried round only sends what is missing.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from app.atomic import file_sha256, write_bytes_atomic
from app.checkpoint.store import LATEST, MANIFEST, PREFIX
from app.paths import STORAGE_STATE_FILE
from app.storage.s3 import (
    MIB,
    S3Location,
    StorageError,
    digest_file,
    is_missing,
    list_keys,
    put_bytes,
    remote_mismatch,
    transfer_config,
    upload_verified,
)

RUN_FILES = (
    "config.json",
    "fingerprint.json",
    "environment.jsonl",
    "status.json",
    STORAGE_STATE_FILE,
    "metrics.jsonl",
    "wandb_id",
)
CHECKPOINTS = "checkpoints"
EXPORTS = "exports"


class RemoteRun:
    """Reads and writes one run's copy at `location` through `client` (a boto3 S3 client)."""

    def __init__(self, client: Any, location: S3Location, chunk_mb: int) -> None:
        self.client = client
        self.location = location
        self.chunk_mb = chunk_mb

    # ---- writing ------------------------------------------------------------------------------------

    def upload_checkpoint(self, checkpoint: Path) -> dict[str, Any]:
        """Files, manifest, `latest`, in that order; returns the manifest."""
        manifest_bytes = (checkpoint / MANIFEST).read_bytes()  # sent as written: byte-identical on pull
        manifest = json.loads(manifest_bytes)
        self.upload_directory(checkpoint, f"{CHECKPOINTS}/{checkpoint.name}", manifest, manifest_bytes)
        put_bytes(
            self.client,
            self.location.bucket,
            self.location.key(CHECKPOINTS, LATEST),
            checkpoint.name.encode(),
        )
        return manifest

    def upload_export(self, export_dir: Path) -> None:
        manifest = directory_manifest(export_dir)
        manifest_bytes = json.dumps(manifest, indent=2).encode()
        self.upload_directory(export_dir, f"{EXPORTS}/{export_dir.name}", manifest, manifest_bytes)

    def upload_directory(
        self, directory: Path, remote: str, manifest: dict[str, Any], manifest_bytes: bytes
    ) -> None:
        """Every file the manifest lists (checked locally, then on the server), then the manifest itself."""
        bucket, part_bytes = self.location.bucket, self.chunk_mb * MIB
        config = transfer_config(self.chunk_mb)
        for name, expected in sorted(manifest["files"].items()):
            path = directory / name
            digest = digest_file(path, part_bytes)
            if digest.sha256 != expected["sha256"] or digest.size != expected["bytes"]:
                raise StorageError(
                    f"{path}: does not match its manifest (corrupt on local disk); not uploaded"
                )
            key = self.location.key(remote, name)
            if remote_mismatch(self.client, bucket, key, path, digest) is not None:
                upload_verified(self.client, path, bucket, key, digest, config)
        put_bytes(self.client, bucket, self.location.key(remote, MANIFEST), manifest_bytes)

    def upload_run_files(self, run_dir: Path) -> None:
        for name in RUN_FILES:
            path = run_dir / name
            if path.is_file():
                # One read: metrics.jsonl grows meanwhile, and the checksum must match what is sent.
                put_bytes(self.client, self.location.bucket, self.location.key(name), path.read_bytes())

    def prune_checkpoints(self, newest: str, keep_last: int) -> None:
        """Keep the newest `keep_last` complete checkpoints; remove older ones and leftovers of failed rounds.

        A checkpoint's manifest goes before its files, so a reader never trusts one whose files are
        going away; multipart uploads left open by an outage are aborted.
        """
        client, bucket = self.client, self.location.bucket
        files = self._checkpoint_files()
        complete = sorted(name for name, names in files.items() if MANIFEST in names)
        leftovers = {name for name, names in files.items() if MANIFEST not in names and name < newest}
        for name in sorted(set(complete[:-keep_last]) | leftovers):
            if MANIFEST in files[name]:
                client.delete_object(Bucket=bucket, Key=self.location.key(CHECKPOINTS, name, MANIFEST))
            rest = [{"Key": self.location.key(CHECKPOINTS, name, f)} for f in files[name] if f != MANIFEST]
            for start in range(0, len(rest), 1000):
                client.delete_objects(
                    Bucket=bucket, Delete={"Objects": rest[start : start + 1000], "Quiet": True}
                )
        prefix = self.location.key(CHECKPOINTS) + "/"
        for upload in client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []):
            client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])

    # ---- reading ------------------------------------------------------------------------------------

    def complete_checkpoints(self) -> list[str]:
        """Names of the checkpoints a reader may trust (their manifest exists), the one `latest` names
        last, the others oldest first: try them from the end."""
        names = sorted(name for name, files in self._checkpoint_files().items() if MANIFEST in files)
        latest = self.latest()
        return [n for n in names if n != latest] + ([latest] if latest in names else [])

    def latest(self) -> str | None:
        from botocore.exceptions import ClientError

        try:
            body = self.client.get_object(
                Bucket=self.location.bucket, Key=self.location.key(CHECKPOINTS, LATEST)
            )
        except ClientError as error:
            if is_missing(error):
                return None
            raise
        return body["Body"].read().decode().strip() or None

    def download_checkpoint(self, name: str, into: Path) -> dict[str, Any]:
        """The manifest and every file it lists, into `into` (no verification: the caller verifies)."""
        bucket, remote = self.location.bucket, f"{CHECKPOINTS}/{name}"
        manifest_bytes = self.client.get_object(Bucket=bucket, Key=self.location.key(remote, MANIFEST))[
            "Body"
        ].read()
        manifest = json.loads(manifest_bytes)
        config = transfer_config(self.chunk_mb)
        for file in sorted(manifest["files"]):
            self.client.download_file(
                bucket, self.location.key(remote, file), str(into / file), Config=config
            )
        (into / MANIFEST).write_bytes(manifest_bytes)
        return manifest

    def download_run_files(self, run_dir: Path) -> list[str]:
        """The run files present on the remote, written atomically into `run_dir`; returns their names."""
        from botocore.exceptions import ClientError

        found = []
        for name in RUN_FILES:
            try:
                body = self.client.get_object(Bucket=self.location.bucket, Key=self.location.key(name))[
                    "Body"
                ]
            except ClientError as error:
                if is_missing(error):
                    continue
                raise
            write_bytes_atomic(run_dir / name, body.read())
            found.append(name)
        return found

    def _checkpoint_files(self) -> dict[str, list[str]]:
        files: dict[str, list[str]] = {}
        for key in list_keys(self.client, self.location, CHECKPOINTS):
            name, _, rest = key[len(CHECKPOINTS) + 1 :].partition("/")
            if name.startswith(PREFIX) and rest:
                files.setdefault(name, []).append(rest)
        return files


def directory_manifest(directory: Path) -> dict[str, Any]:
    """A checkpoint-style manifest (sha256 + bytes per file) for a directory that has none (an export)."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        name = path.relative_to(directory).as_posix()
        if name != MANIFEST:
            files[name] = {"sha256": file_sha256(path), "bytes": path.stat().st_size}
    created = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return {"files": files, "created_at": created}
