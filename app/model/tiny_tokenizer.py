"""A small byte-level BPE tokenizer with a Qwen3-style chat template, trained on text from the locked torch package.

It is the built-in `tiny-lm` target's tokenizer (the CPU demo) and the tokenizer every test uses:
nothing is downloaded. Its chat format is Qwen3's (`<|im_start|>role\\n...<|im_end|>`, `<think>`
blocks, `<tool_call>` JSON), so the data pipeline's assistant-span logic is exercised as for real targets.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from app.atomic import publish_directory, staging_directory

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

# Modules whose docstrings make the corpus: English prose about tensors and training. They come from the
# torch build pinned in uv.lock, so the corpus (and the demo target trained on it) is the same on every
# machine and Python version that installs the lock.
CORPUS_MODULES = (
    "torch.nn.modules.linear", "torch.nn.modules.conv", "torch.nn.modules.activation", "torch.nn.modules.loss",
    "torch.nn.modules.normalization", "torch.nn.modules.rnn", "torch.nn.modules.transformer",
    "torch.nn.modules.pooling", "torch.nn.modules.sparse", "torch.nn.modules.dropout", "torch.nn.modules.batchnorm",
    "torch.optim.adamw", "torch.optim.sgd", "torch.optim.lr_scheduler", "torch.utils.data.dataset",
    "torch.utils.data.dataloader", "torch.utils.data.sampler", "torch.utils.checkpoint", "torch.nn.utils.clip_grad",
    "torch.serialization", "torch.autograd.function", "torch.random",
)  # fmt: skip


def corpus_paragraphs() -> list[str]:
    """Prose paragraphs of the docstrings of `CORPUS_MODULES` and their members, in a fixed order."""
    import importlib

    paragraphs: list[str] = []
    for name in CORPUS_MODULES:
        module = importlib.import_module(name)
        members = [getattr(module, attr) for attr in sorted(vars(module)) if not attr.startswith("_")]
        own_members = [m for m in members if callable(m) and getattr(m, "__module__", None) == name]
        for obj in [module, *own_members]:
            for block in (inspect.getdoc(obj) or "").split("\n\n"):
                text = " ".join(block.split())
                if _is_prose(text):
                    paragraphs.append(text)
    return list(dict.fromkeys(paragraphs))  # de-duplicate, keep order


def _is_prose(text: str) -> bool:
    """Sentences, not code samples, reST directives, argument lists or formulas."""
    return (
        len(text) >= 40
        and not text.startswith((">>>", "...", "..", "Args:", "Example", "Shape:", "Returns:", "Note:"))
        and text.count("\\") < 2
        and text.count("=") < 3
        and text[0].isupper()
    )


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
    staging = staging_directory(directory)
    tokenizer.save_pretrained(staging)
    publish_directory(staging, directory)  # a process that finished first wrote the same tokenizer
