"""Properties of the small hand-written parsers and serialisers over generated inputs (hypothesis): a
command line a shell reads back to its words, an S3 URI that parses back to its location, a comma list
of integers."""

from __future__ import annotations

import os
import shlex
import string
import subprocess
from unittest import mock

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from app.cli.arguments import int_list, shell_command
from app.errors import UserError
from app.pipeline.roles import torchrun_variables
from app.storage.s3 import S3Location, parse_s3_uri

any_character = st.characters(exclude_characters="\x00", exclude_categories=("Cs",))
shell_special = st.sampled_from(list("'\"$`\\!*?~#;&|<>(){}[]= \t\nab"))  # mostly what a shell reads
words = st.lists(st.text(st.one_of(shell_special, any_character)), min_size=1, max_size=6)


@settings(max_examples=300, deadline=None)
@given(words=words)
@example(words=["it's $HOME", "a'`b`", "x'\\n", "'!'", "a'\\", "data.train_files=['a.jsonl']"])
def test_a_shell_reads_the_printed_command_back_to_its_words(words: list[str]) -> None:
    """The oracle is a real POSIX shell (it expands `$`, backquotes and backslashes where shlex would not)."""
    line = shell_command(words)
    printed = subprocess.run(["sh", "-c", f"printf '%s\\0' {line}"], capture_output=True, check=True).stdout
    assert printed.decode().split("\0")[:-1] == words
    assert shlex.split(line) == words


buckets = st.text(string.ascii_lowercase + string.digits + ".-", min_size=3, max_size=63)
segments = st.lists(
    st.text(st.characters(exclude_characters="/\x00", exclude_categories=("Cs",)), min_size=1, max_size=8),
    max_size=3,
)


@settings(max_examples=200, deadline=None)
@given(bucket=buckets, parts=segments)
def test_an_s3_uri_parses_back_to_its_location_and_keys_have_no_empty_segment(
    bucket: str, parts: list[str]
) -> None:
    location = parse_s3_uri(f"s3://{bucket}/{'/'.join(parts)}/")
    assert location == S3Location(bucket, "/".join(parts))
    assert parse_s3_uri(str(location)) == location
    assert "//" not in location.key("a/", "/b") and location.key("a", "b").endswith("a/b")


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.integers(min_value=1, max_value=10**6), min_size=1, max_size=8), spaces=st.booleans()
)
def test_a_comma_list_of_integers_reads_back(values: list[int], spaces: bool) -> None:
    assert int_list((", " if spaces else ",").join(map(str, values)), "--tree-budget", 1) == values


@pytest.mark.parametrize("text", ["", ",", "16,x", "0,16", "1.5"])
def test_a_bad_comma_list_is_one_line_naming_the_option(text: str) -> None:
    with pytest.raises(UserError, match=r"^--tree-budget: expected integers >= 1 separated by commas"):
        int_list(text, "--tree-budget", 1)


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(st.one_of(st.sampled_from(list("0123456789 -+_\n")), any_character), min_size=1, max_size=8)
)
def test_a_rank_variable_is_an_integer_or_one_line_naming_it(text: str) -> None:
    with mock.patch.dict(os.environ, {"RANK": text}):
        try:
            expected = int(text)
        except ValueError:
            expected = -1
        if expected >= 0:
            assert torchrun_variables()["RANK"] == expected
            return
        with pytest.raises(UserError) as error:
            torchrun_variables()
    assert str(error.value).startswith("RANK=") and "\n" not in str(error.value)
