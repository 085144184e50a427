"""A small byte-level BPE tokenizer with a Qwen3-style chat template, trained on text that ships with Python.

It is the built-in `tiny-lm` target's tokenizer (the CPU demo) and the tokenizer every test uses:
nothing is downloaded. Its chat format is Qwen3's (`<|im_start|>role\\n...<|im_end|>`, `<think>`
blocks, `<tool_call>` JSON), so the data pipeline's assistant-span logic is exercised as for real targets.
"""

from __future__ import annotations

import inspect
import os
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = [
    "<|endoftext|>",  # 0: padding and end of document, as in Qwen
    "<|im_start|>",  # 1
    "<|im_end|>",  # 2
    "<|mask|>",  # 3: the drafter's MASK token
    "<think>",  # 4
    "</think>",  # 5
    "<tool_call>",  # 6
    "</tool_call>",  # 7
]
MASK_TOKEN_ID = SPECIAL_TOKENS.index("<|mask|>")

# Qwen3's template, reduced to what the data pipeline must handle: system/user/assistant/tool turns,
# reasoning_content in <think>, tool calls as JSON, and the generation prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.reasoning_content %}"
    "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + fn.name + \'", "arguments": \' }}'
    "{{- fn.arguments if fn.arguments is string else fn.arguments | tojson }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Stdlib modules whose docstrings make the corpus: plain English prose, present in every CPython >= 3.11.
CORPUS_MODULES = (
    "argparse", "collections", "contextlib", "csv", "dataclasses", "datetime", "decimal", "difflib",
    "email", "enum", "fractions", "functools", "heapq", "http.client", "inspect", "json", "logging",
    "os", "pathlib", "pickle", "random", "re", "shutil", "socket", "statistics", "string", "subprocess",
    "tarfile", "textwrap", "threading", "typing", "unittest", "urllib.parse", "uuid", "zipfile",
)  # fmt: skip


def corpus_paragraphs() -> list[str]:
    """Docstring paragraphs of `CORPUS_MODULES` and their public members, in a fixed order."""
    import importlib

    paragraphs: list[str] = []
    for name in CORPUS_MODULES:
        module = importlib.import_module(name)
        objects = [module] + [
            getattr(module, attr) for attr in sorted(vars(module)) if not attr.startswith("_")
        ]
        for obj in objects:
            doc = inspect.getdoc(obj) if callable(obj) or inspect.ismodule(obj) else None
            if not doc or (
                getattr(obj, "__module__", name) not in (name, None) and not inspect.ismodule(obj)
            ):
                continue
            for block in doc.split("\n\n"):
                text = " ".join(block.split())
                if len(text) >= 40 and not text.startswith((">>>", "...")):
                    paragraphs.append(text)
    return list(dict.fromkeys(paragraphs))  # de-duplicate, keep order


def build_tokenizer(vocab_size: int, paragraphs: list[str]) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of `vocab_size` tokens on `paragraphs` and wrap it with the chat template."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(paragraphs, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, directory: Path) -> None:
    """Write the tokenizer into `directory` atomically (a temp dir renamed into place)."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    tokenizer.save_pretrained(staging)
    try:
        os.rename(staging, directory)
    except OSError:
        # another process finished first; its tokenizer is identical
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
