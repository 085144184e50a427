"""The frozen target LLM: any HF causal LM, and the hidden states of its K configured layers.

Three sources (`target.path`, `target.architecture`, `target.builtin`), one wrapper. The wrapper is
frozen and in eval mode; `features()` returns the outputs of the configured decoder layers
concatenated, which is what the drafter reads (HF `hidden_states[i+1]` for layer `i`). Only those
K layers' outputs are kept, and the forward stops after the deepest one: the layers above it, the
final norm and the LM head never run for features.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from app.config import default_target_layer_ids
from app.config.builtins import BUILTIN_TARGETS
from app.config.schema import DrafterConfig, RunConfig, TargetConfig
from app.errors import UserError
from app.model.causal_conv import use_fast_causal_conv
from app.model.gated_deltanet import use_copy_free_gated_deltanet

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "model.safetensors.index.json")


def target_text_config(target: TargetConfig) -> PretrainedConfig:
    """The target's language-model config (HF defaults filled in), without loading any weights."""
    if target.path is not None:
        path = _checked_model_dir(Path(target.path), need_weights=False)
        try:
            config = AutoConfig.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, KeyError) as error:
            raise UserError(
                f"target.path: {path}/config.json: not a loadable model config ({_first_line(error)})"
            ) from None
    else:
        architecture = BUILTIN_TARGETS[target.builtin] if target.builtin else target.architecture
        config = _config_from_architecture(
            architecture, "target.architecture" if target.architecture else "builtin"
        )
    return config.get_text_config()


def resolve_layer_ids(drafter: DrafterConfig, num_target_layers: int) -> list[int]:
    """The target layers the drafter reads: configured, or spread evenly
    (docs/architecture.md, DFlash model and objective)."""
    layer_ids = drafter.target_layer_ids or default_target_layer_ids(num_target_layers, drafter.num_layers)
    bad = [i for i in layer_ids if not 0 <= i < num_target_layers]
    if bad:
        raise UserError(
            f"drafter.target_layer_ids: must be in [0, {num_target_layers}) for a {num_target_layers}-layer "
            f"target, got {bad}"
        )
    if len(set(layer_ids)) != len(layer_ids):
        hint = (
            f" (the default spread for a {num_target_layers}-layer target; set drafter.target_layer_ids)"
            if drafter.target_layer_ids is None
            else ""
        )
        raise UserError(f"drafter.target_layer_ids: must not repeat a layer, got {layer_ids}{hint}")
    return list(layer_ids)


def is_hybrid(text_config: PretrainedConfig) -> bool:
    """A hybrid target (Qwen3.5/3.6, Qwen3-Next): linear-attention (Gated DeltaNet) layers between
    full-attention ones, whose fast path is flash-linear-attention's and causal-conv1d's kernels."""
    layer_types = getattr(text_config, "layer_types", None) or []
    return any("linear" in str(kind) for kind in layer_types)


def target_dtype(target: TargetConfig, device: torch.device) -> torch.dtype:
    """bf16 on GPU (per `target.dtype`); fp32 on CPU, where bf16 matmuls are slow and imprecise."""
    return torch.bfloat16 if device.type == "cuda" and target.dtype == "bf16" else torch.float32


def load_target(config: RunConfig, device: torch.device | str) -> TargetModel:
    """Build the configured target on `device`: frozen, eval mode, ready for `features()`."""
    device = torch.device(device)
    target = config.target
    dtype = target_dtype(target, device)
    if target.path is not None:
        model = _load_pretrained(_checked_model_dir(Path(target.path), need_weights=True), device, dtype)
    elif target.builtin is not None:
        from app.model.builtin import builtin_target_dir  # built or converted on first use

        model = _load_pretrained(builtin_target_dir(target.builtin), device, dtype)
    else:
        model = _random_model(target, device, dtype)
    layer_ids = resolve_layer_ids(config.drafter, model.config.get_text_config().num_hidden_layers)
    conv_kernel = use_fast_causal_conv(model, device)
    use_copy_free_gated_deltanet(model)
    return TargetModel(model, layer_ids, conv_kernel)


class TargetModel:
    """A frozen HF causal LM plus the layer taps the drafter needs.

    `model` is the HF model itself (eval's speculative decoding calls it with a KV cache);
    `embed_tokens` and `lm_head` are its frozen embedding and output head, which the drafter borrows.
    """

    def __init__(self, model: PreTrainedModel, layer_ids: list[int], conv_kernel: str | None = None):
        self.model = model.eval().requires_grad_(False)
        self.conv_kernel = conv_kernel
        """What the linear-attention layers' causal conv runs on (`app.model.causal_conv`); None
        when the target has none."""
        self.text_config: PretrainedConfig = model.config.get_text_config()
        self._decoder = model.get_decoder()
        decoder_layers = getattr(self._decoder, "layers", None)
        if not isinstance(decoder_layers, nn.ModuleList):
            raise UserError(
                f"target: {type(model).__name__} has no decoder `layers` list to read hidden states from"
            )
        self._layers = decoder_layers
        self.num_layers = len(decoder_layers)
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad or not layer_ids:
            raise UserError(
                f"drafter.target_layer_ids: must be non-empty and in [0, {self.num_layers}) for this "
                f"{self.num_layers}-layer target, got {layer_ids}"
            )
        self.layer_ids = list(layer_ids)
        self.hidden_size: int = self.text_config.hidden_size
        self.vocab_size: int = self.text_config.vocab_size
        self.embed_tokens: nn.Embedding = model.get_input_embeddings()
        self.lm_head: nn.Linear = model.get_output_embeddings()

    @property
    def layers_run(self) -> list[nn.Module]:
        """The decoder layers `features()` runs: up to the deepest tapped one."""
        return list(self._layers[: max(self.layer_ids) + 1])

    def position_wise_modules(self) -> list[nn.Module]:
        """The modules of `layers_run` that act on each token alone, which `app.compile.apply.compile_target`
        compiles: every RMSNorm-like norm (a class named `...RMSNorm` or `...RMSNormGated`, as in HF's
        Llama and Qwen families) and each layer's dense MLP (`layer.mlp` of a class named `...MLP`; a
        mixture-of-experts block routes tokens, so it is left as it is)."""
        found: list[nn.Module] = []
        for layer in self.layers_run:
            found += [m for m in layer.modules() if type(m).__name__.endswith(("RMSNorm", "RMSNormGated"))]
            mlp = getattr(layer, "mlp", None)
            if mlp is not None and type(mlp).__name__.endswith("MLP"):
                found.append(mlp)
        return found

    def rotary_modeling_modules(self) -> list[ModuleType]:
        """The transformers modeling modules whose `apply_rotary_pos_emb` the attention layers of
        `layers_run` call (looked up in the module at each call, so a compiled one can take its place)."""
        found = {
            sys.modules[type(attention).__module__]
            for layer in self.layers_run
            if (attention := getattr(layer, "self_attn", None)) is not None
        }
        return sorted((m for m in found if hasattr(m, "apply_rotary_pos_emb")), key=lambda m: m.__name__)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, final_hidden: bool = False) -> torch.Tensor:
        """Outputs of the K configured layers, concatenated: `[b, L] -> [b, L, K*H]` in the target's dtype;
        with `final_hidden`, `[b, L, (K+1)*H]`: the whole decoder runs and its final-normed output comes
        last (what the LM head reads: the target's own next-token distribution, `train.soft_targets`).

        Rows are right-padded (as target batches are). The forward runs without an attention mask:
        under causal attention a real token never sees the padding to its right, so the real
        positions come out the same, and SDPA takes its fused causal kernel instead of a masked one
        (a padding mask cost 10% of the forward on an H200). Padding positions hold whatever the
        model computes there; callers keep only real tokens.
        """
        captured: dict[int, torch.Tensor] = {}
        deepest = max(self.layer_ids)
        # HF replaces the last layer's hidden state by the final-normed one; mirror that if it is tapped.
        final_norm = getattr(self._decoder, "norm", None) if deepest == self.num_layers - 1 else None

        def capture(layer_id: int):
            def hook(module: nn.Module, args: Any, output: Any) -> None:
                hidden = output[0] if isinstance(output, tuple) else output
                captured[layer_id] = (
                    final_norm(hidden) if final_norm is not None and layer_id == deepest else hidden
                )
                if layer_id == deepest and not final_hidden:
                    raise _DeepestLayerReached

            return hook

        handles = [self._layers[i].register_forward_hook(capture(i)) for i in set(self.layer_ids)]
        final: list[torch.Tensor] = []
        try:
            final.append(self._decoder(input_ids=input_ids, use_cache=False).last_hidden_state)
        except _DeepestLayerReached:
            pass
        finally:
            for handle in handles:
                handle.remove()
        return torch.cat([captured[i] for i in self.layer_ids] + final, dim=-1)


class _DeepestLayerReached(Exception):
    """Raised by the deepest tapped layer's hook: nothing above it is needed for features."""


def local_directory(path: str | Path, key: str, expected: str) -> Path:
    """The directory the config's `key` names, which must exist here: nothing is downloaded, so a path
    that is not there is a one-line error naming the key, not a hub repo-id error from a loader."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{key}: {path} does not exist (expected {expected})")
    if not path.is_dir():
        raise UserError(f"{key}: {path} is not a directory (expected {expected})")
    return path


def _checked_model_dir(path: Path, need_weights: bool) -> Path:
    local_directory(path, "target.path", "a local Hugging Face model directory")
    if not (path / "config.json").is_file():
        raise UserError(f"target.path: {path} has no config.json (expected a Hugging Face model directory)")
    if need_weights and not any(next(path.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        raise UserError(f"target.path: {path} has no weights (expected *.safetensors or pytorch_model*.bin)")
    return path


def _load_pretrained(path: Path, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    try:
        return AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=dtype, device_map={"": device}
        )
    except (OSError, ValueError, KeyError) as error:
        raise UserError(f"target.path: {path}: could not load the model ({_first_line(error)})") from None


def _random_model(target: TargetConfig, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    config = _config_from_architecture(target.architecture, "target.architecture")
    # The same seed on every rank gives every rank the same weights; fork_rng keeps the caller's RNG intact.
    rng_devices = (
        [device.index if device.index is not None else torch.cuda.current_device()]
        if device.type == "cuda"
        else []
    )
    with torch.random.fork_rng(devices=rng_devices, device_type=device.type), torch.device(device):
        torch.manual_seed(target.seed)
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _config_from_architecture(architecture: dict[str, Any], where: str) -> PretrainedConfig:
    fields = dict(architecture)
    model_type = fields.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except (ValueError, TypeError, KeyError) as error:
        raise UserError(f"{where}: cannot build a {model_type!r} config ({_first_line(error)})") from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
