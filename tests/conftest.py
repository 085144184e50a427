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
