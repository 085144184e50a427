"""Checks and readers of text data files (jsonl, json; gzipped or not) that the dataset loader shares."""

from __future__ import annotations

import codecs
import gzip
from pathlib import Path
from typing import Any

from app.errors import UserError

UTF8_CHUNK = 1 << 24
"""Bytes read at a time when checking that a text data file is UTF-8."""


def require_utf8(path: Path) -> None:
    """Refuse a text data file holding bytes that are not UTF-8, naming the first such line: the json
    reader passes them through to fail deep inside tokenization, the line fallback would garble them."""
    if is_utf8(path):
        return
    with open_binary(path) as handle:  # line by line is slower: only for a file known to be bad
        for number, line in enumerate(handle, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as error:
                raise UserError(
                    f"{path}: line {number} is not UTF-8: byte {error.start + 1} of the line is "
                    f"{line[error.start : error.end]!r} ({error.reason}); save the file as UTF-8"
                ) from None


def is_utf8(path: Path) -> bool:
    """Whether the whole file (gunzipped for .gz) decodes as UTF-8, read in chunks."""
    decoder = codecs.getincrementaldecoder("utf-8")()  # holds a character split between chunks
    with open_binary(path) as handle:
        try:
            while chunk := handle.read(UTF8_CHUNK):
                decoder.decode(chunk)
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            return False
    return True


def is_blank(path: Path) -> bool:
    """Whether a text data file holds nothing but whitespace (read until its first other byte)."""
    with open_binary(path) as handle:
        while chunk := handle.read(1 << 16):
            if chunk.strip():
                return False
    return True


def open_binary(path: Path) -> Any:
    """The file's bytes, gunzipped for a .gz name."""
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")
