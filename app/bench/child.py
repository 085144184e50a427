"""Benchmarks that measure fresh processes run each phase as a child process. A child prints its
result as one `BENCH-RESULT {json}` line; the parent echoes every other line live, indented, and
keeps a copy in a log file when asked."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

RESULT_PREFIX = "BENCH-RESULT "


def run_child(
    command: list[str], env: dict[str, str] | None = None, log: Path | None = None
) -> dict[str, Any]:
    """Run `command`, echoing its output; its last result line, or {"failed": "exit N"}."""
    results: list[str] = []
    with (
        subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        ) as child,
        open(log or os.devnull, "w") as copy,
    ):
        assert child.stdout is not None
        for line in child.stdout:
            copy.write(line)
            if line.startswith(RESULT_PREFIX):
                results.append(line[len(RESULT_PREFIX) :])
            else:
                print(f"  | {line.rstrip()}", flush=True)
    if child.returncode != 0:
        return {"failed": f"exit {child.returncode}" + (f" (log: {log})" if log else "")}
    return json.loads(results[-1]) if results else {}


def emit(result: dict[str, Any]) -> None:
    """A child's result, for `run_child` in the parent."""
    print(RESULT_PREFIX + json.dumps(result, default=str), flush=True)
