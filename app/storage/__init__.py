"""Optional S3 mirror of run directories: background checkpoint sync, exports, and `dflash pull`."""

from app.storage.pull import PulledRun, pull_run
from app.storage.remote import RemoteRun
from app.storage.s3 import S3Location, StorageError, parse_s3_uri
from app.storage.sync import S3Sync, upload_export

__all__ = [
    "PulledRun",
    "RemoteRun",
    "S3Location",
    "S3Sync",
    "StorageError",
    "parse_s3_uri",
    "pull_run",
    "upload_export",
]
