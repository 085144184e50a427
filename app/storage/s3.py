"""S3 primitives: locations, clients, checksummed uploads verified against the server, listings.

Integrity: every object is uploaded with SHA-256 checksums (the server checks each part as it arrives
and stores the object's checksum); after the upload the stored checksum is read back and compared with
the local file's. A single-part object stores the file's SHA-256 (the same value the checkpoint
manifest records); a multipart object stores the SHA-256 of its parts' SHA-256s, which is recomputed
locally for the server's part size. Credentials come only from boto3's standard chain (environment,
~/.aws, instance roles) and never appear in messages.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.errors import UserError

MIB = 1 << 20
READ_BYTES = 8 * MIB


class StorageError(RuntimeError):
    """S3 could not be reached or did not hold what it should (the job failed, not the input)."""


@dataclass(frozen=True)
class S3Location:
    """A bucket and a key prefix (no leading or trailing slash; may be empty)."""

    bucket: str
    prefix: str

    def key(self, *parts: str) -> str:
        return "/".join(part.strip("/") for part in (self.prefix, *parts) if part.strip("/"))

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


def parse_s3_uri(uri: str) -> S3Location:
    """`s3://bucket/prefix` -> S3Location, or a one-line UserError naming what is wrong."""
    if not uri.startswith("s3://"):
        raise UserError(f"{uri!r}: expected an s3://bucket/prefix URI")
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    if not 3 <= len(bucket) <= 63 or not all(c.islower() or c.isdigit() or c in ".-" for c in bucket):
        raise UserError(f"{uri!r}: {bucket!r} is not a valid bucket name (3-63 of a-z, 0-9, '.', '-')")
    return S3Location(bucket, prefix.strip("/"))


def make_client(endpoint_url: str | None, max_retries: int) -> Any:
    """An S3 client with bounded retries and timeouts (a dead endpoint must fail, not hang a sync thread)."""
    import boto3
    from botocore.config import Config

    config = Config(
        retries={"total_max_attempts": max_retries + 1, "mode": "standard"},
        connect_timeout=10,
        read_timeout=120,
    )
    # A session per client: boto3's default session is not thread-safe, and sync runs on its own thread.
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config)


def transfer_config(chunk_mb: int) -> Any:
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(
        multipart_threshold=chunk_mb * MIB, multipart_chunksize=chunk_mb * MIB, max_concurrency=4
    )


@dataclass(frozen=True)
class FileDigest:
    """A local file's size, SHA-256, and the SHA-256 of each `part_bytes` part (for multipart checksums)."""

    size: int
    sha256: str
    part_bytes: int
    part_digests: tuple[bytes, ...]

    def stored_checksum(self, multipart: bool) -> str:
        """The base64 ChecksumSHA256 S3 stores for this file uploaded whole or in `part_bytes` parts."""
        if not multipart:
            return base64.b64encode(bytes.fromhex(self.sha256)).decode()
        return base64.b64encode(hashlib.sha256(b"".join(self.part_digests)).digest()).decode()


def digest_file(path: Path, part_bytes: int) -> FileDigest:
    """One pass over the file: its SHA-256 and its per-part SHA-256s."""
    whole = hashlib.sha256()
    parts: list[bytes] = []
    size = 0
    with open(path, "rb") as handle:
        while True:
            part, in_part = hashlib.sha256(), 0
            while in_part < part_bytes and (chunk := handle.read(min(READ_BYTES, part_bytes - in_part))):
                whole.update(chunk)
                part.update(chunk)
                in_part += len(chunk)
            if in_part == 0 and parts:  # the file ended on a part boundary
                break
            parts.append(part.digest())
            size += in_part
            if in_part < part_bytes:  # a short (last) part
                break
    return FileDigest(size, whole.hexdigest(), part_bytes, tuple(parts))


def remote_mismatch(client: Any, bucket: str, key: str, path: Path, digest: FileDigest) -> str | None:
    """None when the object at `key` holds exactly the local file (by the server's SHA-256), else why not."""
    from botocore.exceptions import ClientError

    try:
        head = client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    except ClientError as error:
        if is_missing(error):
            return "not uploaded"
        raise
    if head["ContentLength"] != digest.size:
        return f"holds {head['ContentLength']} bytes, expected {digest.size}"
    stored = head.get("ChecksumSHA256")
    if not stored:
        return "the server recorded no SHA-256 checksum for it"
    stored_value, dash, _ = stored.partition("-")
    multipart = bool(dash) or "-" in head.get("ETag", "")
    if multipart:
        part_bytes = client.head_object(Bucket=bucket, Key=key, PartNumber=1)["ContentLength"]
        if part_bytes != digest.part_bytes:  # uploaded earlier with another part size
            digest = digest_file(path, part_bytes)
    expected = digest.stored_checksum(multipart)
    if stored_value != expected:
        return f"SHA-256 mismatch (server {stored_value}, local {expected})"
    return None


def is_missing(error: Exception) -> bool:
    """Whether a botocore ClientError means "no such key" (HEAD answers a bare 404)."""
    response = getattr(error, "response", None) or {}
    return response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound")


def upload_verified(client: Any, path: Path, bucket: str, key: str, digest: FileDigest, config: Any) -> None:
    """Upload with SHA-256 checksums, then check the server's stored checksum against the local file."""
    client.upload_file(str(path), bucket, key, ExtraArgs={"ChecksumAlgorithm": "SHA256"}, Config=config)
    problem = remote_mismatch(client, bucket, key, path, digest)
    if problem is not None:
        raise StorageError(f"s3://{bucket}/{key}: uploaded but {problem}")


def put_bytes(client: Any, bucket: str, key: str, data: bytes) -> None:
    """A small object in one request; the server rejects it unless it hashes to the SHA-256 sent along."""
    checksum = base64.b64encode(hashlib.sha256(data).digest()).decode()
    client.put_object(Bucket=bucket, Key=key, Body=data, ChecksumSHA256=checksum)


def list_keys(client: Any, location: S3Location, under: str) -> list[str]:
    """Every key below `location/under/`, relative to `location`'s prefix."""
    prefix = location.key(under) + "/" if location.key(under) else ""
    start = len(location.key()) + 1 if location.prefix else 0
    keys = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=location.bucket, Prefix=prefix):
        keys += [item["Key"][start:] for item in page.get("Contents", [])]
    return keys


def describe_error(error: BaseException) -> str:
    """One line for a boto/S3 failure (error code and message only: no request details, no credentials)."""
    from botocore.exceptions import ClientError, NoCredentialsError

    if isinstance(error, NoCredentialsError):
        return "no AWS credentials (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or configure ~/.aws)"
    if isinstance(error, ClientError):
        details = error.response.get("Error", {})
        return f"{details.get('Code', 'error')}: {details.get('Message', '')}".strip()
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
