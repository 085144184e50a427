"""Checks of a run directory that need no torch, so `dflash train` makes them before torch loads: it
exists for a resume, and it can be created and written."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from app.atomic import write_bytes_atomic
from app.errors import UserError

WRITE_PROBE = ".dflash-write-probe"
RUN_MARKERS = (
    "config.json",
    "status.json",
    "environment.jsonl",
    "fingerprint.json",
    "metrics.jsonl",
    "checkpoints",
)
"""Entries only a run writes: a directory holding one is a run's (an earlier attempt's, maybe)."""
LOG_SUFFIXES = (".log", ".out", ".err")
"""Files a shell redirection makes in the run directory before the run starts (`> RUN/train.log`)."""
NAMES_SHOWN = 5


def require_run_to_resume(run_dir: str | Path) -> None:
    """`--resume` names a run directory that exists: a mistyped path would otherwise start a new run
    from step 0 there and exit 0, looking like a resume."""
    if not Path(run_dir).exists():
        raise UserError(
            f"train.output_dir = {run_dir}: does not exist, so there is no run to resume there; check the "
            "path, or drop --resume to start a new run"
        )


def require_own_directory(run_dir: str | Path) -> None:
    """A new run starts in a new or empty directory, or a run's (an abandoned attempt): one holding
    other things (a home directory, a dataset) would get the run's files mixed into them."""
    try:
        entries = [entry for entry in Path(run_dir).iterdir() if not entry.name.startswith(".")]
    except OSError:
        return  # none yet (the start creates it), or one `require_writable` refuses saying why
    foreign = sorted(
        e.name for e in entries if e.name not in RUN_MARKERS and not e.name.endswith(LOG_SUFFIXES)
    )
    if not foreign or any(entry.name in RUN_MARKERS for entry in entries):
        return
    shown = ", ".join(foreign[:NAMES_SHOWN]) + (
        f" and {len(foreign) - NAMES_SHOWN} more" if len(foreign) > NAMES_SHOWN else ""
    )
    raise UserError(
        f"train.output_dir = {run_dir}: holds {shown}, which are not a run's; a new run would mix its files "
        "with them: choose a new or empty directory"
    )


@contextlib.contextmanager
def removed_if_left_empty(run_dir: str | Path) -> Iterator[None]:
    """The directories of `run_dir` that do not exist yet are removed again, deepest first, if the
    block fails and leaves them empty: a refused fresh start (a drifted environment, bad data) leaves
    no empty run directory that reads as a run."""
    run_dir = Path(run_dir).absolute()
    missing = [path for path in (run_dir, *run_dir.parents) if not path.exists()]
    try:
        yield
    except BaseException:
        for path in missing:  # deepest first; one that holds anything stops the walk
            try:
                os.rmdir(path)
            except OSError:
                break
        raise


def require_writable(run_dir: str | Path, *, keep: bool, setting: str = "train.output_dir") -> None:
    """Create `run_dir` if needed and write a probe file there the way checkpoint files are written
    (temp file, fsync, rename), then remove it; the OS's refusal becomes a UserError naming the setting
    and why (a file in the way, a symlink that does not resolve, a read-only file system). `keep=False`
    (`dflash train` before torch loads) removes again the directories it created: a start refused
    later leaves nothing behind."""
    run_dir = Path(run_dir)
    created = [
        path for path in (run_dir.absolute(), *run_dir.absolute().parents) if not os.path.lexists(path)
    ]
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / WRITE_PROBE
        write_bytes_atomic(probe, b"")
        probe.unlink()
    except OSError as error:
        raise UserError(f"{setting} = {run_dir}: {_why_unwritable(run_dir, error)}") from None
    finally:
        if not keep:
            for path in created:  # deepest first
                with contextlib.suppress(OSError):
                    os.rmdir(path)


def _why_unwritable(run_dir: Path, error: OSError) -> str:
    file = next((path for path in (run_dir, *run_dir.parents) if path.is_file()), None)
    # a link to nowhere: a loop, or a target that is gone (mkdir says "File exists" of it)
    broken = next((p for p in (run_dir, *run_dir.parents) if p.is_symlink() and not p.exists()), None)
    if file is not None:  # mkdir's own words ("File exists", "Not a directory") do not say which
        return f"{'it' if file == run_dir else file} is a file, not a directory"
    if broken is not None:
        where = "it" if broken == run_dir else str(broken)
        return f"{where} is a symlink to {os.readlink(broken)}, which does not resolve (a loop, or gone)"
    return f"cannot create or write files there ({error.strerror or error})"
