import pytest

# --- data pipeline fixtures: the tiny tokenizer, built once per session (self-contained) ---


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    """Directory of the tiny BPE tokenizer with its Qwen3-style chat template (built in ~0.3 s)."""
    from app.model.tiny_tokenizer import build_tokenizer, corpus_paragraphs, save_tokenizer

    directory = tmp_path_factory.mktemp("tiny-tokenizer") / "tokenizer"
    save_tokenizer(build_tokenizer(2048, corpus_paragraphs()), directory)
    return directory


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir):
    """The tiny tokenizer loaded from `tiny_tokenizer_dir`, as a trainer would load a target's."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


# --- trainer fixtures: the built-in tiny-lm target and conversations in its chat format ---


@pytest.fixture(scope="session")
def tiny_lm_dir():
    """The built-in `tiny-lm` target (trained once per machine, cached under ~/.cache/dflash)."""
    from app.model.tiny_lm import ensure_tiny_lm

    return ensure_tiny_lm()


@pytest.fixture(scope="session")
def tiny_conversations(tmp_path_factory):
    """A jsonl of conversations in the tiny target's chat format (OpenAI `messages` records)."""
    import json

    from app.model.tiny_lm import chat_sample
    from app.model.tiny_tokenizer import corpus_paragraphs

    path = tmp_path_factory.mktemp("conversations") / "train.jsonl"
    with open(path, "w") as handle:
        for paragraph in corpus_paragraphs():
            if len(paragraph.split()) >= 24:
                handle.write(json.dumps({"messages": chat_sample(paragraph)}) + "\n")
    return path


@pytest.fixture(autouse=True)
def no_ambient_wandb_settings(monkeypatch):
    """A machine's own WANDB_* variables (CI sets WANDB_MODE) must not change what the tests see."""
    import os

    for name in [name for name in os.environ if name.startswith("WANDB_")]:
        monkeypatch.delenv(name)
