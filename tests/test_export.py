"""HF DFlash export: reference layout and config, the fields each serving engine release reads, the mask
token's string, exact round trips, refusals, atomic writes, the CLI."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer, models
from transformers import AutoConfig, PreTrainedTokenizerFast, Qwen3Config

from app.checkpoint.store import save_checkpoint
from app.config import validate_config
from app.errors import UserError
from app.export import export_drafter, load_exported, load_trained_drafter
from app.export.mask_token import mask_token_string
from app.model.drafter import DFlashDrafter, DrafterArch
from app.model.target import target_text_config
from tests.helpers import (
    REFERENCE_LAYER_WEIGHTS,
    SMALL_BLOCK,
    SMALL_HIDDEN,
    SMALL_MASK,
    SMALL_TARGET_LAYERS,
    SMALL_VOCAB,
    dflash,
    small_drafter_raw_config,
)

VOCAB, HIDDEN, LAYERS, BLOCK, MASK = SMALL_VOCAB, SMALL_HIDDEN, SMALL_TARGET_LAYERS, SMALL_BLOCK, SMALL_MASK
MASK_TOKEN = "</tool_call>"  # id 7 (MASK) of the tiny tokenizer (app/model/tiny_tokenizer.py)


def build(seed: int = 0, **drafter):
    config = validate_config(small_drafter_raw_config(**drafter))
    target = target_text_config(config.target)
    return DFlashDrafter(DrafterArch.from_config(config, target), seed=seed), target


def frozen_head():
    generator = torch.Generator().manual_seed(0)
    embed_tokens = torch.nn.Embedding(VOCAB, HIDDEN).requires_grad_(False)
    lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False).requires_grad_(False)
    for module in (embed_tokens, lm_head):
        module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * 0.5)
    return embed_tokens, lm_head


def draft_logits(drafter: DFlashDrafter) -> torch.Tensor:
    """Logits of one draft round over 12 context tokens (the inference path the engines mirror)."""
    embed_tokens, lm_head = frozen_head()
    features = torch.randn(12, drafter.arch.feature_size, generator=torch.Generator().manual_seed(1))
    cache = drafter.new_cache()
    drafter.extend_context(features, torch.arange(12), cache)
    return drafter.draft_logits(cache, 42, 12, embed_tokens, lm_head)


def test_weights_carry_exactly_the_reference_names_and_no_embedding(tiny_tokenizer, tmp_path: Path) -> None:
    drafter, target = build()
    out = export_drafter(drafter, tmp_path / "export", target, tokenizer=tiny_tokenizer)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    expected |= {f"layers.{i}.{name}" for i in range(2) for name in REFERENCE_LAYER_WEIGHTS}
    with safe_open(out / "model.safetensors", "pt") as weights:
        assert set(weights.keys()) == expected
        assert weights.metadata() == {"format": "pt"}  # transformers' from_pretrained requires it
        dtypes = {weights.get_tensor(name).dtype for name in weights.keys()}  # noqa: SIM118 (not a dict)
        assert dtypes == {torch.bfloat16}  # the default export dtype
        assert weights.get_tensor("fc.weight").shape == (HIDDEN, 2 * HIDDEN)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_an_export_is_readable_as_the_umask_allows(tiny_tokenizer, tmp_path: Path, umask: int) -> None:
    """A serving container runs as another user: the export gets a plain mkdir's and open's modes,
    not the private 0700/0600 of the temp directory it was staged in."""
    drafter, target = build()
    previous = os.umask(umask)
    try:
        out = export_drafter(drafter, tmp_path / "export", target, tokenizer=tiny_tokenizer)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    for name in ("config.json", "model.safetensors"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o666 & ~umask, name


def test_config_states_every_field_the_serving_engines_read(tiny_tokenizer, tmp_path: Path) -> None:
    drafter, target = build()
    out = export_drafter(drafter, tmp_path / "export", target, dtype="fp32", tokenizer=tiny_tokenizer)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {
        "mask_token_id": MASK,
        "mask_token": MASK_TOKEN,
        "target_layer_ids": [1, 5],
        "block_size": BLOCK,
    }
    assert tiny_tokenizer.convert_tokens_to_ids(config["dflash_config"]["mask_token"]) == MASK
    # vLLM's capture index L is the stream entering layer L: the tapped layers' outputs are id + 1.
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 6]
    expected = {
        "hidden_size": HIDDEN,
        "target_hidden_size": HIDDEN,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 96,
        "rope_theta": 5000.0,
        "vocab_size": VOCAB,
        "max_position_embeddings": 2048,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "block_size": BLOCK,
        "num_target_layers": LAYERS,
        "layer_types": ["full_attention", "full_attention"],
        "sliding_window": None,
    }
    assert {key: config[key] for key in expected} == expected
    assert config["rms_norm_eps"] == pytest.approx(1e-6)
    # The engines parse it as a Qwen3 config: the extra DFlash fields must survive that.
    parsed = AutoConfig.from_pretrained(out)
    assert isinstance(parsed, Qwen3Config)
    assert (parsed.num_hidden_layers, parsed.head_dim, parsed.num_key_value_heads) == (2, 16, 2)
    assert parsed.dflash_config["target_layer_ids"] == [1, 5] and parsed.num_target_layers == LAYERS


def test_fp32_round_trip_is_exact(tiny_tokenizer, tmp_path: Path) -> None:
    drafter, target = build(seed=3)
    out = export_drafter(drafter, tmp_path / "export", target, dtype="fp32", tokenizer=tiny_tokenizer)
    loaded = load_exported(out)
    assert loaded.arch == drafter.arch
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert torch.equal(draft_logits(loaded), draft_logits(drafter))


def test_bf16_round_trip_is_within_rounding(tiny_tokenizer, tmp_path: Path) -> None:
    drafter, target = build(seed=3)
    out = export_drafter(drafter, tmp_path / "export", target, tokenizer=tiny_tokenizer)
    assert load_exported(out).fc.weight.dtype == torch.bfloat16
    loaded = load_exported(out, dtype=torch.float32)
    reference = draft_logits(drafter)
    torch.testing.assert_close(
        draft_logits(loaded), reference, rtol=0.05, atol=0.05 * reference.abs().max().item()
    )
    assert torch.equal(draft_logits(loaded).argmax(-1), reference.argmax(-1))


def test_sliding_window_layers_round_trip_as_layer_types(tiny_tokenizer, tmp_path: Path) -> None:
    drafter, target = build(sliding_window=12, sliding_window_layers=[1])
    out = export_drafter(drafter, tmp_path / "export", target, dtype="fp32", tokenizer=tiny_tokenizer)
    config = json.loads((out / "config.json").read_text())
    assert config["layer_types"] == ["full_attention", "sliding_attention"] and config["sliding_window"] == 12
    assert config["use_sliding_window"] is True
    assert load_exported(out).arch == drafter.arch


@pytest.mark.parametrize("window", [None, 12], ids=["no window", "a window no layer uses"])
def test_a_full_attention_drafter_states_no_sliding_window(tiny_tokenizer, tmp_path: Path, window) -> None:
    """An engine that reads `use_sliding_window` or a set `sliding_window` may window every layer: a
    drafter trained with full attention would be served with a mask it never saw."""
    drafter, target = build(sliding_window=window)
    out = export_drafter(drafter, tmp_path / "export", target, tokenizer=tiny_tokenizer)
    config = json.loads((out / "config.json").read_text())
    assert config["layer_types"] == ["full_attention", "full_attention"]
    assert (config["use_sliding_window"], config["sliding_window"]) == (False, None)
    parsed = AutoConfig.from_pretrained(out)
    assert not parsed.use_sliding_window and parsed.sliding_window is None


def test_export_refuses_a_drafter_that_does_not_fit_the_target(tiny_tokenizer, tmp_path: Path) -> None:
    drafter, target = build()
    small_vocab = Qwen3Config(**{**target.to_dict(), "vocab_size": MASK})
    with pytest.raises(UserError, match="mask_token_id 7 is not a row of the target embedding"):
        export_drafter(drafter, tmp_path / "a", small_vocab, tokenizer=tiny_tokenizer)
    shallow = Qwen3Config(**{**target.to_dict(), "num_hidden_layers": 4, "layer_types": None})
    with pytest.raises(UserError, match=r"target_layer_ids \[5\] are out of range for the 4-layer target"):
        export_drafter(drafter, tmp_path / "b", shallow, tokenizer=tiny_tokenizer)
    with torch.no_grad():
        drafter.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(UserError, match=r"layers\.1\.mlp\.up_proj\.weight.*NaN"):
        export_drafter(drafter, tmp_path / "c", target, tokenizer=tiny_tokenizer)
    assert not any(tmp_path.iterdir())  # nothing half-written


def test_export_replaces_an_earlier_export_atomically_and_protects_other_directories(
    tiny_tokenizer, tmp_path: Path
) -> None:
    first, target = build(seed=1)
    second, _ = build(seed=2)
    out = tmp_path / "export"
    export_drafter(first, out, target, dtype="fp32", tokenizer=tiny_tokenizer)
    export_drafter(second, out, target, dtype="fp32", tokenizer=tiny_tokenizer)
    assert torch.equal(load_exported(out).fc.weight, second.fc.weight)
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no staging or set-aside directory left
    precious = tmp_path / "notes"
    precious.mkdir()
    (precious / "todo.txt").write_text("keep me")
    with pytest.raises(UserError, match="not a DFlash export; refusing to replace it"):
        export_drafter(first, precious, target, tokenizer=tiny_tokenizer)
    assert (precious / "todo.txt").read_text() == "keep me"


def test_load_exported_names_what_is_wrong(tiny_tokenizer, tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"not a DFlash export \(missing config.json\)"):
        load_exported(tmp_path)
    drafter, target = build()
    out = export_drafter(drafter, tmp_path / "export", target, dtype="fp32", tokenizer=tiny_tokenizer)
    config = json.loads((out / "config.json").read_text())
    del config["dflash_config"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="dflash_config is missing"):
        load_exported(out)


def make_run_dir(root: Path, drafter: DFlashDrafter, tokenizer_dir: Path | None, step: int = 7) -> Path:
    """A run directory as the trainer leaves it: the resolved config as JSON and one checkpoint; the
    random-weight target names `tokenizer_dir` as its tokenizer (None: no tokenizer)."""
    run_dir = root / "run"
    raw = small_drafter_raw_config()
    if tokenizer_dir is not None:
        raw["target"]["tokenizer"] = str(tokenizer_dir)
    config = validate_config(raw)
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(config.model_dump(mode="json")))
    save_checkpoint(run_dir, step, drafter.state_dict(), {}, {"cpu": torch.get_rng_state()}, {}, keep_last=2)
    return run_dir


def test_trained_drafter_loads_from_a_run_or_a_checkpoint_directory(tmp_path: Path) -> None:
    drafter, _ = build(seed=5)
    run_dir = make_run_dir(tmp_path, drafter, None)
    from_run = load_trained_drafter(run_dir)
    from_checkpoint = load_trained_drafter(run_dir / "checkpoints" / "step_00000007")
    for trained in (from_run, from_checkpoint):
        assert trained.step == 7
        assert torch.equal(trained.build().fc.weight, drafter.fc.weight)
    with pytest.raises(UserError, match="expected a run directory"):
        load_trained_drafter(tmp_path)
    (run_dir / "config.json").write_text(
        json.dumps(
            {
                **small_drafter_raw_config(),
                "drafter": {**small_drafter_raw_config()["drafter"], "num_layers": 3},
            }
        )
    )
    with pytest.raises(
        UserError, match=r"weights do not match the run config's drafter: missing \['layers\.2"
    ):
        load_trained_drafter(run_dir).build()


def test_export_cli_writes_a_loadable_export(
    tiny_tokenizer_dir: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    """The `dflash` entry point in this process: a new interpreter cost ~10 s of CPU and tested nothing
    more here (`python -m app` itself runs in the tests that call `run_dflash`)."""
    drafter, _ = build(seed=9)
    run_dir = make_run_dir(tmp_path, drafter, tiny_tokenizer_dir, step=12)
    out = tmp_path / "exported"
    done = dflash(capsys, monkeypatch, "export", str(run_dir), "--out", str(out), "--dtype", "fp32")
    assert done.returncode == 0, done.stderr
    assert "exported step 12" in done.stdout and "target_layer_ids [1, 5]" in done.stdout
    assert f"mask_token_id {MASK} ({MASK_TOKEN!r})" in done.stdout
    assert torch.equal(draft_logits(load_exported(out)), draft_logits(drafter))
    block = drafter.arch.block_size
    assert (
        f"--speculative-algorithm DFLASH --speculative-draft-model-path {out} --speculative-num-draft-tokens {block}"
        in done.stdout
    )
    assert (
        f'"model": "{out}", "num_speculative_tokens": {block - 1}' in done.stdout
    )  # vLLM: the block minus its anchor
    config = json.loads((out / "config.json").read_text())
    assert config["dflash_config"]["mask_token"] == MASK_TOKEN
    assert config["dflash_config"]["target_layer_ids"] == [1, 5]
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 6]


def test_export_cli_refuses_a_bad_source_in_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    from app.cli import main

    monkeypatch.setattr(
        sys, "argv", ["dflash", "export", str(tmp_path / "missing"), "--out", str(tmp_path / "x")]
    )
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2
    error = capsys.readouterr().err.strip()
    assert (
        error.startswith("dflash: error:")
        and "expected a run directory" in error
        and len(error.splitlines()) == 1
    )


# What each engine release reads from config.json that the export must state: without it the engine
# refuses the drafter or substitutes a default that is not the trained one (Qwen3Config's head_dim 128,
# RoPE base 1e6, block size 16, its own layer-id rule, the string `<|MASK|>`). Read from the published
# packages' source; docs/guide.md section 7 has the table. A version bump adds a list beside these.
SGLANG_0_5_11_REQUIRES = [
    "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "hidden_act", "rms_norm_eps", "rope_theta", "max_position_embeddings",
    "num_target_layers", "block_size", "dflash_config.block_size", "dflash_config.mask_token",
    "dflash_config.mask_token_id", "dflash_config.target_layer_ids",
]  # fmt: skip
SGLANG_0_5_19_REQUIRES = [
    "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "hidden_act", "rms_norm_eps", "rope_theta", "rope_parameters",
    "max_position_embeddings", "num_target_layers", "block_size", "dflash_config.block_size",
    "dflash_config.mask_token", "dflash_config.mask_token_id", "dflash_config.target_layer_ids",
    "layer_types", "sliding_window",
]  # fmt: skip
SGLANG_0_5_23_REQUIRES = SGLANG_0_5_19_REQUIRES  # its DFlash loader reads the same fields
VLLM_0_20_0_REQUIRES = [
    "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "hidden_act", "rms_norm_eps", "rope_theta", "rope_parameters",
    "max_position_embeddings", "vocab_size", "target_hidden_size", "dflash_config.mask_token_id",
    "dflash_config.target_layer_ids", "eagle_aux_hidden_state_layer_ids",
]  # fmt: skip
VLLM_0_34_0_REQUIRES = [
    "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "hidden_act", "rms_norm_eps", "rope_theta", "rope_parameters",
    "max_position_embeddings", "vocab_size", "target_hidden_size", "dflash_config.mask_token_id",
    "dflash_config.target_layer_ids", "eagle_aux_hidden_state_layer_ids", "layer_types", "sliding_window",
]  # fmt: skip
ENGINE_REQUIRES = {
    "sglang-0.5.11": SGLANG_0_5_11_REQUIRES,
    "sglang-0.5.19": SGLANG_0_5_19_REQUIRES,
    "sglang-0.5.23": SGLANG_0_5_23_REQUIRES,
    "vllm-0.20.0": VLLM_0_20_0_REQUIRES,
    "vllm-0.34.0": VLLM_0_34_0_REQUIRES,
}


@pytest.mark.parametrize("engine", sorted(ENGINE_REQUIRES))
def test_export_states_every_field_the_engine_release_requires(
    engine: str, tiny_tokenizer, tmp_path: Path
) -> None:
    """A sliding layer makes `sliding_window` one of them (an engine refuses sliding layers without it)."""
    drafter, target = build(sliding_window=12, sliding_window_layers=[1])
    out = export_drafter(drafter, tmp_path / "export", target, tokenizer=tiny_tokenizer)
    config = json.loads((out / "config.json").read_text())

    def field(path: str) -> object:
        value: object = config
        for key in path.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        return value

    assert len(set(ENGINE_REQUIRES[engine])) == len(ENGINE_REQUIRES[engine])
    assert [path for path in ENGINE_REQUIRES[engine] if field(path) is None] == []


def word_tokenizer(size: int, *special: str) -> PreTrainedTokenizerFast:
    """A word-level tokenizer of `size` tokens (`w0`, `w1`, ...), then `special` ones after them."""
    model = Tokenizer(models.WordLevel({f"w{i}": i for i in range(size)}, unk_token="w0"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="w0")
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    return tokenizer


class SharedSpelling:
    """A tokenizer whose id 7 spells the token of id 2: the string reads back as another id."""

    name_or_path = "shared-spelling"

    def __len__(self) -> int:
        return 10

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return "w2" if token_id == 7 else f"w{token_id}"

    def convert_tokens_to_ids(self, token: str) -> int:
        return int(token[1:])


def test_mask_token_is_the_ids_token_or_the_one_engines_add_at_the_next_free_id(tiny_tokenizer) -> None:
    assert (
        mask_token_string(tiny_tokenizer, 3) == "<|mask|>"
        and mask_token_string(tiny_tokenizer, 7) == MASK_TOKEN
    )
    # An id one past the tokenizer's last (Qwen3's 151669) is where SGLang's added `<|MASK|>` lands.
    assert mask_token_string(word_tokenizer(7), 7) == "<|MASK|>"
    with pytest.raises(
        UserError, match=r"mask_token_id 7 is no token of the target's tokenizer \(5 tokens\)"
    ):
        mask_token_string(word_tokenizer(5), 7)
    with pytest.raises(UserError, match=r"next free id .* but '<\|MASK\|>' is already its id 6"):
        mask_token_string(word_tokenizer(6, "<|MASK|>"), 7)
    with pytest.raises(UserError, match=r"mask_token_id 7 is 'w2' .* reads back as id 2"):
        mask_token_string(SharedSpelling(), 7)  # type: ignore[arg-type]


def test_export_without_the_targets_tokenizer_is_refused_before_writing(
    tiny_tokenizer_dir: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """No config without `dflash_config.mask_token`: the export names what is missing, in one line."""
    drafter, target = build()
    with pytest.raises(UserError, match=r"needs the target's tokenizer: pass tokenizer="):
        export_drafter(drafter, tmp_path / "a", target)  # a random-weight target: no directory
    target.name_or_path = str(tiny_tokenizer_dir)  # a target loaded from a directory (the demo's)
    config = json.loads((export_drafter(drafter, tmp_path / "b", target) / "config.json").read_text())
    assert config["dflash_config"]["mask_token"] == MASK_TOKEN

    from app.cli import main

    run_dir = make_run_dir(tmp_path, drafter, None)
    monkeypatch.setattr(sys, "argv", ["dflash", "export", str(run_dir), "--out", str(tmp_path / "c")])
    with pytest.raises(SystemExit) as exited:
        main()
    error = capsys.readouterr().err.strip()
    assert exited.value.code == 2 and len(error.splitlines()) == 1, error
    assert "dflash_config.mask_token needs the target's tokenizer: target.tokenizer: required" in error
    assert sorted(path.name for path in tmp_path.iterdir()) == ["b", "run"]  # a, c never written
