"""Where compiled kernels live, set up before torch compiles anything.

The incident's 353 MB of kernels sat in `/tmp/torchinductor_root` and died with one `rm -rf`; torch's
default is `/tmp/torchinductor_<user>`, and `getpass.getuser()` (which picks `<user>`) raises in a
container running under a uid with no passwd entry. So: the inductor and Triton caches go to a
persistent, writable directory (`compile.inductor_dir`, default `~/.cache/dflash/inductor`), never
under /tmp, and USER/HOME are filled in when the container left them unset.
"""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass
from pathlib import Path

from app.config.schema import CompileConfig
from app.env.fingerprint import is_under_tmp
from app.errors import UserError
from app.paths import cache_root, create_writable


@dataclass(frozen=True)
class CompileDirs:
    """The directories this process compiles into (exported as TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR)."""

    inductor: Path
    triton: Path


def ensure_user_and_home() -> None:
    """Set USER (and HOME) from the uid when a container left them unset, so getpass and `~` work."""
    if not any(os.environ.get(name) for name in ("LOGNAME", "USER", "LNAME", "USERNAME")):
        try:
            os.environ["USER"] = pwd.getpwuid(os.getuid()).pw_name
        except KeyError:  # an arbitrary `--user 12345` has no passwd entry
            os.environ["USER"] = f"uid{os.getuid()}"
    if not os.environ.get("HOME"):
        try:
            os.environ["HOME"] = pwd.getpwuid(os.getuid()).pw_dir
        except KeyError:
            raise UserError(
                f"HOME is unset and uid {os.getuid()} has no passwd entry: set HOME or compile.inductor_dir "
                "to a writable persistent directory"
            ) from None


def resolve_inductor_dir(compile_config: CompileConfig) -> Path:
    """`compile.inductor_dir`, else $TORCHINDUCTOR_CACHE_DIR, else the dflash cache root's `inductor/`; never /tmp."""
    if compile_config.inductor_dir is not None:
        chosen, source = compile_config.inductor_dir, "compile.inductor_dir"
    elif os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        chosen, source = os.environ["TORCHINDUCTOR_CACHE_DIR"], "TORCHINDUCTOR_CACHE_DIR"
    else:
        chosen, source = str(cache_root() / "inductor"), "compile.inductor_dir (default)"
    directory = Path(chosen).expanduser().absolute()
    if is_under_tmp(str(directory)):
        raise UserError(
            f"{source}: {directory} is under /tmp, where cleanups delete compiled kernels; "
            "choose a persistent directory (e.g. ~/.cache/dflash/inductor)"
        )
    return directory


def key_inductor_dir(compile_config: CompileConfig, key: str) -> Path:
    """The inductor dir of one compile-cache key, `<compile.inductor_dir>/<key>`: the same path when
    `dflash build-cache` compiles and when training starts.

    It has to be the same path. Inductor pickles each statically launched Triton kernel with the
    absolute path of its source file, and on a cache hit looks for the kernel's tuned launch config
    beside that path. A cache compiled elsewhere (say a staging dir, gone since) makes every start
    re-benchmark its kernels (seconds) and write their configs under the build's path, which raises
    where that path is not writable (a baked image run as another user).
    """
    return resolve_inductor_dir(compile_config) / key


def use_compile_dirs(inductor_dir: Path, triton_dir: Path | None = None) -> CompileDirs:
    """Create the directories, check they are writable and export them for torch and Triton (and pin
    Triton's ptxas, `pin_triton_ptxas`).

    Triton defaults to `<inductor_dir>/triton` unless TRITON_CACHE_DIR names a persistent directory.
    Call before anything is compiled: both are read when a kernel is first compiled or loaded.
    """
    if triton_dir is None:
        from_env = os.environ.get("TRITON_CACHE_DIR")
        triton_dir = Path(from_env) if from_env and not is_under_tmp(from_env) else inductor_dir / "triton"
    for directory, what in ((inductor_dir, "inductor"), (triton_dir, "Triton")):
        try:
            create_writable(directory)
        except OSError as error:
            raise UserError(
                f"compile.inductor_dir: the {what} cache directory {directory} is not writable by uid "
                f"{os.getuid()} ({error.strerror})"
            ) from None
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_dir)
    os.environ["TRITON_CACHE_DIR"] = str(triton_dir)
    pin_triton_ptxas()
    return CompileDirs(inductor=inductor_dir, triton=triton_dir)


def pin_triton_ptxas() -> None:
    """Point Triton at the ptxas inductor compiles with (torch's own: its CUDA wheels ship one), for
    every kernel of this process, before anything compiles.

    Inductor exports TRITON_PTXAS_PATH when it first compiles a kernel itself, and a warm start, which
    loads every inductor kernel from the cache, never does. Triton's cache key holds the ptxas
    version, so a kernel compiled before that moment (or where it never comes) is keyed unlike the
    same kernel compiled after it. The GPU tier's build-cache ran in a process that had compiled
    before: it baked the loss's kernel under torch's ptxas, and a fresh start looked it up under
    Triton's own and compiled it again. Pinned here, in build-cache and at every start, each kernel
    has one key whatever compiled first. The function is inductor's, so the choice stays torch's.

    Triton also memoizes the ptxas version per process, from whichever ptxas it asked first: a
    process that compiled a Triton kernel before the pin (the GPU tier's tests before its
    build-cache) kept the old version in every later key, so the baked loss kernel missed at a fresh
    start. The pin forgets that memo, and the next key asks the pinned ptxas."""
    from torch._inductor.runtime.compile_tasks import _set_triton_ptxas_path

    _set_triton_ptxas_path()
    try:
        from triton.backends.nvidia.compiler import get_ptxas_version
    except ImportError:  # no Triton here (the lock has it on Linux x86-64 only): no key to keep in step
        return
    get_ptxas_version.cache_clear()
