"""Where a built-in target (`target.builtin`) lives on this machine: the one place that knows, for the
loader (app.model.target), the tokenizer (app.model.loading) and anything else that needs its directory.

Every built-in target is built or converted once per machine into a keyed directory under the cache
root and then loads like any `target.path`. Only the first use is slow; it reports on `progress`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from app.config.load import require_builtin_packages
from app.errors import UserError


def builtin_target_dir(name: str, progress: Callable[[str], None] | None = None) -> Path:
    """The directory (HF model + tokenizer) of the built-in target `name`, building it first if needed
    (default `progress`: standard error). A target whose dependency group is missing is refused
    before anything is imported or built, with the one line naming the group."""
    require_builtin_packages(name)
    if name == "tiny-lm":
        from app.model.tiny_lm import ensure_tiny_lm  # trains the built-in target on first use

        return ensure_tiny_lm(progress=progress)
    if name == "smollm2-135m-instruct":
        from app.model.smollm2 import ensure_smollm2  # converts the packaged GGUF on first use

        return ensure_smollm2(progress=progress)
    raise UserError(f"target.builtin: no built-in target {name!r}")
