"""The libraries' progress bars (Hugging Face's "Loading weights", datasets' tokenizing, saving and
"Generating train split") redraw one terminal line: on a terminal they show progress, in a log written
to a file or a pipe every redraw is a line of noise. So they stay only where stderr, their stream, is a
terminal; the commands print their own progress lines either way.
"""

from __future__ import annotations

import os
import sys
from typing import TextIO


def library_bars_only_on_a_tty(stream: TextIO | None = None) -> None:
    """Turn the libraries' bars off, for this process and its children, unless `stream` (stderr) is
    a terminal."""
    stream = sys.stderr if stream is None else stream
    if not stream.isatty():
        disable_library_bars()


def disable_library_bars() -> None:
    # The variables reach a library not imported yet (without importing it: a command that never
    # loads transformers does not pay for it) and the processes this one starts; a library already
    # imported is told directly.
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # huggingface_hub's, which transformers' follow
    os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    if "datasets" in sys.modules:
        import datasets

        datasets.disable_progress_bars()
