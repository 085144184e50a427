"""`dflash demo`: the whole flow on CPU in a few minutes, with nothing downloaded.

1. build the tiny target (a small Qwen3 trained on the locked torch package's docstrings; cached);
2. regenerate a small dataset with that target (its own greedy answers, as datagen does with SGLang);
3. measure tau of an untrained drafter on held-out prompts;
4. train the drafter with configs/tiny.toml;
5. measure tau again and export the drafter in the HF DFlash format.

The run has the telemetry of any run (status.json, metrics.jsonl, plots), so `dflash status` inspects it.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from app.config import load_config
from app.data.dataset import min_supervised_tokens
from app.demo.regenerate import regenerate
from app.errors import UserError
from app.evaluate.speculative import EvalResult
from app.model.tiny_lm import PROMPT_WORDS, ensure_tiny_lm
from app.model.tiny_tokenizer import corpus_paragraphs

DEMO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"


@dataclass
class DemoResult:
    tau_before: float
    tau_after: float
    tree_tau_before: float | None
    """DDTree's tau at `train.eval_tree_budget` (None when that is 0), before and after training."""
    tree_tau_after: float | None
    export_dir: Path
    seconds: float
    run_dir: Path


def run_demo(
    config_path: Path = DEMO_CONFIG,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    prompts: int = 256,
    max_new_tokens: int = 48,
    log: Callable[[str], None] = print,
) -> DemoResult:
    from app.export.hf_dflash import export_drafter
    from app.telemetry.plots import write_plots
    from app.telemetry.status_report import EXPORT_DIR
    from app.train.trainer import Trainer

    started = time.monotonic()
    config = load_config(config_path, list(overrides))
    # every answer long enough to train on: the tiny target alone stops after a few words on 2 in 5 prompts
    min_new_tokens = min_supervised_tokens(config)
    if max_new_tokens < min_new_tokens:
        raise UserError(
            f"demo: max_new_tokens = {max_new_tokens} is below the {min_new_tokens} supervised tokens a "
            "training sample needs (2 x drafter.block_size)"
        )
    log("[1/5] tiny target: building or loading the built-in tiny-lm (first run: a few minutes)")
    target_dir = ensure_tiny_lm(progress=log)

    data_dir = Path(config.data.train_files[0])
    log(f"[2/5] regenerating {prompts} conversations with the target into {data_dir}")
    _regenerate(
        target_dir, data_dir, prompts, log, min_new_tokens=min_new_tokens, max_new_tokens=max_new_tokens
    )

    log("[3/5] tau of an untrained drafter (greedy speculative decoding on held-out prompts)")
    shutil.rmtree(config.train.output_dir, ignore_errors=True)  # the demo always trains from scratch
    trainer = Trainer(config, log=log)
    before = trainer.evaluator(trainer.drafter)
    log(f"      tau before training: {_taus(before)}")

    log(f"[4/5] training the drafter ({trainer.total_steps} steps)")
    trainer.run()

    log("[5/5] tau after training, and export")
    after = trainer.evaluator(trainer.drafter)
    export_dir = export_drafter(
        trainer.drafter, Path(config.train.output_dir) / EXPORT_DIR, trainer.target.model.config
    )
    run_dir = Path(config.train.output_dir)
    write_plots(run_dir)
    seconds = time.monotonic() - started
    for line in after.describe():
        log("      " + line)
    log(
        f"demo done in {seconds:.0f}s: {_taus(before)} -> {_taus(after)} "
        f"(block size {config.drafter.block_size}); exported drafter: {export_dir}"
    )
    log(f"inspect the run: dflash status {run_dir} (plots in {run_dir / 'plots'})")
    return DemoResult(before.tau, after.tau, before.tree_tau, after.tree_tau, export_dir, seconds, run_dir)


def _taus(result: EvalResult) -> str:
    """`chain tau 1.42, tree tau 1.87`: the chain's and, when measured, the configured tree budget's."""
    tree = f", tree tau {result.tree_tau:.2f}" if result.tree_tau is not None else ""
    return f"chain tau {result.tau:.2f}{tree}"


def _regenerate(
    target_dir: Path,
    data_dir: Path,
    prompts: int,
    log: Callable[[str], None],
    *,
    min_new_tokens: int,
    max_new_tokens: int,
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    # The target's own prompt style: the opening words of a paragraph it was trained on.
    openings = [
        "Continue: " + " ".join(paragraph.split()[:PROMPT_WORDS])
        for paragraph in corpus_paragraphs()
        if len(paragraph.split()) > PROMPT_WORDS
    ]
    regenerate(
        model,
        tokenizer,
        openings[:prompts],
        data_dir,
        min_new_tokens=min_new_tokens,
        max_new_tokens=max_new_tokens,
        progress=log,
    )
