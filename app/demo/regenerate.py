"""In-process regeneration for the CPU demo: the tiny target answers prompts greedily.

Production regeneration goes through `dflash datagen` and SGLang servers; the demo has no server,
so the target generates in this process. The output has the same shape as datagen's (parquet
`messages` records), so `dflash train` reads either.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from app.atomic import replace_directory, staging_directory


@torch.no_grad()
def regenerate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    out_dir: Path,
    *,
    max_new_tokens: int,
    min_new_tokens: int = 0,
    batch_size: int = 32,
    progress: Callable[[str], None] = print,
) -> Path:
    """Greedy responses to `prompts` written as one parquet shard of `messages` records in `out_dir`.

    `min_new_tokens`: the end of the turn is held off until then, so that every answer is long enough to
    train on (a tiny target stops as early as the short paragraphs it learned from)."""
    tokenizer.padding_side = "left"  # generation continues from the right edge of every row
    records = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        conversations = [[{"role": "user", "content": prompt}] for prompt in chunk]
        encoded = tokenizer.apply_chat_template(
            conversations, add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True
        )
        output = model.generate(
            **encoded,
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        responses = tokenizer.batch_decode(
            output[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True
        )
        for prompt, response in zip(chunk, responses, strict=True):
            if response.strip():  # an empty answer teaches nothing (datagen counts it as a failure too)
                records.append(
                    [{"role": "user", "content": prompt}, {"role": "assistant", "content": response.strip()}]
                )
        done = min(start + batch_size, len(prompts))
        progress(
            f"regenerated {done}/{len(prompts)} conversations ({done - len(records)} empty answers dropped)"
        )
    return _write_shard(records, out_dir)


def _write_shard(records: list[list[dict[str, str]]], out_dir: Path) -> Path:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_directory(out_dir)
    pq.write_table(pa.table({"messages": records}), staging / "shard-00000.parquet")
    replace_directory(staging, out_dir)
    return out_dir
