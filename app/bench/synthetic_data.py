"""Conversations of realistic lengths for throughput runs with random-weight targets.

A random-weight target of a real shape has no tokenizer and no data of its own; throughput depends
on sequence lengths, not on content. This writes the tiny tokenizer (its ids are valid rows of any
real vocabulary) and conversations whose assistant turns are long runs of real prose, with lengths
spread like regenerated chat data.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from app.atomic import write_text_atomic
from app.model.tiny_tokenizer import build_tokenizer, corpus_paragraphs, save_tokenizer

TOKENIZER_VOCAB = 2048


def write_benchmark_data(
    out_dir: Path, conversations: int, mean_words: int, seed: int = 0
) -> tuple[Path, Path]:
    """Write `out_dir/tokenizer/` and `out_dir/train.jsonl`; returns (tokenizer dir, data file)."""
    paragraphs = corpus_paragraphs()
    tokenizer_dir = out_dir / "tokenizer"
    if not (tokenizer_dir / "tokenizer.json").is_file():
        save_tokenizer(build_tokenizer(TOKENIZER_VOCAB, paragraphs), tokenizer_dir)
    rng = random.Random(seed)
    lines = []
    for _ in range(conversations):
        # lengths between a quarter and twice the mean, as answers of a chat model vary
        words = int(mean_words * rng.uniform(0.25, 2.0))
        answer: list[str] = []
        while len(answer) < words:
            answer += rng.choice(paragraphs).split()
        question = " ".join(rng.choice(paragraphs).split()[:24])
        record = {
            "messages": [
                {"role": "user", "content": question},
                {"role": "assistant", "content": " ".join(answer[:words])},
            ]
        }
        lines.append(json.dumps(record))
    data_file = out_dir / "train.jsonl"
    write_text_atomic(data_file, "\n".join(lines) + "\n")
    return tokenizer_dir, data_file
