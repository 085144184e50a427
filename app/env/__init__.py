"""The environment a run executes in: fingerprint, health findings, and the diff against a recorded run.

Imports neither torch nor typer at import time, so callers pay for torch only when they fingerprint.
"""

from app.env.diff import Difference, diff_fingerprints
from app.env.fingerprint import FINGERPRINT_FILENAME, collect_fingerprint, load_fingerprint, save_fingerprint
from app.env.health import Finding, assess, has_problems
from app.env.record import ENVIRONMENT_RECORD, latest_fingerprint, read_starts, recorded_fingerprint

__all__ = [
    "ENVIRONMENT_RECORD",
    "FINGERPRINT_FILENAME",
    "Difference",
    "Finding",
    "assess",
    "collect_fingerprint",
    "diff_fingerprints",
    "has_problems",
    "latest_fingerprint",
    "load_fingerprint",
    "read_starts",
    "recorded_fingerprint",
    "save_fingerprint",
]
