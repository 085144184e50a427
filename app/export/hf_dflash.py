"""The Hugging Face DFlash draft-model directory that SGLang (`--speculative-algorithm DFLASH`) and
vLLM (`method: dflash`) load: `config.json` + `model.safetensors`, drafter weights only.

What the loaders read, checked against the published source of SGLang 0.5.11, 0.5.19 and 0.5.23
(`speculative/dflash_utils.py`, `models/dflash.py`) and vLLM 0.20.0 and 0.34.0
(`models/qwen3_dflash.py`, the aux-layer and mask-token lookups); docs/guide.md section 7 has the table:

- `architectures: ["DFlashDraftModel"]` with `model_type: "qwen3"`: the draft config is parsed as a
  Qwen3 config, so every Qwen3 field the layers need is written (sizes, heads, head_dim, eps,
  RoPE base both as `rope_theta` and transformers 5's `rope_parameters`, `hidden_act: silu`).
- `dflash_config: {mask_token_id, mask_token, target_layer_ids, block_size}`: written explicitly.
  Without them the engines fall back to guesses (the string `<|MASK|>`, layer ids spread by their own
  rule, block size 16) and silently lose acceptance. `mask_token` is the id's string in the target's
  tokenizer (`mask_token.py` says why SGLang needs it). `block_size` and `num_target_layers` are also
  top-level (SGLang 0.5.11 checks the layer ids against `num_target_layers`, without it against
  the drafter's own depth, and refuses). `target_hidden_size` sizes vLLM's `fc`.
- `eagle_aux_hidden_state_layer_ids`: vLLM reads this key before `dflash_config` and uses it as its
  capture index, the residual stream *entering* layer L, so it holds `target_layer_ids + 1` (the
  outputs of the tapped layers). vLLM 0.20.0 read `dflash_config.target_layer_ids` as that
  index (one layer early; 0.34.0 adds the 1): with the key, both tap the layers the drafter was
  trained on.
- `layer_types` (+ `sliding_window`): full-attention draft layers are bidirectional inside the
  block, sliding ones causal; SGLang (from 0.5.19 of those read) and vLLM 0.34.0 derive that from
  these two fields, SGLang 0.5.11 and vLLM 0.20.0 ignore them and run every layer bidirectional.
- weights: `fc.weight`, `hidden_norm.weight`, `layers.N.self_attn.{q,k,v,o}_proj.weight`,
  `layers.N.self_attn.{q,k}_norm.weight`, `layers.N.mlp.{gate,up,down}_proj.weight`,
  `layers.N.{input,post_attention}_layernorm.weight`, `norm.weight`. No embedding, no LM head:
  the engines use the target's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import PretrainedConfig

from app.atomic import fsync_tree, replace_directory, staging_directory
from app.errors import UserError
from app.export.mask_token import mask_token_string, tokenizer_beside
from app.model.drafter import DFlashDrafter, DrafterArch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ExportDtype = Literal["bf16", "fp32"]
EXPORT_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32}
HF_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
ARCHITECTURE = "DFlashDraftModel"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
DEFAULT_MAX_POSITIONS = 32768
"""`max_position_embeddings` when the target's config has none (engines size RoPE tables with it)."""


def export_config(
    arch: DrafterArch, target: PretrainedConfig, dtype: torch.dtype, mask_token: str
) -> dict[str, Any]:
    """The draft model's `config.json` content; `mask_token` is `arch.mask_token_id`'s string in the
    target's tokenizer (`mask_token_string`)."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": arch.hidden_size,
        "target_hidden_size": arch.target_hidden_size,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads,
        "head_dim": arch.head_dim,
        "intermediate_size": arch.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": arch.rope_theta},
        "max_position_embeddings": int(
            getattr(target, "max_position_embeddings", None) or DEFAULT_MAX_POSITIONS
        ),
        "vocab_size": arch.vocab_size,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "layer_types": [
            "sliding_attention" if arch.layer_window(layer) is not None else "full_attention"
            for layer in range(arch.num_layers)
        ],
        "use_sliding_window": bool(arch.sliding_window_layers),
        "sliding_window": arch.sliding_window if arch.sliding_window_layers else None,
        "torch_dtype": HF_DTYPE_NAMES[dtype],
        "dtype": HF_DTYPE_NAMES[dtype],
        "block_size": arch.block_size,
        "num_target_layers": arch.num_target_layers,
        "dflash_config": {
            "mask_token_id": arch.mask_token_id,
            "mask_token": mask_token,
            "target_layer_ids": list(arch.target_layer_ids),
            "block_size": arch.block_size,
        },
        # vLLM's capture index (the stream entering layer L, read before dflash_config): the tapped
        # layers' outputs are L = id + 1. vLLM 0.20.0 took dflash_config's ids as L, one layer early.
        "eagle_aux_hidden_state_layer_ids": [layer + 1 for layer in arch.target_layer_ids],
    }


def serving_commands(target: str, export_dir: Path, block_size: int) -> list[str]:
    """How to serve `target` with this export as its DFlash draft: SGLang's block is the draft token
    count; vLLM drafts `num_speculative_tokens` = block_size - 1 after the anchor token."""
    vllm_config = json.dumps(
        {"method": "dflash", "model": str(export_dir), "num_speculative_tokens": block_size - 1}
    )
    return [
        f"SGLang: python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path {export_dir} --speculative-num-draft-tokens {block_size}",
        f"vLLM:   vllm serve {target} --speculative-config '{vllm_config}'",
    ]


def export_drafter(
    drafter: DFlashDrafter,
    out_dir: str | Path,
    target: PretrainedConfig,
    dtype: ExportDtype = "bf16",
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> Path:
    """Write the drafter as an HF DFlash directory at `out_dir`, atomically; returns `out_dir`.

    `target` is the target's (text) config: the export refuses a drafter that does not fit it.
    `tokenizer` is the target's, which names the mask token (`dflash_config.mask_token`); None loads
    the one beside the target's config (`name_or_path`, set when the target was loaded from a
    directory) and refuses where there is none. An existing earlier export at `out_dir` is replaced;
    any other non-empty directory is refused.
    """
    if dtype not in EXPORT_DTYPES:
        raise UserError(f"export: dtype must be one of {sorted(EXPORT_DTYPES)}, got {dtype!r}")
    torch_dtype = EXPORT_DTYPES[dtype]
    check_fits_target(drafter.arch, target.get_text_config())
    if tokenizer is None:  # not `or`: a tokenizer has a length, and an empty one is falsy
        tokenizer = tokenizer_beside(target)
    mask_token = mask_token_string(tokenizer, drafter.arch.mask_token_id)
    weights = {
        name: tensor.detach().to("cpu", torch_dtype).contiguous()
        for name, tensor in drafter.state_dict().items()
    }
    broken = [name for name, tensor in weights.items() if not torch.isfinite(tensor).all()]
    if broken:
        raise UserError(
            f"export: drafter weights {broken[:3]} hold NaN or inf values: this checkpoint is broken"
        )

    out_dir = Path(out_dir)
    _check_replaceable(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_directory(out_dir)
    try:
        config = export_config(drafter.arch, target.get_text_config(), torch_dtype, mask_token)
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        save_file(weights, staging / WEIGHTS_FILE, metadata={"format": "pt"})
        fsync_tree(staging)
        replace_directory(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def check_fits_target(arch: DrafterArch, target: PretrainedConfig) -> None:
    """One-line `UserError` when the drafter's mask token, layer taps or sizes do not fit the target."""
    vocab, layers, hidden = target.vocab_size, target.num_hidden_layers, target.hidden_size
    if not 0 <= arch.mask_token_id < vocab:
        raise UserError(
            f"export: dflash_config.mask_token_id {arch.mask_token_id} is not a row of the target embedding "
            f"(vocab_size {vocab})"
        )
    bad = [layer for layer in arch.target_layer_ids if not 0 <= layer < layers]
    if bad:
        raise UserError(
            f"export: dflash_config.target_layer_ids {bad} are out of range for the {layers}-layer target"
        )
    if arch.num_target_layers != layers or arch.target_hidden_size != hidden or arch.vocab_size != vocab:
        raise UserError(
            f"export: the drafter was built for a target of {arch.num_target_layers} layers, hidden size "
            f"{arch.target_hidden_size}, vocab {arch.vocab_size}; the target has {layers}, {hidden}, {vocab}"
        )


def load_exported(
    directory: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> DFlashDrafter:
    """A drafter from an exported directory, on `device`, in `dtype` (None: the stored dtype)."""
    directory = Path(directory)
    config_file, weights_file = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for file in (config_file, weights_file):
        if not file.is_file():
            raise UserError(f"{directory}: not a DFlash export (missing {file.name})")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise UserError(f"{config_file}: not readable JSON ({error})") from None
    arch = arch_from_export_config(config, str(config_file))
    try:
        weights = load_file(weights_file)
    except (SafetensorError, OSError) as error:
        raise UserError(f"{weights_file}: not a readable safetensors file ({error})") from None
    with torch.device("meta"):
        drafter = DFlashDrafter(arch)
    _check_weight_names(drafter, weights, weights_file)
    try:
        drafter.load_state_dict(weights, assign=True)
    except RuntimeError as error:  # shape mismatches
        raise UserError(
            f"{weights_file}: weights do not fit {config_file} ({str(error).splitlines()[-1].strip()})"
        ) from None
    return drafter.to(device=device, dtype=dtype)


def arch_from_export_config(config: dict[str, Any], source: str) -> DrafterArch:
    """The `DrafterArch` described by an exported `config.json`."""
    if config.get("architectures") != [ARCHITECTURE]:
        raise UserError(
            f"{source}: architectures must be [{ARCHITECTURE!r}], got {config.get('architectures')!r}"
        )
    dflash = config.get("dflash_config")
    if not isinstance(dflash, dict):
        raise UserError(
            f"{source}: dflash_config is missing (it must give mask_token_id and target_layer_ids)"
        )
    fields = {
        "hidden_size": config.get("hidden_size"),
        "num_layers": config.get("num_hidden_layers"),
        "num_attention_heads": config.get("num_attention_heads"),
        "num_key_value_heads": config.get("num_key_value_heads"),
        "head_dim": config.get("head_dim"),
        "intermediate_size": config.get("intermediate_size"),
        "rms_norm_eps": config.get("rms_norm_eps"),
        "rope_theta": config.get("rope_theta"),
        "block_size": dflash.get("block_size", config.get("block_size")),
        "mask_token_id": dflash.get("mask_token_id"),
        "target_layer_ids": dflash.get("target_layer_ids"),
        "num_target_layers": config.get("num_target_layers"),
        "target_hidden_size": config.get("target_hidden_size", config.get("hidden_size")),
        "vocab_size": config.get("vocab_size"),
    }
    missing = [name for name, value in fields.items() if value is None]
    if missing:
        raise UserError(f"{source}: missing fields {missing}")
    layer_types = config.get("layer_types") or ["full_attention"] * fields["num_layers"]
    sliding = tuple(index for index, kind in enumerate(layer_types) if kind == "sliding_attention")
    return DrafterArch(
        **{**fields, "target_layer_ids": tuple(fields["target_layer_ids"])},
        sliding_window=config.get("sliding_window") if sliding else None,
        sliding_window_layers=sliding,
    )


def _check_weight_names(drafter: DFlashDrafter, weights: dict[str, torch.Tensor], source: Path) -> None:
    expected, found = set(drafter.state_dict()), set(weights)
    if expected != found:
        missing, unexpected = sorted(expected - found), sorted(found - expected)
        raise UserError(
            f"{source}: weight names differ from the DFlash layout: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )


def _check_replaceable(out_dir: Path) -> None:
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise UserError(f"--out: {out_dir} exists and is not a directory")
    if any(out_dir.iterdir()) and not _is_export(out_dir):
        raise UserError(
            f"--out: {out_dir} is a non-empty directory that is not a DFlash export; refusing to replace it"
        )


def _is_export(directory: Path) -> bool:
    try:
        return json.loads((directory / CONFIG_FILE).read_text()).get("architectures") == [ARCHITECTURE]
    except (OSError, json.JSONDecodeError, AttributeError):
        return False
