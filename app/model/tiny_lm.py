"""The built-in `tiny-lm` target: a small Qwen3 trained briefly on Python's own docstrings.

It behaves like a (very small) chat language model, not like noise, so a drafter trained on its
outputs learns something measurable: the CPU demo and the tests use it, and nothing is downloaded.
Built once per machine (about a minute on 2 cores) and cached; concurrent callers wait on a file lock.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from app.atomic import replace_directory, staging_directory
from app.config.builtins import BUILTIN_TARGETS
from app.locks import held
from app.model.tiny_tokenizer import build_tokenizer, corpus_paragraphs
from app.paths import cache_root as dflash_cache_root
from app.paths import make_cache_dir

RECIPE = {"steps": 300, "batch_size": 8, "seq_len": 128, "lr": 3e-3, "warmup": 30, "seed": 1234}
"""Pre-training recipe: enough for fluent-looking, deterministic continuations on 2 CPU cores in under a minute."""

PROGRESS_EVERY = 25
"""Pre-training steps between progress lines (a few seconds on 2 cores: a build is never silent for long)."""

PROMPT_WORDS = 8
"""A chat sample's user turn is the first PROMPT_WORDS words of a paragraph; the assistant continues it."""


def chat_sample(paragraph: str) -> list[dict[str, str]]:
    """One paragraph as a conversation: the user gives its opening words, the assistant continues."""
    words = paragraph.split()
    return [
        {"role": "user", "content": "Continue: " + " ".join(words[:PROMPT_WORDS])},
        {"role": "assistant", "content": " ".join(words[PROMPT_WORDS:])},
    ]


def tiny_lm_dir(cache_root: Path | None = None) -> Path:
    """Where the built-in target lives, keyed by architecture, recipe, corpus and torch version."""
    root = cache_root or dflash_cache_root()
    key_source = json.dumps(
        {
            "arch": BUILTIN_TARGETS["tiny-lm"],
            "recipe": RECIPE,
            "corpus": _corpus_hash(),
            "torch": torch.__version__,
        },
        sort_keys=True,
    )
    return root / "tiny-lm" / hashlib.sha256(key_source.encode()).hexdigest()[:16]


def ensure_tiny_lm(cache_root: Path | None = None, progress: Callable[[str], None] | None = None) -> Path:
    """Return the built-in target's directory (HF model + tokenizer), training it first if needed.

    A build reports on `progress` (default: standard error) before it starts and every
    PROGRESS_EVERY steps, so a first run on a new machine is never mistaken for a hang."""
    directory = tiny_lm_dir(cache_root)
    if (directory / "config.json").is_file():
        return directory
    make_cache_dir(directory.parent)
    say = progress or _print_to_stderr
    with held(directory.parent / ".build.lock", waiting=say):  # another process may be building it
        if not (directory / "config.json").is_file():
            _build(directory, say)
    return directory


def _print_to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _build(directory: Path, progress: Callable[[str], None]) -> None:
    steps = RECIPE["steps"]
    progress(
        f"tiny-lm: building the built-in target once for this machine ({steps} pre-training steps, about "
        f"a minute on 2 cores), cached in {directory}"
    )
    paragraphs = corpus_paragraphs()
    architecture = BUILTIN_TARGETS["tiny-lm"]
    tokenizer = build_tokenizer(architecture["vocab_size"], paragraphs)
    texts = [tokenizer.apply_chat_template(chat_sample(p), tokenize=False) for p in paragraphs]
    stream = torch.tensor([t for text in texts for t in tokenizer(text)["input_ids"]], dtype=torch.long)

    torch.manual_seed(RECIPE["seed"])
    config = Qwen3Config(**{k: v for k, v in architecture.items() if k != "model_type"})
    model = Qwen3ForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=RECIPE["lr"], weight_decay=0.01, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(RECIPE["seed"])
    seq_len, batch_size = RECIPE["seq_len"], RECIPE["batch_size"]
    started = time.monotonic()
    model.train()
    for step in range(steps):
        lr_scale = (
            min(1.0, (step + 1) / RECIPE["warmup"])
            * 0.5
            * (1 + torch.cos(torch.tensor(torch.pi * step / steps)))
        )
        for group in optimizer.param_groups:
            group["lr"] = RECIPE["lr"] * float(lr_scale)
        starts = torch.randint(0, len(stream) - seq_len - 1, (batch_size,), generator=generator)
        batch = torch.stack([stream[s : s + seq_len] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % PROGRESS_EVERY == 0 or step == 0:
            progress(
                f"tiny-lm pre-training: step {step + 1}/{steps} loss {loss.item():.3f} ({time.monotonic() - started:.0f}s)"
            )

    model.eval()
    # stop generation (HF generate, `transformers serve`) at the end of the assistant turn
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    staging = staging_directory(directory)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    replace_directory(staging, directory)


def _corpus_hash() -> str:
    return hashlib.sha256("\n".join(corpus_paragraphs()).encode()).hexdigest()[:16]
