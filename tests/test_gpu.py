"""The GPU tier: what exists only on CUDA. CI has no GPU and deselects it; run it on a GPU machine with
`just test-gpu` (pytest -m gpu)."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from app.bench.target import format_report, run_target_bench
from app.compile.apply import compile_drafter, compile_target, compiled_flex_attention, reset_compiled_state
from app.compile.artifacts import list_entries
from app.compile.build import build_cache
from app.compile.guard import RecompileError, enter_steady_state, recompile_errors
from app.compile.key import cache_key, machine_fields
from app.compile.library_jit import LibraryJitCounter
from app.compile.warmup import random_target_batch, synthetic_batches, warm_up_logits, warm_up_target
from app.config import validate_config
from app.data.shapes import TargetShapes
from app.data.synthetic import synthetic_row
from app.model.attention import UncompiledKernelOnCudaError, training_attention
from app.model.causal_conv import CAUSAL_CONV1D, TRITON, triton_causal_conv1d_fn
from app.model.ce_kernel import triton_ce_chunk
from app.model.drafter import DFlashDrafter, DrafterArch
from app.model.flops import forward_flops, step_flops
from app.model.objective import chunked_lm_head_ce
from app.model.target import load_target
from app.telemetry.hardware import datasheet_peak
from app.train.metrics import NonFiniteLoss
from app.train.step import BorrowedHeads, DrafterStep
from app.train.trainer import Trainer
from tests.helpers import (
    SMALL_VOCAB,
    random_target_config,
    random_tiny_lm_architecture,
    run_dflash,
    small_drafter_raw_config,
)
from tests.jobs import ROOT, child_environment

pytestmark = pytest.mark.gpu
# The tier tests kernels, not the environment (the guard has its own tests): a GPU machine's torch
# build need not be the lock's, so its runs are let through, recorded as DEGRADED.
ON_ANY_STACK = {"allow_environment_drift": True}

# Two GPU models of one compute capability (9.0): a cache tuned on one is wrong for the other.
SAME_CAPABILITY = {"NVIDIA H200": "NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3": "NVIDIA H200"}


@pytest.fixture(autouse=True)
def a_gpu_is_required():
    if not torch.cuda.is_available():
        pytest.fail("the gpu tier needs a CUDA GPU (CI deselects it; run `just test-gpu` on a GPU machine)")
    yield
    torch.compiler.set_stance("default")  # a test's steady state must not leak into the next


def test_the_compile_key_names_the_gpu_model_not_only_its_capability():
    fields = machine_fields(torch.device("cuda"))
    name = torch.cuda.get_device_name()
    major, minor = torch.cuda.get_device_capability()
    assert fields["machine.gpu"] == name
    assert fields["machine.compute_capability"] == f"{major}.{minor}"
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    key = cache_key(fields)
    assert key.startswith(f"{slug}-sm{major}{minor}-"), key
    sibling = SAME_CAPABILITY.get(name, "NVIDIA H200")
    assert cache_key({**fields, "machine.gpu": sibling}) != key


def test_training_compiles_once_then_a_new_shape_is_refused(
    tiny_tokenizer_dir, tiny_conversations, tmp_path: Path, persistent_tmp: Path
) -> None:
    """A CUDA run compiles the drafter at warm-up, trains its steps without a recompile (one would
    raise), and stays in the fail_on_recompile stance: another row shape is an error, not a compile.
    It starts from a forgotten compiled state: dynamo reuses the drafter graphs an earlier test of this
    process compiled (tests/test_gpu_loop.py's runs), and the warm-up then reads 0 misses."""
    reset_compiled_state()
    config = random_target_config(
        tiny_tokenizer_dir,
        tiny_conversations,
        tmp_path / "run",
        device="cuda",
        precision="bf16",
        max_steps=6,
        eval_every=0,
        **ON_ANY_STACK,
    )
    config.compile.cache_dir = str(persistent_tmp / "compile_cache")
    config.compile.inductor_dir = str(persistent_tmp / "inductor")
    lines: list[str] = []
    trainer = Trainer(config, log=lines.append)
    report = trainer.compile_report
    assert report.compiled and report.key is not None and report.key.startswith("nvidia-")
    assert report.warmup_counters.misses > 0  # an empty cache: warm-up compiled
    assert any(line.startswith("compile warm-up:") for line in lines)

    result = trainer.run()
    assert result.steps == 6 and all(torch.isfinite(torch.tensor(result.losses)))
    # a colocated GPU run: its memory, and its mfu against this GPU's datasheet peak when one is known
    last = [line for line in lines if line.startswith("[")][-1]
    assert " step=6/6 " in last and " mem=" in last and "q_pre" not in last
    assert (" mfu=" in last) == (datasheet_peak(torch.cuda.get_device_name()) is not None), last

    other = config.model_copy(deep=True)
    other.data.token_budget = config.data.token_budget // 2
    (batch,) = synthetic_batches(other, trainer.drafter, trainer.device, 1)
    with pytest.raises(RecompileError, match="recompile after warm-up"):
        trainer.drafter_step.backward(batch)


@pytest.mark.parametrize("window", [None, 9])
def test_the_compiled_flex_of_training_equals_the_dense_rule_on_rows_with_unused_slots(window) -> None:
    """Training's compiled flex on a row with padding, unused anchor slots (their queries see
    nothing), several documents and query rows that fill no whole tile: output and gradients finite,
    equal to the CPU's dense SDPA, the unused slots' rows zero. flex's ROWS_GUARANTEED_SAFE would
    break this (such rows come out NaN); with it the bench's step looked 3% faster, which was the
    GPU's power cap running NaN-filled matmuls faster (BENCHMARKS.md)."""
    generator = torch.Generator().manual_seed(2)
    row = synthetic_row(256, 40, 97, num_documents=4, padding=30, valid_anchors=29, generator=generator)
    block = 4
    shapes = ((1, 4, 40 * block, 64), (1, 2, 256 + 40 * block, 64), (1, 2, 256 + 40 * block, 64))
    inputs = [torch.randn(shape, generator=generator) for shape in shapes]
    weight = torch.randn(shapes[0], generator=generator)
    results = []
    for device, options in (
        ("cuda", {"flex_kernel": compiled_flex_attention()}),
        ("cpu", {"backend": "dense"}),
    ):
        attend = training_attention(row.to(device), block, {window}, **options)[window]
        leaves = [tensor.to(device).requires_grad_() for tensor in inputs]
        output = attend(*leaves)
        (output * weight.to(device)).sum().backward()
        results.append([tensor.cpu() for tensor in (output.detach(), *(leaf.grad for leaf in leaves))])
    for got, expected in zip(*results, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected, rtol=2e-3, atol=2e-3)
    assert not results[0][0][:, :, 29 * block :].any()


def test_an_uncompiled_drafter_refuses_to_train_on_cuda():
    """No quiet eager fallback on a GPU: without `compile_drafter`, the training attention and the
    loss's CE chunk both refuse; after it, the same step runs."""
    config = validate_config(small_drafter_raw_config())
    arch = DrafterArch.from_config(config)
    drafter = DFlashDrafter(arch, device="cuda")
    embed_tokens = torch.nn.Embedding(arch.vocab_size, arch.hidden_size, device="cuda").requires_grad_(False)
    lm_head = torch.nn.Linear(arch.hidden_size, arch.vocab_size, bias=False, device="cuda").requires_grad_(
        False
    )
    step = DrafterStep(config, drafter, BorrowedHeads(embed_tokens, lm_head), torch.device("cuda"))
    (batch,) = synthetic_batches(config, drafter, step.device, 1)
    with pytest.raises(UncompiledKernelOnCudaError, match="flex_attention is not compiled"):
        step.backward(batch)
    with pytest.raises(UncompiledKernelOnCudaError, match="cross-entropy chunk has no CUDA kernel"):
        chunked_lm_head_ce(
            torch.zeros(2, 3, arch.hidden_size, device="cuda"),
            lm_head,
            torch.zeros(2, 3, dtype=torch.long, device="cuda"),
            torch.ones(2, 3, device="cuda"),
            chunk_size=1,
        )
    compile_drafter(drafter)
    assert torch.isfinite(step.backward(batch).loss)


def test_build_cache_then_a_fresh_process_starts_warm(
    tiny_tokenizer_dir, tiny_conversations, tmp_path: Path, persistent_tmp: Path
) -> None:
    """`dflash build-cache` bakes what the run's step compiles and its step time; `dflash train` in a
    fresh process loads it and compiles nothing (every inductor and autograd lookup a hit). The
    build runs in this process after earlier tests compiled drafters of the same shapes: it must
    still record every artifact (5 inductor misses before build-cache reset the compiled state)."""
    config = random_target_config(
        tiny_tokenizer_dir, tiny_conversations, tmp_path / "run", device="cuda", precision="bf16", max_steps=3,
        **ON_ANY_STACK,
    )  # fmt: skip
    config.compile.cache_dir = str(persistent_tmp / "compile_cache")
    config.compile.inductor_dir = str(persistent_tmp / "inductor")
    config.compile.on_cache_miss = "abort"
    result = build_cache(config, DrafterStep, log=lambda line: None)
    assert result.built and result.entry.manifest["measured"]["drafter_step_s"] > 0
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))

    done = run_dflash("train", str(config_file), timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    warm_up = next(line for line in done.stdout.splitlines() if line.startswith("compile warm-up:"))
    hits = re.search(r"inductor hit/miss/bypass (\d+)/0/0, autograd hit/miss/bypass (\d+)/0/0", warm_up)
    assert hits and int(hits.group(1)) > 0 and int(hits.group(2)) > 0, warm_up
    seconds = re.match(r"compile warm-up: ([\d.]+)s \(of which torch\.compile ([\d.]+)s; ", warm_up)
    assert seconds and 0 < float(seconds.group(2)) <= float(seconds.group(1)) + 0.1, warm_up
    assert re.search(r"; Triton: 0 compiled, [1-9]\d* loaded from its cache", warm_up), (
        warm_up
    )  # the CE kernel, baked
    assert f"compile cache: loaded {result.entry.key}" in done.stdout


@pytest.mark.parametrize(
    ("head_dtype", "precision", "logits_dtype"),
    [(torch.float32, "bf16", torch.bfloat16), (torch.bfloat16, "fp32", torch.bfloat16), (torch.float32, "fp32", torch.float32)],
)  # fmt: skip
def test_build_cache_warms_the_ce_kernel_up_on_the_loss_s_logits(head_dtype, precision, logits_dtype) -> None:
    """Triton compiles the CE kernel per logits dtype: build-cache's warm-up makes its logits as the
    loss does (the head under the step's autocast), so an fp32 target trained in bf16 bakes the bf16
    kernel its run calls, not an fp32 one."""
    raw = small_drafter_raw_config()
    config = validate_config({**raw, "train": {**raw["train"], "device": "cuda", "precision": precision}})
    lm_head = torch.nn.Linear(32, SMALL_VOCAB, bias=False, device="cuda", dtype=head_dtype)
    logits = warm_up_logits(config, lm_head)
    assert logits.dtype == logits_dtype and logits.shape == (1, SMALL_VOCAB)


@pytest.mark.parametrize("vocab", [151_936, 248_320])
def test_the_loss_s_ce_kernel_equals_cross_entropy_at_the_production_chunks(vocab) -> None:
    """At the Qwen3-8B recipe's chunk (128 anchors x 15 slots) and at the 27B layout's vocab, the CE
    chunk a compiled drafter trains with is the Triton kernel, and it equals cross_entropy: the
    weighted loss, the gradient (written over the logits) and an argmax at each row's maximum."""
    drafter = DFlashDrafter(
        DrafterArch.from_config(validate_config(small_drafter_raw_config())), device="cuda"
    )
    compile_drafter(drafter)
    assert drafter.kernels.ce_chunk is triton_ce_chunk
    generator = torch.Generator("cuda").manual_seed(0)
    rows = 128 * 15
    logits = (4 * torch.randn(rows, vocab, device="cuda", generator=generator)).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (rows,), device="cuda", generator=generator)
    weights = torch.rand(rows, device="cuda", generator=generator) * (
        torch.arange(rows, device="cuda") % 5 > 0
    )
    reference = logits.float().requires_grad_()
    expected = (F.cross_entropy(reference, labels, reduction="none") * weights).sum()
    expected.backward()
    loss, grad, predictions = triton_ce_chunk(logits.clone(), labels, weights)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(grad.float(), reference.grad, rtol=1e-2, atol=1e-7)
    assert torch.equal(logits.float().gather(-1, predictions[:, None]).squeeze(-1), logits.float().amax(-1))


def test_counting_a_step_s_flops_does_not_synchronise_with_the_host() -> None:
    """The trainer counts every micro-batch's FLOPs for the log line's mfu: on the device, no host sync."""
    arch = DrafterArch.from_config(validate_config(small_drafter_raw_config()))
    row = synthetic_row(128, 16, SMALL_VOCAB, num_documents=3, padding=9, valid_anchors=13)
    on_device = row.to("cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        flops = step_flops(forward_flops(arch, on_device))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert flops.device.type == "cuda" and int(flops) == int(step_flops(forward_flops(arch, row)))


def test_two_runs_of_one_seed_train_bit_identical_drafters(
    tiny_tokenizer_dir, tiny_conversations, tmp_path: Path, persistent_tmp: Path
) -> None:
    """The same seed gives the same drafter on one machine, to the last bit: flex attention's backward,
    the Triton CE chunk and the fused AdamW add in a fixed order (an atomic add in any of them would
    make two runs differ, and with them every tau measured to compare objectives or recipes)."""

    def train(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
        # the first run's steady state (fail_on_recompile) must not refuse the second run's warm-up
        torch.compiler.set_stance("default")
        config = random_target_config(
            tiny_tokenizer_dir, tiny_conversations, tmp_path / name, device="cuda", precision="bf16",
            max_steps=8, eval_every=0, **ON_ANY_STACK,
        )  # fmt: skip
        config.compile.cache_dir = str(persistent_tmp / "compile_cache")
        config.compile.inductor_dir = str(persistent_tmp / "inductor")
        trainer = Trainer(config, log=lambda line: None)
        losses = trainer.run().losses
        return losses, {key: value.detach().clone() for key, value in trainer.drafter.state_dict().items()}

    first_losses, first_weights = train("a")
    second_losses, second_weights = train("b")
    assert second_losses == first_losses
    for name, weight in first_weights.items():
        assert torch.equal(second_weights[name], weight), name


def test_a_non_finite_step_is_skipped_on_the_device(
    tiny_tokenizer_dir, tiny_conversations, tmp_path: Path, persistent_tmp: Path
) -> None:
    """On CUDA the fused AdamW skips the non-finite step and all after it (its found_inf is the step's
    device-side flag, no host sync): the weights and moments in memory stay finite."""
    config = random_target_config(
        tiny_tokenizer_dir, tiny_conversations, tmp_path / "run", device="cuda", precision="bf16",
        max_steps=6, save_every=100, eval_every=0, lr=1e12, warmup_ratio=0, grad_clip=1e30, **ON_ANY_STACK,
    )  # fmt: skip
    config.telemetry.log_every = 100
    config.compile.cache_dir = str(persistent_tmp / "compile_cache")
    config.compile.inductor_dir = str(persistent_tmp / "inductor")
    trainer = Trainer(config, log=lambda line: None)
    assert trainer.optimizer.defaults["fused"]
    with pytest.raises(NonFiniteLoss, match=r"non-finite loss at step [1-5] "):
        trainer.run()
    assert not trainer.drafter_step.finite.item()
    assert all(torch.isfinite(parameter).all() for parameter in trainer.drafter.parameters())
    moments = [value for state in trainer.optimizer.state.values() for value in state.values()]
    assert moments and all(torch.isfinite(value).all() for value in moments)


# ---- hybrid (Gated DeltaNet) targets: flash-linear-attention's Triton kernels ----------------------

TINY_HYBRID = {
    "model_type": "qwen3_5_text", "vocab_size": 2048, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
    "linear_value_head_dim": 32, "full_attention_interval": 2, "max_position_embeddings": 4096,
}  # fmt: skip
FLA = importlib.util.find_spec("fla") is not None


@pytest.fixture
def fast_kernels() -> None:
    """The tests of the hybrid target's fast kernels fail, not skip, where flash-linear-attention is
    missing: a GPU tier that skips them says nothing about the kernels production runs on."""
    if not FLA:
        pytest.fail(
            "flash-linear-attention is not installed: the GPU tier tests the hybrid target's fast "
            "kernels; install the gpu group first (./uvw sync --group gpu)"
        )


def hybrid_config(tokenizer_dir: Path, data: Path, run_dir: Path, persistent_tmp: Path, **train):
    """The tiny random-weight config over a 4-layer Qwen3.5-style hybrid target on CUDA."""
    config = random_target_config(
        tokenizer_dir, data, run_dir, device="cuda", precision="bf16", eval_every=0, **ON_ANY_STACK, **train
    )
    config.target.architecture = dict(TINY_HYBRID)
    config.drafter.target_layer_ids = [1, 2]  # a linear-attention and a full-attention layer
    config.target.allow_slow_kernels = not FLA  # this machine may lack it: say so, degraded
    config.compile.cache_dir = str(persistent_tmp / "compile_cache")
    config.compile.inductor_dir = str(persistent_tmp / "inductor")
    return config


def test_a_hybrid_target_s_conv_runs_on_a_fast_kernel_equal_to_the_reference(fast_kernels) -> None:
    """Without causal-conv1d, the Gated DeltaNet conv runs on flash-linear-attention's Triton kernel
    (transformers' reference path never runs on the GPU), and computes what the reference computes."""
    config = validate_config(
        {"target": {"architecture": TINY_HYBRID}, "drafter": {"num_layers": 1, "mask_token_id": 3}}
    )
    target = load_target(config, "cuda")
    expected = CAUSAL_CONV1D if importlib.util.find_spec("causal_conv1d") else TRITON
    assert target.conv_kernel == expected
    layer = next(module for module in target.model.modules() if hasattr(module, "conv1d"))
    modeling = sys.modules[type(layer).__module__]
    if expected == TRITON:
        assert modeling.causal_conv1d_fn is triton_causal_conv1d_fn
    generator = torch.Generator(device="cuda").manual_seed(0)
    # [B, D, T] as transformers hands it over: a transposed view of a [B, T, D] tensor
    x = torch.randn(2, 300, 96, device="cuda", dtype=torch.bfloat16, generator=generator).transpose(1, 2)
    weight = torch.randn(96, 4, device="cuda", dtype=torch.bfloat16, generator=generator)
    reference = F.silu(F.conv1d(x.float(), weight.float().unsqueeze(1), padding=3, groups=96)[..., :300])
    fast = triton_causal_conv1d_fn(x, weight, None, activation="silu")
    assert fast.shape == x.shape
    torch.testing.assert_close(fast.float(), reference, atol=0.05, rtol=0.02)


def test_a_hybrid_target_s_delta_rule_gets_contiguous_q_k_v_and_the_features_of_transformers(
    fast_kernels, monkeypatch
) -> None:
    """The copy-free Gated DeltaNet forward (`app.model.gated_deltanet`) hands flash-linear-attention
    contiguous q, k and v with grouped value heads (nothing for its kernel to copy or repeat), and
    its features are transformers' own forward's to bf16 rounding."""
    config = validate_config(
        {"target": {"architecture": TINY_HYBRID}, "drafter": {"num_layers": 1, "mask_token_id": 3}}
    )
    target = load_target(config, "cuda")
    layers = [layer.linear_attn for layer in target.layers_run if hasattr(layer, "linear_attn")]
    modeling = sys.modules[type(layers[0]).__module__]
    rule, handed = modeling.torch_chunk_gated_delta_rule, []

    def recording_rule(query, key, value, **kwargs):
        handed.append([(t.shape[2], t.is_contiguous()) for t in (query, key, value)])
        return rule(query, key, value, **kwargs)

    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", recording_rule)
    batch = random_target_batch(target, 3, 1024)
    copy_free = target.features(batch)
    assert handed == [[(2, True), (2, True), (4, True)]] * len(layers)
    for layer in layers:
        del layer.forward  # transformers' own forward
    reference = target.features(batch)
    error = (copy_free.float() - reference.float()).norm() / reference.float().norm()
    assert error < 1e-2, float(error)


def test_a_colocated_run_warms_the_target_up_before_its_first_step(
    tiny_tokenizer_dir, tiny_conversations, tmp_path: Path, persistent_tmp: Path
) -> None:
    """A target forward at the longest and at the shortest shape on the main thread before training
    starts (in its own process: the library kernels it JIT-compiles must not land in this one's
    memory, where a later in-process build would find them and bake nothing)."""
    config = hybrid_config(
        tiny_tokenizer_dir, tiny_conversations, tmp_path / "run", persistent_tmp, max_steps=2
    )
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    done = run_dflash("train", str(config_file), timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    shapes = TargetShapes.from_config(config.data).all
    ends = " and ".join(f"{rows}x{length}" for rows, length in (shapes[-1], shapes[0]))
    warm = [line for line in lines if line.startswith("target warm-up:")]
    assert len(warm) == 1 and f"a forward at {ends}" in warm[0], done.stdout
    assert lines.index(warm[0]) < next(i for i, line in enumerate(lines) if "drafter parameters on" in line)
    if FLA and not importlib.util.find_spec("causal_conv1d"):
        assert warm[0].endswith(f"linear-attention conv on {TRITON})")


def test_a_new_target_shape_after_warm_up_is_library_jit(persistent_tmp: Path, monkeypatch) -> None:
    """flash-linear-attention compiles or autotunes per input specialisation, outside torch.compile:
    the counter sees the Triton cache grow for a new one (a length not divisible by 16 is one for
    Triton's integer arguments), and not for a shape it has seen."""
    pytest.importorskip("fla")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(persistent_tmp / "triton"))
    config = validate_config(
        {"target": {"architecture": TINY_HYBRID}, "drafter": {"num_layers": 1, "mask_token_id": 3},
         "data": {"token_budget": 1024, "max_length": 512}, "train": {"anchors": 16}}
    )  # fmt: skip
    target = load_target(config, "cuda")
    target.features(torch.randint(0, 2048, (2, 256), device="cuda"))
    counter = LibraryJitCounter()
    target.features(torch.randint(0, 2048, (2, 256), device="cuda"))
    torch.cuda.synchronize()
    assert counter.new() == 0
    target.features(torch.randint(0, 2048, (3, 300), device="cuda"))
    torch.cuda.synchronize()
    assert counter.new() > 0


def test_a_hybrid_target_bakes_every_target_shape_and_a_fresh_process_jits_nothing(
    tiny_tokenizer_dir, tiny_conversations, tmp_path: Path, persistent_tmp: Path
) -> None:
    """build-cache runs the target at every (rows, length) of the run's shape set and bakes the
    library kernels with the inductor artifacts; training in a fresh process with an empty inductor
    and Triton dir then meets only baked shapes: no library JIT (abort would fail the run)."""
    pytest.importorskip("fla")
    config = hybrid_config(
        tiny_tokenizer_dir, tiny_conversations, tmp_path / "run", persistent_tmp, max_steps=12
    )
    config.compile.on_cache_miss = "abort"
    config.telemetry.log_every = 2
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    # In its own process, as users run it: library kernels an earlier test JIT-compiled in this one
    # sit in Triton's in-memory cache, and a build here would not write them to the baked dir.
    built = run_dflash("build-cache", str(config_file), timeout=600)
    assert built.returncode == 0, built.stdout + built.stderr
    (entry,), _ = list_entries(Path(config.compile.cache_dir))
    shapes = TargetShapes.from_config(config.data)
    assert entry.fields["shape.target_batches"] == [list(shape) for shape in shapes.all]
    assert entry.triton_path is not None
    shutil.rmtree(persistent_tmp / "inductor")  # a fresh container: only the baked entry
    # and an empty Triton dir of its own, as the image sets one (not one this process used)
    fresh_triton = {"TRITON_CACHE_DIR": str(persistent_tmp / "fresh-triton")}

    done = run_dflash("train", str(config_file), timeout=600, env=fresh_triton)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "library JIT:" not in done.stdout + done.stderr
    # nor during its warm-up: the entry holds every kernel the target's first forwards launch
    warm_up = r"target warm-up: .*, inductor's autotuning 0\.0s; Triton: 0 compiled, [1-9]\d* loaded"
    assert re.search(warm_up, done.stdout), done.stdout
    assert re.search(r"in \d+ target shapes: padding overhead", done.stdout)
    assert f"compile cache: loaded {entry.key}" in done.stdout


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a split run puts each rank on its own GPU")
def test_a_split_run_s_target_rank_starts_from_the_entry_and_recompiles_nothing(
    tiny_tokenizer_dir, tiny_conversations, tmp_path: Path, persistent_tmp: Path
) -> None:
    """1 target + 1 drafter rank under torchrun on two GPUs: the target rank loads the baked entry,
    compiles the target's norms and MLPs from it, warms up and takes the fail_on_recompile stance; the
    run ends with nothing compiled after warm-up in either rank (on_cache_miss abort would stop it)."""
    pytest.importorskip("fla")
    config = hybrid_config(
        tiny_tokenizer_dir, tiny_conversations, tmp_path / "run", persistent_tmp, max_steps=6
    )
    config.topology.target_ranks, config.topology.drafter_ranks, config.topology.nproc_per_node = 1, 1, 2
    config.compile.on_cache_miss = "abort"
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    built = run_dflash("build-cache", str(config_file), timeout=600)
    assert built.returncode == 0, built.stdout + built.stderr
    (entry,), _ = list_entries(Path(config.compile.cache_dir))
    shutil.rmtree(persistent_tmp / "inductor")  # fresh containers: only the baked entry

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "-m", "app", "train", str(config_file)]  # fmt: skip
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=600, cwd=ROOT, env=child_environment()
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert output.count(f"compile cache: loaded {entry.key}") == 2, output  # the drafter and the target rank
    assert output.count("target warm-up:") == 1 and "library JIT:" not in output
    assert "RecompileError" not in output and "cache miss" not in output


def bench_target_config(persistent_tmp: Path, monkeypatch):
    """The tiny hybrid target's config for `bench target` (which needs flash-linear-attention), its
    Triton kernels in this test's own cache dir."""
    pytest.importorskip("fla")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(persistent_tmp / "triton"))
    return validate_config(
        {"target": {"architecture": TINY_HYBRID}, "drafter": {"num_layers": 2, "mask_token_id": 3,
         "target_layer_ids": [1, 2]}, "data": {"token_budget": 1024, "max_length": 512}}
    )  # fmt: skip


def test_bench_target_times_each_mode_at_each_shape(persistent_tmp: Path, monkeypatch) -> None:
    """`dflash bench target` on a tiny hybrid target: eager and compiled forwards run at each shape,
    each logged as it is measured, and the report gives each mode's ratio to eager. The CUDA-graphed
    mode either runs too or the report says why it could not (with flash-linear-attention 0.6.0 on
    torch 2.11 its capture fails after the eager mode ran: a finding, recorded in BENCHMARKS.md)."""
    config = bench_target_config(persistent_tmp, monkeypatch)
    lines: list[str] = []
    result = run_target_bench(
        config, [(4, 256), (2, 512)], ["eager", "cudagraph", "compiled"], 2, 790.0, lines.append
    )
    report = format_report(result)
    for mode in ("eager", "cudagraph", "compiled"):
        timings = result.modes[mode]
        if mode == "cudagraph" and isinstance(timings, str):
            assert f"cudagraph: could not run: {timings}" in report
            assert lines[-3] == f"cudagraph could not run: {timings}"
            continue
        assert not isinstance(timings, str), timings
        assert [(t.rows, t.length) for t in timings] == [(4, 256), (2, 512)]
        assert all(t.tokens_per_s > 0 and len(t.ms) == 2 for t in timings)
    assert lines[0].startswith("device: ") and len(lines) <= 1 + 3 * 2
    assert re.search(r"compiled / eager: \d+\.\d{3}x", report)


def test_bench_target_profiles_each_mode_s_kernels_on_request(persistent_tmp: Path, monkeypatch) -> None:
    """Each mode's forward at the longest shape, its GPU kernels ranked: each kernel counted once (the
    table's total is the forward's time, not twice it), then where the GPU sat idle; the compiled
    forward runs inductor's fused norms and MLPs."""
    config = bench_target_config(persistent_tmp, monkeypatch)
    lines: list[str] = []
    result = run_target_bench(
        config, [(4, 256), (2, 512)], ["eager", "compiled"], 3, 790.0, lines.append, profile_rows=40
    )
    assert sorted(result.profiles) == ["compiled", "eager"]
    for mode, table in result.profiles.items():
        header, *rows, idle = table.splitlines()
        assert re.fullmatch(r"GPU idle: [\d.]+ ms before the first kernel, [\d.]+ ms in \d+ gaps of .*", idle)
        match = re.fullmatch(
            rf"profile of the {mode} forward at 2 x 512 \(time on the GPU, top (\d+) of (\d+) kernels, "
            r"([\d.]+) ms in all\):",
            header,
        )
        assert match and len(rows) == min(40, int(match.group(2))) and table in lines
        forward_ms = result.modes[mode][-1].median_ms
        assert float(match.group(3)) < 1.5 * forward_ms  # kernels only: an operator and its kernel
        assert not any(" aten::" in row for row in rows)  # would make it twice the forward
    assert any("triton_" in row and "rsqrt" in row for row in result.profiles["compiled"].splitlines())


def test_the_compiled_target_matches_eager_and_a_new_shape_compiles_nothing(
    persistent_tmp: Path, monkeypatch
) -> None:
    """Inductor's norms and MLPs (`compile_target`) give the eager features to bf16 rounding at every
    shape of the run's set, and after the warm-up (both ends of the set) no shape recompiles."""
    config = bench_target_config(persistent_tmp, monkeypatch)
    target = load_target(config, "cuda")
    shapes = TargetShapes.from_config(config.data).all
    batches = [random_target_batch(target, rows, length) for rows, length in shapes]
    eager = [target.features(batch) for batch in batches]
    assert compile_target(target) == len(target.position_wise_modules()) > 0
    warm_up_target(config, target, target.device)
    enter_steady_state()
    with recompile_errors():
        for batch, reference in zip(batches, eager, strict=True):
            compiled = target.features(batch)
            error = (compiled.float() - reference.float()).norm() / reference.float().norm()
            assert error < 1e-2, (tuple(batch.shape), float(error))


def test_the_decode_step_compiles_once_into_cuda_graphs_and_answers_as_the_target() -> None:
    """Local regeneration's decode step (`compile_decode_step`): one graph, compiled by the warm-up,
    for every call of the decoder's shape (nothing else compiles, also where an earlier test's
    `compile_target` replaced transformers' RoPE), each prompt answered as the target answers it alone (fp32, so that an argmax does
    not turn on bf16 rounding) also when rows take new prompts mid-call and wrap the ring of slots, no
    NaN from the pad rows' masked keys."""
    from app.generate.build import batch_decoder
    from app.generate.step import DecodeShape
    from tests.test_speculative import random_target_config as small_random_target

    raw = small_random_target()
    raw["target"]["dtype"] = "fp32"
    raw["train"]["device"] = "cuda"
    target = load_target(validate_config(raw), "cuda")
    prompts = [[5, 17, 42, 99, 3, 250, 11], [8], list(range(60, 77)), [200, 201, 202]]
    shape = DecodeShape(rows=2, max_prompt_tokens=20, max_new_tokens=24)
    decoder = batch_decoder(target.model, shape, [], compiled=True)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    assert decoder.warm_up() > 0  # compiles here: the stream below compiles nothing more
    answers = decoder.decode(prompts)
    assert decoder.decode(prompts[::-1]) == answers[::-1]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == skips  # replayed as a CUDA graph
    for prompt, answer in zip(prompts, answers, strict=True):
        reference = target.model.generate(
            torch.tensor([prompt], device="cuda"), max_new_tokens=24, do_sample=False, pad_token_id=0
        )
        assert answer == reference[0, len(prompt) :].tolist()
    assert all(torch.isfinite(layer.keys).all() for layer in decoder.ring.cache.layers)


def test_the_compiled_step_reads_ring_blocks_and_answers_as_the_eager_dense_mask() -> None:
    """The compiled step's flex attention over the ring blocks in use (`ring_blocks`, 64-slot blocks,
    a ring of 4 of them that wraps as 2 rows take 6 prompts) gives the answers of the eager step's
    dense mask (fp32): a block missing from a row's list, or one too many unmasked, changes them."""
    from app.generate.build import batch_decoder
    from app.generate.step import DecodeShape
    from tests.test_speculative import random_target_config as small_random_target

    raw = small_random_target()
    raw["target"]["dtype"] = "fp32"
    raw["train"]["device"] = "cuda"
    target = load_target(validate_config(raw), "cuda")
    prompts = [[5, 17, 42, 99, 3, 250, 11], [8], list(range(60, 77)), [200, 201, 202], [7] * 30, [31, 2]]
    shape = DecodeShape(rows=2, max_prompt_tokens=40, max_new_tokens=200, ring_block=64)
    eager = batch_decoder(target.model, shape, [], compiled=False).decode(prompts)
    compiled = batch_decoder(target.model, shape, [], compiled=True)
    assert compiled.ring.block_sparse and shape.cache_length == 256
    assert compiled.decode(prompts) == eager


@pytest.mark.parametrize("local_decode", ["compiled", "eager"])
def test_local_datagen_compiles_its_decode_step_before_the_first_prompt(
    tiny_tokenizer_dir: Path, tmp_path: Path, persistent_tmp: Path, local_decode: str
) -> None:
    """`dflash datagen` with the local engine on CUDA: the decode step compiles into CUDA graphs and
    is captured before the first prompt (a line of its own says how long), after which the stream
    compiles nothing; each record is the eager target's greedy answer (fp32, so that an argmax does
    not turn on rounding). With `datagen.local_decode = eager` nothing compiles and a line says so."""
    import io

    from rich.console import Console
    from transformers import AutoTokenizer

    from app.datagen.local import run_local_datagen
    from tests.test_local_datagen import assert_greedy_answers, config, rows

    target = {
        "architecture": random_tiny_lm_architecture(),
        "tokenizer": str(tiny_tokenizer_dir),
        "dtype": "fp32",
    }
    run = config(tmp_path, target=target, train={"device": "cuda", **ON_ANY_STACK}, local_decode=local_decode)
    # its own kernel dir: the machine's TORCHINDUCTOR_CACHE_DIR may be under /tmp, which a run refuses
    run.compile.inductor_dir = str(persistent_tmp / "inductor")
    output = io.StringIO()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    report = run_local_datagen(run, Console(file=output, width=200))
    assert (report.done, report.failed) == (6, 1)
    compiled = local_decode == "compiled"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == int(compiled)  # the step, once
    log = output.getvalue()
    line = (
        r"the decode step compiled and captured in \d+\.\d s"
        if compiled
        else r"the decode step runs eager on cuda"
    )
    assert re.search(f"datagen: {line}", log), log
    assert re.search(line, log).start() < log.index("records to generate")
    assert_greedy_answers(
        rows(tmp_path / "out"), run, AutoTokenizer.from_pretrained(tiny_tokenizer_dir), "cuda"
    )


@pytest.mark.parametrize("objective", ["ce", "ce+tv", "ce+acceptance"])
def test_each_objective_through_the_triton_chunk_equals_the_cpu_path(objective) -> None:
    """`drafter_loss` on CUDA (Triton CE chunk, flex attention; fp32) equals the CPU's, per objective."""
    from app.data.batch import FeatureBatch
    from app.model.objective import drafter_loss

    arch = DrafterArch.from_config(validate_config(small_drafter_raw_config()))
    row, features = synthetic_row(128, 16, SMALL_VOCAB, valid_anchors=13), torch.randn(128, arch.feature_size)
    modules = [DFlashDrafter(arch), torch.nn.Embedding(SMALL_VOCAB, arch.hidden_size).requires_grad_(False),
               torch.nn.Linear(arch.hidden_size, SMALL_VOCAB, bias=False).requires_grad_(False)]  # fmt: skip
    results = []  # weight 1000 below: a random drafter's p(label) is ~1/V, its terms then weigh as the CE
    for device in ("cpu", "cuda"):  # the CPU first: `.to` moves the modules themselves
        drafter, embed_tokens, lm_head = (module.to(device) for module in modules)
        if device == "cuda":
            compile_drafter(drafter)
        loss = drafter_loss(drafter, FeatureBatch(row.to(device), features.to(device)), embed_tokens, lm_head,
            chunk_size=5, ce_chunk=drafter.kernels.ce_chunk, objective=objective, objective_weight=1e3).loss  # fmt: skip
        results.append([loss, *torch.autograd.grad(loss, list(drafter.parameters()))])
    for cpu, cuda in zip(*results, strict=True):
        assert (cuda.cpu() - cpu).norm() <= 1e-3 * cpu.norm(), (objective, tuple(cpu.shape))
