"""The libraries' progress bars stay on a terminal and out of a log written to a file."""

from __future__ import annotations

import os
import pty
import subprocess
import sys

import pytest

from tests.helpers import ROOT

REPORT = """
import sys
{before}
from app.cli.bars import library_bars_only_on_a_tty
library_bars_only_on_a_tty()
import datasets
from transformers.utils import logging
print(logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled())
"""


def bars_on(stderr: int, before: str) -> str:
    """Whether transformers' and datasets' bars are on, in a fresh interpreter whose stderr is `stderr`."""
    script = REPORT.format(before=before)
    # not the variables an in-process `dflash` command of an earlier test may have set here
    env = {key: value for key, value in os.environ.items() if "DISABLE_PROGRESS_BARS" not in key}
    command = [sys.executable, "-c", script]
    done = subprocess.run(
        command, stderr=stderr, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env, timeout=120
    )
    return done.stdout.strip()


@pytest.mark.parametrize("before", ["", "import datasets, transformers"], ids=["not-imported", "imported"])
def test_the_library_bars_are_off_when_stderr_is_a_file_and_on_when_it_is_a_terminal(
    tmp_path, before
) -> None:
    with open(tmp_path / "log", "w") as log:
        assert bars_on(log.fileno(), before) == "False False"
    terminal, other_end = pty.openpty()
    try:
        assert bars_on(other_end, before) == "True True"
    finally:
        os.close(terminal)
        os.close(other_end)
