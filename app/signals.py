"""The one way a process of the appliance takes stop signals: a handler for the length of a block.

Training, a target rank, datagen (both engines) and bench quality each stop in their own way (a
checkpoint, feeding the drafters until they agree, a commit, a relay to the children); what they share
is here: the handler is installed on entry and the previous one restored on exit, also on an error.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

TERMINATE = (signal.SIGTERM, signal.SIGINT)
"""`kill` (and `docker stop`), ^C."""


@contextlib.contextmanager
def stop_signals(
    handler: Callable[[signal.Signals], None],
    signals: tuple[signal.Signals, ...] = TERMINATE,
    *,
    keep_ignored: bool = False,
) -> Iterator[list[signal.Signals]]:
    """`handler(signal)` runs on each of `signals` inside the block (between two Python bytecodes of
    the main thread: it should only note the stop). `keep_ignored`: a signal that whoever started the
    process ignores (SIGHUP under `nohup`) stays ignored. Off the main thread nothing is installed (the
    caller's thread handles signals). Yields the signals handled."""
    if threading.current_thread() is not threading.main_thread():
        yield []
        return
    handled = [sig for sig in signals if not (keep_ignored and signal.getsignal(sig) == signal.SIG_IGN)]
    previous = {
        sig: signal.signal(sig, lambda signum, frame: handler(signal.Signals(signum))) for sig in handled
    }
    try:
        yield handled
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)
