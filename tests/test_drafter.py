"""The DFlash drafter: layout, shapes, validation, mask semantics end to end, inference == training."""

import re
from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from typer.testing import CliRunner

from app.bench.drafter import (
    NonFiniteBenchStep,
    _attention_tiles,
    _frozen_head_stand_ins,
    require_finite_steps,
    run_drafter_bench,
)
from app.bench.profile import IDLE_GAP_US, _matmul_shape, device_idle, profile_table
from app.compile.warmup import synthetic_batches
from app.config import load_config, validate_config
from app.data.synthetic import synthetic_row
from app.errors import UserError
from app.model.attention import dense_training_mask
from app.model.drafter import DFlashDrafter, DrafterArch
from app.model.flops import forward_flops, multiplier, step_flops
from app.train.step import BorrowedHeads, DrafterStep
from tests.helpers import (
    REFERENCE_LAYER_WEIGHTS,
    SMALL_BLOCK,
    SMALL_HIDDEN,
    SMALL_VOCAB,
    small_drafter_raw_config,
)

VOCAB, HIDDEN, BLOCK = SMALL_VOCAB, SMALL_HIDDEN, SMALL_BLOCK


def run_config(**drafter):
    return validate_config(small_drafter_raw_config(**drafter))


def frozen_head(seed=0):
    generator = torch.Generator().manual_seed(seed)
    embed_tokens = nn.Embedding(VOCAB, HIDDEN).requires_grad_(False)
    lm_head = nn.Linear(HIDDEN, VOCAB, bias=False).requires_grad_(False)
    for module in (embed_tokens, lm_head):
        module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * 0.5)
    return embed_tokens, lm_head


def test_arch_defaults_come_from_the_target():
    arch = DrafterArch.from_config(run_config())
    assert (arch.hidden_size, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (
        64,
        4,
        2,
        16,
    )
    assert arch.intermediate_size == 96 and arch.rope_theta == 5000.0 and arch.vocab_size == VOCAB
    assert arch.target_layer_ids == (1, 5)  # default: spread from 1 to 8 - 3
    assert arch.feature_size == 2 * HIDDEN
    overridden = DrafterArch.from_config(run_config(num_attention_heads=8, head_dim=8, intermediate_size=40))
    assert (overridden.num_attention_heads, overridden.head_dim, overridden.intermediate_size) == (8, 8, 40)


def test_arch_reads_multimodal_qwen3_5_configs():
    config = validate_config(
        {
            "target": {
                "architecture": {
                    "model_type": "qwen3_5",
                    "text_config": {
                        "vocab_size": 512,
                        "hidden_size": 32,
                        "intermediate_size": 64,
                        "num_hidden_layers": 8,
                        "num_attention_heads": 2,
                        "num_key_value_heads": 1,
                        "head_dim": 16,
                    },
                }
            },
            "drafter": {"num_layers": 3, "mask_token_id": 500},
        }
    )
    arch = DrafterArch.from_config(config)
    assert (arch.hidden_size, arch.vocab_size, arch.num_target_layers) == (32, 512, 8)
    assert arch.target_layer_ids == (1, 3, 5)
    assert arch.rope_theta > 0


def test_parameter_names_follow_the_reference_layout():
    drafter = DFlashDrafter(DrafterArch.from_config(run_config()))
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    expected |= {f"layers.{i}.{name}" for i in range(2) for name in REFERENCE_LAYER_WEIGHTS}
    assert set(drafter.state_dict()) == expected  # no embedding, no LM head, no buffers
    assert {name for name, _ in drafter.named_parameters()} == expected
    assert drafter.fc.weight.shape == (HIDDEN, 2 * HIDDEN) and drafter.fc.bias is None


def test_production_shape_parameter_count():
    config = validate_config(
        {
            "target": {
                "architecture": {
                    "model_type": "qwen3_5_text",
                    "vocab_size": 248320,
                    "hidden_size": 5120,
                    "intermediate_size": 17408,
                    "num_hidden_layers": 64,
                    "num_attention_heads": 24,
                    "num_key_value_heads": 4,
                    "head_dim": 256,
                }
            },
            "drafter": {
                "num_layers": 5,
                "target_layer_ids": [1, 16, 31, 46, 61],
                "block_size": 32,
                "mask_token_id": 248070,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "head_dim": 128,
            },
            "data": {"token_budget": 49152, "max_length": 16384},
            "train": {"anchors": 1024},
        }
    )
    with torch.device("meta"):
        drafter = DFlashDrafter(DrafterArch.from_config(config))
    hidden, ffn, heads, kv_heads, head_dim = 5120, 17408, 32, 8, 128
    fc = 5 * 5120 * hidden  # 25600 -> 5120, no bias
    attention = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    attention += 2 * head_dim  # q_norm, k_norm
    mlp = 3 * hidden * ffn
    norms = 2 * hidden  # input_layernorm, post_attention_layernorm
    expected = fc + hidden + 5 * (attention + mlp + norms) + hidden  # + hidden_norm, final norm
    assert expected == 1_730_213_120  # ~1.73B trainable parameters
    assert sum(p.numel() for p in drafter.parameters()) == expected
    assert drafter.fc.weight.shape == (5120, 25600)


def test_same_seed_same_weights():
    arch = DrafterArch.from_config(run_config())
    first, second, other = (
        DFlashDrafter(arch, seed=3),
        DFlashDrafter(arch, seed=3),
        DFlashDrafter(arch, seed=4),
    )
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters(), strict=True))
    assert not torch.equal(first.fc.weight, other.fc.weight)


def test_built_on_the_given_device():
    """Parameters are created and drawn where `device` says (the GPU at train start), whatever the
    ambient default device: the same weights as a build that defaults to that device."""
    arch = DrafterArch.from_config(run_config())
    with torch.device("meta"):
        built = DFlashDrafter(arch, seed=3, device="cpu")
    assert {p.device.type for p in built.parameters()} == {"cpu"}
    reference = DFlashDrafter(arch, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(built.parameters(), reference.parameters(), strict=True))
    assert {p.device.type for p in DFlashDrafter(arch, device="meta").parameters()} == {"meta"}


def test_bad_shapes_are_one_line_user_errors():
    arch = DrafterArch.from_config(run_config())
    with pytest.raises(UserError, match="must equal the target's"):
        replace(arch, hidden_size=32)
    with pytest.raises(UserError, match="mask_token_id"):
        replace(arch, mask_token_id=VOCAB)
    with pytest.raises(UserError, match="block_size"):
        replace(arch, block_size=1)
    with pytest.raises(UserError, match="target_layer_ids"):
        replace(arch, target_layer_ids=(1, 8))
    with pytest.raises(UserError, match="num_key_value_heads"):
        replace(arch, num_key_value_heads=3)

    drafter = DFlashDrafter(arch)
    embed_tokens, _ = frozen_head()
    row = synthetic_row(128, 16, VOCAB, generator=torch.Generator().manual_seed(0))
    with pytest.raises(UserError, match=r"K=2 target layers \[1, 5\]"):
        drafter(torch.zeros(128, 3 * HIDDEN), row, embed_tokens)
    with pytest.raises(UserError, match="cover 100 tokens"):
        drafter(torch.zeros(100, 2 * HIDDEN), row, embed_tokens)
    with pytest.raises(UserError, match="target embedding"):
        drafter(torch.zeros(128, 2 * HIDDEN), row, nn.Embedding(VOCAB, 32))
    empty = synthetic_row(128, 16, VOCAB, generator=torch.Generator().manual_seed(0))
    empty.anchor_positions, empty.anchor_valid = empty.anchor_positions[:0], empty.anchor_valid[:0]
    with pytest.raises(UserError, match="no anchor slots"):
        drafter(torch.zeros(128, 2 * HIDDEN), empty, embed_tokens)


@pytest.fixture(scope="module")
def sliding_setup():
    arch = DrafterArch.from_config(run_config(sliding_window=12, sliding_window_layers=[1]))
    drafter = DFlashDrafter(arch, seed=1)
    embed_tokens, lm_head = frozen_head()
    generator = torch.Generator().manual_seed(5)
    row = synthetic_row(128, 16, VOCAB, num_documents=3, padding=9, valid_anchors=13, generator=generator)
    features = torch.randn(128, arch.feature_size, generator=generator)
    return drafter, embed_tokens, lm_head, row, features


def test_a_block_sees_only_its_documents_earlier_context(sliding_setup):
    drafter, embed_tokens, _, row, features = sliding_setup
    baseline = drafter(features, row, embed_tokens)
    block = 6
    anchor = int(row.anchor_positions[block])
    document = row.document_ids[anchor]
    unseen = (row.document_ids != document) | (torch.arange(128) >= anchor)
    perturbed = features.clone()
    perturbed[unseen] += 5.0
    changed = drafter(perturbed, row, embed_tokens)
    torch.testing.assert_close(changed[block], baseline[block])
    earlier = features.clone()
    earlier[anchor - 1] += 5.0  # the token right before the anchor is context
    assert not torch.allclose(drafter(earlier, row, embed_tokens)[block], baseline[block])


def test_gradients_reach_every_parameter_and_are_finite(sliding_setup):
    drafter, embed_tokens, lm_head, row, features = sliding_setup
    hidden = drafter(features, row, embed_tokens)
    lm_head(hidden).logsumexp(-1).mean().backward()
    for name, parameter in drafter.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), name
        assert parameter.grad.abs().sum() > 0, name
    drafter.zero_grad(set_to_none=True)
    assert embed_tokens.weight.grad is None and lm_head.weight.grad is None


def test_flex_backend_equals_the_cpu_dense_backend(sliding_setup):
    drafter, embed_tokens, _, row, features = sliding_setup
    dense = drafter(features, row, embed_tokens)
    drafter.attention_backend = "flex"
    try:
        flex = drafter(features, row, embed_tokens)
    finally:
        drafter.attention_backend = None
    valid = row.anchor_valid
    torch.testing.assert_close(flex[valid], dense[valid], rtol=1e-4, atol=1e-4)


def test_inference_path_matches_the_training_forward(sliding_setup):
    drafter, embed_tokens, lm_head, row, features = sliding_setup
    with torch.no_grad():
        training_logits = lm_head(drafter(features, row, embed_tokens))
    for block in range(int(row.anchor_valid.sum())):
        anchor = int(row.anchor_positions[block])
        start = anchor - int(row.position_ids[anchor])  # the anchor's document starts here
        cache = drafter.new_cache()
        # the context arrives in pieces, as it does round after round in speculative decoding
        for lo, hi in ((start, (start + anchor) // 2), ((start + anchor) // 2, anchor)):
            if hi > lo:
                drafter.extend_context(features[lo:hi], row.position_ids[lo:hi], cache)
        assert cache.length == anchor - start
        logits = drafter.draft_logits(
            cache, row.input_ids[anchor], int(row.position_ids[anchor]), embed_tokens, lm_head
        )
        torch.testing.assert_close(logits, training_logits[block, 1:], rtol=1e-4, atol=1e-4)
        draft = drafter.draft(
            cache, int(row.input_ids[anchor]), int(row.position_ids[anchor]), embed_tokens, lm_head
        )
        assert draft.shape == (BLOCK - 1,) and torch.equal(draft, logits.argmax(-1))


def test_one_cache_of_a_whole_document_serves_all_its_blocks_at_once(sliding_setup):
    """Eval's replay (`blocks_logits`): the cache holds the whole document, later tokens included, and
    every block of it is drafted in one call; each must see only the context before its anchor (and
    its window), as the training forward does."""
    drafter, embed_tokens, lm_head, row, features = sliding_setup
    with torch.no_grad():
        training_logits = lm_head(drafter(features, row, embed_tokens))
    valid = torch.nonzero(row.anchor_valid).flatten()
    documents = row.document_ids[row.anchor_positions[valid]]
    checked = 0
    for document in documents.unique().tolist():
        blocks = valid[documents == document]
        tokens = torch.nonzero(row.document_ids == document).flatten()
        cache = drafter.new_cache()
        drafter.extend_context(features[tokens], row.position_ids[tokens], cache)
        anchors = row.anchor_positions[blocks]
        logits = drafter.blocks_logits(
            cache, row.input_ids[anchors], row.position_ids[anchors], embed_tokens, lm_head
        )
        torch.testing.assert_close(logits, training_logits[blocks, 1:], rtol=1e-4, atol=1e-4)
        checked += len(blocks)
    assert checked == len(valid) and len(documents.unique()) > 1


def test_the_flop_count_counts_what_the_mask_lets_through_and_the_loss_supervises(sliding_setup):
    """The useful FLOPs behind `bench drafter` and the log line's MFU, against brute force on a row with
    padding, dead anchor slots and a sliding-window layer: attention pairs are the dense training mask's
    True entries, LM-head slots the supervised (anchor + k) positions, and a step 3x / 2x their sum."""
    drafter, _, _, row, _ = sliding_setup
    arch = drafter.arch
    terms = forward_flops(arch, row)
    masks = [dense_training_mask(row, arch.block_size, arch.layer_window(i)) for i in range(arch.num_layers)]
    pairs = sum(int(mask.sum()) for mask in masks)
    assert terms["attention (unmasked pairs)"] == 4 * arch.num_attention_heads * arch.head_dim * pairs
    supervised = sum(
        1
        for anchor, valid in zip(row.anchor_positions.tolist(), row.anchor_valid.tolist(), strict=True)
        for k in range(1, arch.block_size)
        if valid
        and anchor + k < row.input_ids.shape[0]
        and row.document_ids[anchor + k] == row.document_ids[anchor]
        and row.loss_mask[anchor + k]
    )
    assert supervised > 0 and terms["lm_head (supervised slots)"] == 2 * supervised * HIDDEN * VOCAB
    queries = row.anchor_positions.shape[0] * arch.block_size
    assert (
        terms["q_proj (block)"]
        == arch.num_layers * 2 * queries * HIDDEN * arch.num_attention_heads * arch.head_dim
    )
    frozen_input = ("lm_head (supervised slots)", "fc (context features -> hidden)")
    trainable = sum(value for name, value in terms.items() if name not in frozen_input)
    assert step_flops(terms) == 3 * trainable + 2 * sum(terms[name] for name in frozen_input)


def test_the_projections_flops_times_their_multipliers_are_the_matmuls_autograd_runs(sliding_setup):
    """Counted against torch's own FLOP counter over a forward and backward: every projection term
    times its multiplier is what the step's matmuls compute. The fc over the frozen features has no
    input gradient (2x, not 3x): counting one would overstate the MFU."""
    drafter, embed_tokens, _, row, features = sliding_setup
    terms = forward_flops(drafter.arch, row)
    with FlopCounterMode(display=False) as counter:
        drafter(features, row, embed_tokens).square().mean().backward()
    counted = counter.get_flop_counts()["Global"]
    matmuls = sum(counted.get(op, 0) for op in (torch.ops.aten.mm, torch.ops.aten.addmm))
    projections = {
        name: value for name, value in terms.items() if not name.startswith(("attention", "lm_head"))
    }
    assert matmuls == sum(multiplier(name) * value for name, value in projections.items())


def test_bench_drafter_sets_flex_s_tiles_against_the_pairs_they_let_through(sliding_setup):
    """Per layer window, the tiles flex computes (partial and full 128 x 128 tiles of the training
    BlockMask) and the useful pairs, against the dense mask tiled by brute force, averaged over rows
    with padding, dead anchor slots and several documents."""
    arch = sliding_setup[0].arch
    generator = torch.Generator().manual_seed(3)
    rows = [synthetic_row(512, 64, VOCAB, num_documents=3, padding=20, valid_anchors=57, generator=generator)]
    rows.append(synthetic_row(512, 64, VOCAB, document_length=512, generator=generator))  # full tiles
    tiles = _attention_tiles(arch, rows)
    assert list(tiles) == [None, 12]  # layer 0 full context, layer 1 the window
    for window, counted in tiles.items():
        expected = torch.zeros(3)
        for row in rows:
            dense = dense_training_mask(row, arch.block_size, window)
            query_tiles, key_tiles = (-(-size // 128) for size in dense.shape)
            padded = torch.zeros(query_tiles * 128, key_tiles * 128, dtype=torch.bool)
            padded[: dense.shape[0], : dense.shape[1]] = dense
            per_tile = padded.view(query_tiles, 128, key_tiles, 128).sum((1, 3))
            expected += torch.tensor(
                [((per_tile > 0) & (per_tile < 128**2)).sum(), (per_tile == 128**2).sum(), dense.sum()]
            )
        assert (counted.partial, counted.full, counted.useful_pairs) == tuple((expected / len(rows)).tolist())
        assert 0 < counted.useful_pairs < counted.computed_pairs == (counted.partial + counted.full) * 128**2
    assert tiles[None].full > 0


def test_bench_drafter_runs_on_cpu_with_the_tiny_config():
    from app.cli import cli

    result = CliRunner().invoke(
        cli, ["bench", "drafter", "configs/tiny.toml", "train.anchors=16", "--steps", "2", "--warmup", "1"]
    )
    assert result.exit_code == 0, result.output
    for field in (
        "step time (median of 2)",
        "query tokens/s",
        "context tokens/s",
        "fc (context features -> hidden)",
        "attention (unmasked pairs)",
        "lm_head (supervised slots)",
        "attention per layer and row (flex's 128 x 128 tiles):\n  full context: ",
        "achieved TFLOP/s",
        "% of 790 peak",
        "peak memory",
        "first call",
        "log step with tree_streak (16 blocks, budget 64, top-8):",
        "one step in 5 (telemetry.log_every):",  # configs/tiny.toml logs every 5
    ):
        assert field in result.output, field
    proxy = re.search(r"tree_streak .*: ([\d.]+) ms median, ([+-][\d.]+) ms", result.output)
    step = re.search(r"step time \(median of 2\): ([\d.]+) ms", result.output)
    assert float(proxy[1]) - float(step[1]) == pytest.approx(float(proxy[2]), abs=0.02)

    off = CliRunner().invoke(
        cli,
        ["bench", "drafter", "configs/tiny.toml", "train.anchors=16", "telemetry.tree_streak_blocks=0",
         "--steps", "1", "--warmup", "1"],
    )  # fmt: skip
    assert off.exit_code == 0 and "tree_streak" not in off.output, off.output


def test_bench_drafter_refuses_to_time_a_step_whose_loss_or_gradients_are_not_finite():
    """A NaN step's time measures nothing (on an H200 it even runs faster): the bench checks one
    more step per row, its loss and every gradient, and names the rows that failed."""
    config = load_config("configs/tiny.toml", ["train.anchors=16"])
    arch, cpu = DrafterArch.from_config(config), torch.device("cpu")
    drafter = DFlashDrafter(arch, seed=0, device=cpu)
    step = DrafterStep(config, drafter, BorrowedHeads(*_frozen_head_stand_ins(arch, cpu, torch.float32)), cpu)
    batches = synthetic_batches(config, drafter, cpu, 3)
    require_finite_steps(step, batches)
    assert all(parameter.grad is None for parameter in drafter.parameters())
    # a gradient alone non-finite (the loss is finite): still refused
    hook = drafter.layers[0].mlp.down_proj.weight.register_hook(lambda grad: grad * float("nan"))
    with pytest.raises(NonFiniteBenchStep, match=r"synthetic row\(s\) \[0, 1, 2\] of 3 gave a non-finite"):
        require_finite_steps(step, batches)
    hook.remove()
    with torch.no_grad():
        drafter.norm.weight.fill_(float("inf"))
    with pytest.raises(NonFiniteBenchStep, match=r"\[0, 1, 2\] of 3"):
        require_finite_steps(step, batches)


def embedded_ids(embed_tokens: nn.Embedding, call) -> list[torch.Tensor]:
    """The token ids `call()` passes through the target embedding, one tensor per embedding call."""
    seen: list[torch.Tensor] = []
    handle = embed_tokens.register_forward_hook(lambda module, args, output: seen.append(args[0].clone()))
    try:
        call()
    finally:
        handle.remove()
    return seen


def test_a_block_is_its_anchor_then_mask_tokens_in_training_and_inference(sliding_setup):
    drafter, embed_tokens, lm_head, row, features = sliding_setup
    mask = drafter.arch.mask_token_id
    (training,) = embedded_ids(embed_tokens, lambda: drafter(features, row, embed_tokens))
    assert torch.equal(training[:, 0], row.input_ids[row.anchor_positions])
    assert (training[:, 1:] == mask).all()

    anchor = 42
    (inference,) = embedded_ids(
        embed_tokens, lambda: drafter.draft_logits(drafter.new_cache(), anchor, 0, embed_tokens, lm_head)
    )
    assert inference.tolist() == [[anchor] + [mask] * (BLOCK - 1)]


def test_the_mask_token_id_changes_what_the_drafter_sees(sliding_setup):
    drafter, embed_tokens, lm_head, row, features = sliding_setup
    other = DFlashDrafter(replace(drafter.arch, mask_token_id=drafter.arch.mask_token_id + 1))
    other.load_state_dict(drafter.state_dict())
    valid = row.anchor_valid
    with torch.no_grad():
        assert not torch.allclose(
            other(features, row, embed_tokens)[valid], drafter(features, row, embed_tokens)[valid]
        )
        cache = drafter.new_cache()
        assert not torch.allclose(
            other.draft_logits(cache, 42, 0, embed_tokens, lm_head),
            drafter.draft_logits(cache, 42, 0, embed_tokens, lm_head),
        )


def test_a_profile_ranks_operators_by_self_time_with_their_counts():
    a, b = torch.randn(512, 512), torch.randn(512, 512)  # far costlier than the rest even on a loaded CPU

    def call() -> None:
        for _ in range(3):
            torch.mm(a, b)
        torch.add(a, b)

    table = profile_table(call, torch.device("cpu"), rows=2, what="three matmuls and an add")
    header, *rows = table.splitlines()
    assert re.fullmatch(
        r"profile of three matmuls and an add \(time on the host, top 2 of \d+ operators, [\d.]+ ms in all\):",
        header,
    )
    assert len(rows) == 2 and rows[0].split()[3:] == ["x3", "aten::mm"]
    shares = [float(row.split()[2].rstrip("%")) for row in rows]
    assert shares[0] >= shares[1] > 0 and sum(shares) <= 100.05


def test_a_profile_s_matmuls_are_grouped_by_shape_with_their_flops():
    """mm, addmm (its first input is the added term) and bmm, grouped by operator and shape, the
    costliest first; the header's FLOPs are the products' (2 M K N, times the batch)."""
    a, b = torch.randn(512, 512), torch.randn(512, 512)  # far costlier than the rest even on a loaded CPU
    x, w, bias = torch.randn(32, 16), torch.randn(16, 8), torch.randn(8)
    p, q = torch.randn(4, 8, 16), torch.randn(4, 16, 2)

    def call() -> None:
        for _ in range(3):
            torch.mm(a, b)
        torch.addmm(bias, x, w)
        torch.bmm(p, q)

    table = profile_table(call, torch.device("cpu"), rows=5, what="matmuls", matmuls=True).splitlines()
    start = next(i for i, line in enumerate(table) if line.startswith("matmuls by shape"))
    header, rows = table[start], table[start + 1 :]
    flop = 3 * 2 * 512**3 + 2 * 32 * 16 * 8 + 2 * 4 * 8 * 16 * 2
    assert re.fullmatch(
        rf"matmuls by shape \(top 3 of 3, [\d.]+ ms for {flop / 1e9:,.3f} GFLOP, .*\):", header
    )
    calls = [row.split()[2] for row in rows]
    products = [" ".join(row.split()[5:]) for row in rows]
    assert calls[0] == "x3" and products[0] == "aten::mm 512 x 512 @ 512 x 512"  # the costliest
    assert calls[1:] == ["x1", "x1"] and sorted(products[1:]) == [
        "aten::addmm 32 x 16 @ 16 x 8",
        "aten::bmm 4 x 8 x 16 @ 16 x 2",
    ]
    assert _matmul_shape("aten::bmm", [[4, 8, 16], [4, 16, 2]])[1] == 2 * 4 * 8 * 16 * 2
    assert _matmul_shape("aten::addmm", [[8], [32, 16], [16, 8], [], []])[1] == 2 * 32 * 16 * 8


def test_the_gpu_s_idle_time_is_the_gaps_between_kernels_of_all_streams():
    """Overlapping kernels (two streams) are one busy stretch; a wait under IDLE_GAP_US is a launch's
    latency; the wait before the first kernel is counted apart; the largest gap names what came after."""
    kernels = [
        (110.0, 300.0, "gemm"),  # 10 us after the host started
        (150.0, 200.0, "other_stream"),  # inside gemm, on another stream: still busy until 300
        (303.0, 400.0, "softmax"),  # 3 us: a launch's latency, not idle
        (900.0, 950.0, "flex_backward"),  # 500 us idle
        (1000.0, 1010.0, "copy"),  # 50 us idle
    ]
    line = device_idle(list(reversed(kernels)), started_us=100.0)
    assert line == (
        "GPU idle: 0.01 ms before the first kernel, 0.55 ms in 2 gaps of 5 us or more between kernels "
        "(largest 0.50 ms, before flex_backward)"
    )
    assert device_idle([(5.0, 9.0, "only")], started_us=5.0) == (
        "GPU idle: 0.00 ms before the first kernel, 0.00 ms in 0 gaps of 5 us or more between kernels"
    )
    assert IDLE_GAP_US == 5.0


def test_synthetic_rows_pack_documents_of_the_run_s_longest_samples():
    """Warm-up, build-cache's timed steps and `bench drafter` run rows packed like a full batch of
    `data.max_length` samples (the last document takes the remainder): the heaviest rows real data
    can make, and the sequences a peer's step benchmark feeds. Random cuts made documents longer
    than any sample (2.9x the attention work of such a row in one measured case)."""
    config = load_config("configs/tiny.toml", ["data.token_budget=1024", "data.max_length=300"])
    drafter = DFlashDrafter(DrafterArch.from_config(config), seed=0)
    for batch in synthetic_batches(config, drafter, torch.device("cpu"), 2):
        documents = batch.row.document_ids
        assert torch.bincount(documents[documents >= 0]).tolist() == [300, 300, 300, 124]
        assert torch.equal(batch.row.position_ids[300:600], torch.arange(300))


def test_bench_drafter_counts_the_useful_flops_of_the_rows_it_timed():
    """Each synthetic row's anchors set its attention work: the step's FLOPs are the timed rows'
    mean, not the first row's."""
    config = load_config("configs/tiny.toml", ["train.anchors=16"])
    result = run_drafter_bench(config, steps=3, warmup=1, device="cpu")
    arch = DrafterArch.from_config(config)
    batches = synthetic_batches(config, DFlashDrafter(arch), torch.device("cpu"), 3, seed=config.train.seed)
    counts = [float(step_flops(forward_flops(arch, batch.row))) for batch in batches]
    assert len(set(counts)) > 1
    assert result.step_flops == pytest.approx(sum(counts) / len(counts))


def test_bench_drafter_profiles_one_step_on_request():
    from app.cli import cli

    result = CliRunner().invoke(
        cli, ["bench", "drafter", "configs/tiny.toml", "train.anchors=16", "--steps", "1", "--warmup", "1",
              "--profile", "4"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    start = next(
        i for i, line in enumerate(lines) if line.startswith("profile of one step (time on the host")
    )
    operators, matmuls = lines[start + 1 : start + 5], lines[start + 5 :]
    assert all(" ms " in line for line in operators)
    assert re.fullmatch(r"matmuls by shape \(top 4 of \d+, .*\):", matmuls[0])
    assert len(matmuls) == 5 and all(" TFLOP/s  aten::" in line for line in matmuls[1:])
