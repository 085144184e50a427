"""The frozen target wrapper: layer taps (offset, early stop), Qwen3 and Qwen3.5 configs, sources, errors."""

import functools
import inspect
import re
import time

import pytest
import torch
from transformers import AutoConfig, Qwen3_5ForConditionalGeneration

from app.compile.warmup import AUTOTUNE_EVENT, compile_seconds
from app.config import validate_config
from app.errors import UserError
from app.model.causal_conv import CAUSAL_CONV1D, REFERENCE, TRITON, fast_causal_conv
from app.model.target import TargetModel, load_target, target_text_config
from app.pipeline.inputs import require_fast_kernels

TEXT = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
}
LINEAR_ATTENTION = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "full_attention_interval": 2,  # layers 0, 2 linear attention; 1, 3 full attention
}
MIXTURE_OF_EXPERTS = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
}
ARCHITECTURES = {
    "qwen3": {"model_type": "qwen3", **TEXT},
    "qwen3_5_text": {"model_type": "qwen3_5_text", **TEXT, **LINEAR_ATTENTION},
    "qwen3_5": {"model_type": "qwen3_5", "text_config": {**TEXT, **LINEAR_ATTENTION}},
    "qwen3_next": {"model_type": "qwen3_next", **TEXT, **LINEAR_ATTENTION, **MIXTURE_OF_EXPERTS},
}


def config_for(target, layer_ids=None, num_layers=3):
    drafter = {"num_layers": num_layers, "mask_token_id": 3}
    if layer_ids is not None:
        drafter["target_layer_ids"] = layer_ids
    return validate_config({"target": target, "drafter": drafter})


def batch(seed=0):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 128, (2, 11), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 7:] = 0  # right padding, as target batches are
    return input_ids, attention_mask


@pytest.fixture(scope="module")
def target():
    return load_target(config_for({"architecture": ARCHITECTURES["qwen3"]}, [0, 2, 3]), "cpu")


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_features_are_the_outputs_of_the_tapped_layers(architecture):
    target = load_target(config_for({"architecture": ARCHITECTURES[architecture]}, [0, 2, 3]), "cpu")
    outputs = {}
    layer = target.model.get_decoder().layers[2]
    handle = layer.register_forward_hook(lambda module, args, output: outputs.setdefault("layer 2", output))
    try:
        features = target.features(batch()[0])
    finally:
        handle.remove()
    layer_output = outputs["layer 2"][0] if isinstance(outputs["layer 2"], tuple) else outputs["layer 2"]
    hidden_states = target.model(batch()[0], output_hidden_states=True).hidden_states
    assert features.shape == (2, 11, 3 * 32) and features.dtype == torch.float32
    # HF's hidden_states[i + 1] is the output of decoder layer i (index 0 is the embeddings) ...
    torch.testing.assert_close(hidden_states[3], layer_output)
    assert not torch.allclose(hidden_states[2], layer_output)
    # ... and features are exactly those, concatenated in the configured order (the last layer included)
    torch.testing.assert_close(features, torch.cat([hidden_states[i + 1] for i in (0, 2, 3)], dim=-1))


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_right_padded_rows_need_no_mask(architecture):
    """features() runs without a padding mask (SDPA's fused causal kernel): a right-padded row's
    real tokens must come out as in HF's masked forward, for full and linear attention alike."""
    target = load_target(config_for({"architecture": ARCHITECTURES[architecture]}, [0, 2, 3]), "cpu")
    input_ids, attention_mask = batch()
    masked = target.model(input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
    expected = torch.cat([masked[i + 1] for i in (0, 2, 3)], dim=-1)
    real = attention_mask.bool()
    features = target.features(input_ids)
    torch.testing.assert_close(features[real], expected[real])
    assert not torch.allclose(features[~real], expected[~real])  # the mask did change the padding


def test_forward_stops_after_the_deepest_tapped_layer():
    target = load_target(config_for({"architecture": ARCHITECTURES["qwen3"]}, [0, 1], num_layers=2), "cpu")
    ran = []
    decoder = target.model.get_decoder()
    handles = [
        decoder.layers[2].register_forward_hook(lambda *args: ran.append("layer 2")),
        decoder.norm.register_forward_hook(lambda *args: ran.append("final norm")),
    ]
    try:
        features = target.features(batch()[0])
        assert ran == [] and features.shape == (2, 11, 64)
        target.model(*batch())  # an early stop leaves the model usable as usual
        assert ran == ["layer 2", "final norm"]
    finally:
        for handle in handles:
            handle.remove()


def test_target_is_frozen_and_exposes_what_the_drafter_borrows(target):
    assert not any(parameter.requires_grad for parameter in target.model.parameters())
    assert not target.model.training
    with torch.enable_grad():
        assert target.features(batch()[0]).grad_fn is None
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (4, 32, 128)
    assert target.layer_ids == [0, 2, 3]
    assert target.embed_tokens.weight.shape == (128, 32) and target.lm_head.weight.shape == (128, 32)
    assert target.dtype == torch.float32 and target.device.type == "cpu"


def test_random_targets_are_seeded():
    architecture = {"architecture": ARCHITECTURES["qwen3"], "seed": 7}
    first = load_target(config_for(architecture, [1]), "cpu")
    second = load_target(config_for(architecture, [1]), "cpu")
    other = load_target(config_for({**architecture, "seed": 8}, [1]), "cpu")
    pairs = zip(first.model.parameters(), second.model.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    assert not torch.equal(first.embed_tokens.weight, other.embed_tokens.weight)


def test_default_layer_ids_are_spread_over_the_target():
    six_layers = {"model_type": "qwen3", **TEXT, "num_hidden_layers": 6}
    target = load_target(config_for({"architecture": six_layers}, num_layers=2), "cpu")
    assert target.layer_ids == [1, 3]
    with pytest.raises(UserError, match=r"must not repeat a layer, got \[1, 1\] \(the default spread"):
        load_target(config_for({"architecture": ARCHITECTURES["qwen3"]}, num_layers=2), "cpu")


def test_loads_a_local_checkpoint(tmp_path, target):
    target.model.save_pretrained(tmp_path / "model")
    loaded = load_target(config_for({"path": str(tmp_path / "model")}, [0, 2, 3]), "cpu")
    torch.testing.assert_close(loaded.features(batch()[0]), target.features(batch()[0]))
    assert target_text_config(config_for({"path": str(tmp_path / "model")}).target).num_hidden_layers == 4


def test_loads_a_multimodal_qwen3_5_checkpoint_as_a_causal_lm(tmp_path):
    config = AutoConfig.for_model(
        "qwen3_5",
        text_config={**TEXT, **LINEAR_ATTENTION},
        vision_config={"depth": 1, "hidden_size": 16, "num_heads": 2, "out_hidden_size": 32},
    )
    torch.manual_seed(0)
    full = Qwen3_5ForConditionalGeneration(config).eval()
    full.save_pretrained(tmp_path / "vlm")  # weights under model.language_model.*, as Qwen3.5/3.6 ship
    loaded = load_target(config_for({"path": str(tmp_path / "vlm")}, [1, 2]), "cpu")
    with torch.no_grad():
        reference = full(batch()[0], output_hidden_states=True).hidden_states
    torch.testing.assert_close(loaded.features(batch()[0]), torch.cat([reference[2], reference[3]], dim=-1))


def test_bad_target_paths_are_one_line_user_errors(tmp_path):
    with pytest.raises(UserError, match=r"^target\.path: .*missing does not exist \(expected a local"):
        load_target(config_for({"path": str(tmp_path / "missing")}, [0]), "cpu")
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match=r"^target\.path: .*file is not a directory"):
        load_target(config_for({"path": str(tmp_path / "file")}, [0]), "cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"has no config\.json"):
        load_target(config_for({"path": str(tmp_path / "empty")}, [0]), "cpu")
    (tmp_path / "config-only").mkdir()
    AutoConfig.for_model(**ARCHITECTURES["qwen3"]).save_pretrained(tmp_path / "config-only")
    with pytest.raises(UserError, match=r"has no weights \(expected \*.safetensors"):
        load_target(config_for({"path": str(tmp_path / "config-only")}, [0]), "cpu")


def test_layer_ids_out_of_range_are_user_errors(target):
    with pytest.raises(UserError, match=r"must be non-empty and in \[0, 4\) .* got \[1, 4\]"):
        TargetModel(target.model, [1, 4])
    with pytest.raises(UserError, match=r"drafter\.target_layer_ids"):
        validate_config(
            {
                "target": {"architecture": ARCHITECTURES["qwen3"]},
                "drafter": {"mask_token_id": 3, "target_layer_ids": [9]},
            }
        )


@pytest.mark.slow  # trains the built-in target on first use (about a minute on 2 cores), cached afterwards
def test_builtin_tiny_lm_target():
    target = load_target(
        validate_config({"target": {"builtin": "tiny-lm"}, "drafter": {"num_layers": 2, "mask_token_id": 3}}),
        "cpu",
    )
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (6, 128, 2048)
    assert target.layer_ids == [1, 3]
    assert target.features(batch()[0]).shape == (2, 11, 2 * 128)


def test_a_hybrid_target_on_cuda_without_its_fast_kernels_is_refused():
    """On CUDA a Gated DeltaNet target without flash-linear-attention would train on transformers'
    reference path (one warning, then minutes per step): refused, naming what is missing and the
    install; `target.allow_slow_kernels` accepts it as a degradation. causal-conv1d is optional:
    without it the conv runs on flash-linear-attention's Triton kernel."""
    hybrid = config_for({"architecture": ARCHITECTURES["qwen3_5"]})
    cuda = torch.device("cuda")

    def kernels(fla, causal_conv1d):
        return {"fast_kernels": {"fla": fla, "causal_conv1d": causal_conv1d}}

    present, absent = {"present": True, "error": None}, {"present": False, "error": None}
    assert require_fast_kernels(hybrid, cuda, kernels(present, absent)) == []
    assert require_fast_kernels(hybrid, cuda, kernels(present, present)) == []
    neither = kernels(absent, absent)
    with pytest.raises(UserError) as refused:
        require_fast_kernels(hybrid, cuda, neither)
    message = str(refused.value)
    assert (
        "without fla (flash-linear-attention: not installed), causal_conv1d (causal-conv1d: not installed)"
        in message
    )
    assert "`./uvw sync --group gpu`" in message and message.endswith("set target.allow_slow_kernels=true")
    broken = kernels({"present": False, "error": "ImportError: libcuda.so.1"}, present)
    with pytest.raises(UserError) as refused:
        require_fast_kernels(hybrid, cuda, broken)
    assert "without fla (flash-linear-attention: ImportError: libcuda.so.1) runs" in str(refused.value)

    allowed = hybrid.model_copy(
        update={"target": hybrid.target.model_copy(update={"allow_slow_kernels": True})}
    )
    (accepted,) = require_fast_kernels(allowed, cuda, neither)
    assert accepted.endswith("(accepted by target.allow_slow_kernels)")
    assert require_fast_kernels(hybrid, torch.device("cpu"), neither) == []  # the only path on CPU
    assert require_fast_kernels(hybrid, cuda, neither, runs_target=False) == []  # a split drafter rank
    dense = config_for({"architecture": ARCHITECTURES["qwen3"]})
    assert require_fast_kernels(dense, cuda, neither) == []


def test_the_conv_kernel_is_causal_conv1d_s_else_flash_linear_attention_s_and_named_on_the_target():
    assert fast_causal_conv({"fla": True, "causal_conv1d": True}, cuda=True) == CAUSAL_CONV1D
    assert fast_causal_conv({"fla": True, "causal_conv1d": False}, cuda=True) == TRITON
    assert fast_causal_conv({"fla": False, "causal_conv1d": False}, cuda=True) is None
    assert fast_causal_conv({"fla": True, "causal_conv1d": True}, cuda=False) is None  # CUDA kernels both
    hybrid = load_target(config_for({"architecture": ARCHITECTURES["qwen3_5_text"]}, [0, 1]), "cpu")
    assert hybrid.conv_kernel == REFERENCE  # a CPU has only the reference path
    dense = load_target(config_for({"architecture": ARCHITECTURES["qwen3"]}, [0, 1]), "cpu")
    assert dense.conv_kernel is None


POSITION_WISE = {  # the compiled module kinds, how many modules, how many graphs
    # per layer: 2 norms, q and k norms, the MLP; graphs: the MLP, the norm at hidden size and at head
    # dim, RoPE
    "qwen3": ({"Qwen3RMSNorm", "Qwen3MLP"}, 4 * 5, 4),
    # + the gated norm, and the q norm over a query read in place from the gated q projection
    "qwen3_5_text": ({"Qwen3_5RMSNorm", "Qwen3_5RMSNormGated", "Qwen3_5MLP"}, 2 * 4 + 2 * 5, 6),
    # every layer's MLP is a mixture of experts, which routes tokens: left eager
    "qwen3_next": ({"Qwen3NextRMSNorm", "Qwen3NextRMSNormGated"}, 2 * 3 + 2 * 4, 5),
}


@pytest.mark.parametrize("architecture", sorted(POSITION_WISE))
def test_the_target_s_norms_mlps_and_rope_compile_once_for_every_batch_shape(architecture, monkeypatch):
    """`compile_target` puts each norm, dense MLP and RoPE under torch.compile over a dynamic token dim:
    one graph per module kind serves every batch shape, so a new shape after warm-up compiles
    nothing (the fail_on_recompile stance would raise) and the features are unchanged (a mixture of
    experts stays eager). Eval's decoding (one token at a time) runs them eagerly; outside `decoding` it would be a recompile.
    Dynamo's tracing and guards are real; only code generation is skipped (backend eager: CPU CI
    has no inductor toolchain to rely on)."""
    from torch._dynamo.utils import counters

    from app.compile.apply import compile_target
    from app.evaluate.evaluator import decoding
    from app.model.drafter import DFlashDrafter, DrafterArch

    # The same operations; fused, they may only change a reduction's order.
    same = functools.partial(torch.testing.assert_close, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch.compiler.reset()
    config = config_for({"architecture": ARCHITECTURES[architecture]}, [0, 3])
    target = load_target(config, "cpu")
    batches = [torch.randint(0, 128, shape) for shape in [(4, 64), (2, 128), (3, 96)]]
    expected = [target.features(batch) for batch in batches]
    kinds, count, graphs = POSITION_WISE[architecture]
    assert {type(module).__name__ for module in target.position_wise_modules()} == kinds
    for modeling in target.rotary_modeling_modules():  # compile_target replaces it: restored after the test
        monkeypatch.setattr(modeling, "apply_rotary_pos_emb", modeling.apply_rotary_pos_emb)
    assert compile_target(target) == count
    counters.clear()
    try:
        for batch, reference in zip(batches[:2], expected[:2], strict=True):  # warm-up: two shapes
            same(target.features(batch), reference)
        assert counters["stats"]["unique_graphs"] == graphs
        torch.compiler.set_stance("fail_on_recompile")
        same(target.features(batches[2]), expected[2])  # a new shape: nothing compiles
        assert counters["stats"]["unique_graphs"] == graphs
        one_token = torch.tensor([[5]])
        with pytest.raises(RuntimeError, match="fail_on_recompile"):
            target.model(input_ids=one_token)
        drafter = DFlashDrafter(DrafterArch.from_config(config, target), seed=0, device="cpu")
        with decoding(drafter):
            target.model(input_ids=one_token)
        assert counters["stats"]["unique_graphs"] == graphs
    finally:
        torch.compiler.set_stance("default")
        torch.compiler.reset()


def test_the_target_warm_up_says_what_each_end_and_torch_compile_cost(monkeypatch):
    """The warm-up line splits its seconds by shape end and names torch.compile's share (Dynamo's
    tracing and the graphs' loads, what a warm start still pays): there the first time, 0 once every
    graph is compiled."""
    from app.compile.apply import compile_target
    from app.compile.warmup import warm_up_target

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch.compiler.reset()
    config = config_for({"architecture": ARCHITECTURES["qwen3_5_text"]}, [0, 3])
    config = config.model_copy(
        update={"data": config.data.model_copy(update={"max_length": 96, "token_budget": 192})}
    )
    target = load_target(config, "cpu")
    for modeling in target.rotary_modeling_modules():  # compile_target replaces it: restored after the test
        monkeypatch.setattr(modeling, "apply_rotary_pos_emb", modeling.apply_rotary_pos_emb)
    compile_target(target)
    line = (
        r"target warm-up: ([\d.]+)s \(a forward at 2x96 and (\d+)x(\d+): ([\d.]+)s \+ ([\d.]+)s, "
        r"of which torch.compile ([\d.]+)s, inductor's autotuning ([\d.]+)s; "
        r"Triton: (\d+) compiled, (\d+) loaded from its cache in [\d.]+s; "
        rf"linear-attention conv on {re.escape(REFERENCE)}\)"
    )
    try:
        started = time.perf_counter()
        first = re.fullmatch(line, warm_up_target(config, target, torch.device("cpu")))
        wall = time.perf_counter() - started
        again = re.fullmatch(line, warm_up_target(config, target, torch.device("cpu")))
    finally:
        torch.compiler.reset()
    assert first and again
    assert float(first[1]) <= wall + 0.05  # the ends' seconds add up to the warm-up's, not more
    assert int(first[2]) * int(first[3]) <= 192 and int(first[3]) < 96  # the shortest shape of the set
    total, long_end, short_end, compiled = (float(first[index]) for index in (1, 4, 5, 6))
    assert abs(total - long_end - short_end) <= 0.15 and 0 < compiled <= total + 0.1
    assert float(again[6]) == 0.0
    # inductor's CPU kernels are C++ (nothing to autotune), and the reference conv is not Triton
    assert first[7] == "0.0" and first[8] == first[9] == "0"


def test_the_warm_up_reads_inductor_s_autotuning_from_the_timer_torch_s_autotuner_runs_under():
    """The autotuning figure comes from torch's own accumulator: the installed autotuner times its
    config benchmarks under this event, with a compile-metrics column (without one torch keeps no
    total), and time spent under it shows up in `compile_seconds`. A misspelt event would read 0
    forever, on the GPU too."""
    from torch._dynamo.utils import dynamo_timed
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    source = inspect.getsource(CachingAutotuner.benchmark_all_configs)
    assert f'"{AUTOTUNE_EVENT}"' in source and "dynamo_compile_column_us" in source
    compiled_before, autotuned_before = compile_seconds()
    with dynamo_timed(AUTOTUNE_EVENT, dynamo_compile_column_us="runtime_triton_autotune_time_us"):
        time.sleep(0.05)
    compiled, autotuned = compile_seconds()
    assert autotuned - autotuned_before >= 0.05 and compiled == compiled_before


def test_a_whole_model_compiled_after_compile_target_traces_transformers_own_rope(monkeypatch):
    """`compile_target` replaces transformers' `apply_rotary_pos_emb` for the whole process; a later
    whole-model graph in that process (the decode step of local regeneration, `fullgraph`) traces
    through it. There the replacement steps aside for transformers' own function: marking a dim
    dynamic inside a trace is an error, and the enclosing graph fuses RoPE itself."""
    from app.compile.apply import compile_target

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch.compiler.reset()
    target = load_target(config_for({"architecture": ARCHITECTURES["qwen3"]}, [0, 3]), "cpu")
    for modeling in target.rotary_modeling_modules():  # compile_target replaces it: restored after the test
        monkeypatch.setattr(modeling, "apply_rotary_pos_emb", modeling.apply_rotary_pos_emb)
    compile_target(target)
    input_ids = batch()[0]
    try:
        with torch.no_grad():
            eager = target.model(input_ids=input_ids).logits
            whole = torch.compile(target.model, fullgraph=True, dynamic=False)(input_ids=input_ids).logits
        torch.testing.assert_close(whole, eager, rtol=1e-5, atol=1e-5)
    finally:
        torch.compiler.reset()
