"""Shared test helpers: the `dflash` CLI in a fresh interpreter, the reference layout's weight names,
and for the tests that run the real trainer on the tiny target, the small-shape overrides (seconds per
step on CPU) and a reporter that preempts the run at a given step."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from app.config import RunConfig, load_config, validate_config
from app.config.builtins import BUILTIN_TARGETS

ROOT = Path(__file__).resolve().parents[1]

# Per-layer weight names of the reference DFlash layout (what SGLang and vLLM load).
REFERENCE_LAYER_WEIGHTS = [
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
]

# A small Qwen3-shaped target (random weights) and a 2-layer drafter over it: the model and export tests.
SMALL_VOCAB, SMALL_HIDDEN, SMALL_TARGET_LAYERS, SMALL_BLOCK, SMALL_MASK = 300, 64, 8, 4, 7


def small_drafter_raw_config(**drafter) -> dict:
    """The raw (unvalidated) config of that target and drafter; `drafter` overrides drafter fields."""
    return {
        "target": {
            "architecture": {
                "model_type": "qwen3",
                "vocab_size": SMALL_VOCAB,
                "hidden_size": SMALL_HIDDEN,
                "intermediate_size": 96,
                "num_hidden_layers": SMALL_TARGET_LAYERS,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "rope_theta": 5000.0,
                "max_position_embeddings": 2048,
            }
        },
        "drafter": {"num_layers": 2, "block_size": SMALL_BLOCK, "mask_token_id": SMALL_MASK, **drafter},
        "data": {"token_budget": 128, "max_length": 64},
        "train": {"anchors": 16, "device": "cpu"},
    }


SMALL = [
    "drafter.num_layers=1",
    "drafter.block_size=4",
    "data.token_budget=256",
    "data.max_length=256",
    "data.max_batch_size=8",
    "data.eval_holdout=4",
    "train.anchors=16",
    "train.loss_chunk_size=8",
    "train.eval_every=0",
    "telemetry.log_every=1",
    "telemetry.wandb=disabled",
]


class StopAtStep:
    """A reporter that sends this process a real SIGTERM once `step` is logged (a preempted job)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_start(self, start) -> None:
        pass

    def on_log(self, record) -> None:
        if record.get("step") == self.step:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_checkpoint(self, path, step) -> None:
        pass

    def on_exit(self, reason, step) -> None:
        pass


def small_config(data: Path, run_dir: Path, *extra: str) -> RunConfig:
    """configs/tiny.toml at the SMALL shapes, training on `data`, writing to `run_dir`."""
    overrides = [*SMALL, f"data.train_files=['{data}']", f"train.output_dir={run_dir}", *extra]
    return load_config(ROOT / "configs" / "tiny.toml", overrides)


def random_tiny_lm_architecture() -> dict:
    """tiny-lm's architecture for seeded random weights. initializer_range 0.5: logits as large as a
    trained model's, so the loss falls steeply and its curve is sensitive to the learning rate (at
    HF's default 0.02 a 1% change moves it by 1e-5)."""
    return {**BUILTIN_TARGETS["tiny-lm"], "initializer_range": 0.5}


def random_target_config(tokenizer_dir: Path, data: Path, run_dir: Path, **train) -> RunConfig:
    """configs/tiny.toml over a seeded random-weight target of tiny-lm's architecture: the same weights
    on every machine (tiny-lm itself is trained on each machine, and its last bits differ between
    CPUs), and nothing to build first. `train` sets `[train]` fields."""
    raw = tomllib.loads((ROOT / "configs" / "tiny.toml").read_text())
    raw["target"] = {"architecture": random_tiny_lm_architecture(), "tokenizer": str(tokenizer_dir)}
    raw["data"]["train_files"] = [str(data)]
    raw["train"].update(output_dir=str(run_dir), **train)
    return validate_config(raw)


def run_dflash(
    *args: str, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`python -m app ARGS` from the repository root: the CLI as a user runs it, exit code included.
    `env`: variables added to this process's environment."""
    command = [sys.executable, "-m", "app", *args]
    environment = {**os.environ, **env} if env else None
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=environment)


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str


def dflash(capsys, monkeypatch, *args: str) -> Done:
    """The `dflash` console script's entry point, in this process (the CLI code path without a new
    interpreter, so without its start-up time): exit code and output."""
    from app.cli import main

    monkeypatch.setattr(sys, "argv", ["dflash", *args])
    capsys.readouterr()
    try:
        main()
        code = 0
    except SystemExit as done:
        code = done.code or 0
    out, err = capsys.readouterr()
    return Done(code, out, err)


def run_dflash_with_file_size_limit(
    limit: int, *args: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """`run_dflash` with no file of the process allowed past `limit` bytes (RLIMIT_FSIZE): a write
    beyond it fails with the real OS error EFBIG, as a full disk fails one with ENOSPC."""

    def limit_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG, not the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    command = [sys.executable, "-m", "app", *args]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, preexec_fn=limit_file_size
    )


@contextmanager
def unwritable_directory(path: Path) -> Iterator[Path]:
    """`path`, created, made unwritable for this process: mode 0555, and for root (whom modes do not
    stop) also the immutable attribute; skips the test where neither stops a write."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o555)
    chattr = shutil.which("chattr")
    immutable = bool(
        os.geteuid() == 0
        and chattr
        and subprocess.run([chattr, "+i", path], capture_output=True).returncode == 0
    )
    try:
        if _can_create_a_file_in(path):
            pytest.skip("no way to make a directory unwritable here (root, and chattr +i is refused)")
        yield path
    finally:
        if immutable:
            subprocess.run([chattr, "-i", path], check=True)
        path.chmod(0o755)


def _can_create_a_file_in(directory: Path) -> bool:
    try:
        (directory / "probe").touch()
    except OSError:
        return False
    (directory / "probe").unlink()
    return True
