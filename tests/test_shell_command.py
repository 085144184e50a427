"""A command the CLI prints for the user to run again (datagen's resume hint) reads plainly and is exact."""

from __future__ import annotations

import shlex

import pytest

from app.cli.arguments import shell_command


def test_an_override_with_single_quotes_is_double_quoted_not_spliced() -> None:
    words = ["dflash", "datagen", "configs/my run.toml", "data.train_files=['/data/a.jsonl']"]
    assert (
        shell_command(words)
        == """dflash datagen 'configs/my run.toml' "data.train_files=['/data/a.jsonl']\""""
    )


@pytest.mark.parametrize(
    "word",
    ["plain", "two words", "it's", "['a', 'b']", """['a"b']""", "['$HOME']", "['a\\\\b']", "['hi!']", ""],
)
def test_the_shell_reads_every_word_back_as_it_was(word: str) -> None:
    assert shlex.split(shell_command(["dflash", word])) == ["dflash", word]
