"""`dflash bench target`: which shapes it times, the FLOPs it counts, its report, its refusals.
(The timing itself runs on CUDA: tests/test_gpu.py.)"""

import pytest
import torch

from app.bench.target import (
    ShapeTiming,
    TargetBenchResult,
    _matmul_flops_per_token,
    bench_shapes,
    format_report,
    run_target_bench,
)
from app.config import validate_config
from app.data.shapes import TargetShapes
from app.errors import UserError
from app.model.target import load_target
from tests.helpers import run_dflash
from tests.test_target import ARCHITECTURES


def hybrid_config(layer_ids):
    return validate_config(
        {"target": {"architecture": ARCHITECTURES["qwen3_5_text"]},
         "drafter": {"num_layers": len(layer_ids), "mask_token_id": 3, "target_layer_ids": layer_ids},
         "data": {"token_budget": 4096, "max_length": 2048}}
    )  # fmt: skip


def test_bench_shapes_spread_over_the_run_set_and_keep_the_longest():
    config = hybrid_config([0, 1])
    every = TargetShapes.from_config(config.data).all
    assert bench_shapes(config, None) == every and bench_shapes(config, len(every) + 5) == every
    assert bench_shapes(config, 1) == [every[-1]]
    three = bench_shapes(config, 3)
    middle = (len(every) - 1) / 2
    assert three[0] == every[0] and three[-1] == every[-1]
    assert abs(every.index(three[1]) - middle) <= 0.5


def test_flops_count_the_layers_that_run_and_causal_attention_in_full_attention_layers():
    """Layers 0 (Gated DeltaNet) and 1 (full attention) run for taps [0, 1]; layers 2 and 3 do not."""
    config = hybrid_config([0, 1])
    target = load_target(config, "cpu")
    assert target.layers_run == list(target.model.get_decoder().layers[:2])
    # the matrix weights of the two layers, counted another way: every 2-D parameter (the conv is 3-D)
    weights = sum(p.numel() for layer in target.layers_run for p in layer.parameters() if p.ndim == 2)
    heads, head_dim = 2, 16
    for length in (128, 1024):
        # one full-attention layer: scores + values, 2 x 2 x heads x head_dim per key, length / 2 keys per query
        expected = 2 * weights + 2 * 2 * heads * head_dim * length / 2
        assert _matmul_flops_per_token(target, length) == pytest.approx(expected)


def test_the_report_gives_each_mode_token_weighted_and_its_ratio_to_eager():
    def timing(rows, length, ms):
        return ShapeTiming(rows, length, first_call_s=1.0, ms=[ms, ms * 2, ms])

    result = TargetBenchResult(
        device="test", layers_run=2, layers_total=4, peak_tflops=100.0,
        flops_per_token={(4, 256): 1e6, (1, 1024): 1e6},
        modes={"eager": [timing(4, 256, 100.0), timing(1, 1024, 300.0)],
               "compiled": [timing(4, 256, 200.0), timing(1, 1024, 600.0)],
               "cudagraph": "RuntimeError: capture failed"},
    )  # fmt: skip
    report = format_report(result)
    # 2048 tokens in 0.1 + 0.3 s (medians) = 5.12K tok/s; compiled takes twice as long
    assert "eager: 5.12K tok/s over its shapes (2048 tokens per pass)" in report
    assert "compiled / eager: 0.500x" in report
    assert "cudagraph: could not run: RuntimeError: capture failed" in report


def test_bad_modes_and_a_missing_gpu_are_refused_before_the_target_loads():
    config = hybrid_config([0, 1])
    with pytest.raises(UserError, match=r"--modes: unknown \['fast'\]; expected some of"):
        run_target_bench(config, [(1, 128)], ["eager", "fast"], 1, 790.0, log=print)
    if not torch.cuda.is_available():
        done = run_dflash("bench", "target", "configs/tiny.toml")
        assert done.returncode == 2
        assert done.stderr.strip() == (
            "dflash: error: bench target: needs a CUDA GPU (the target forward is measured where it trains)"
        )
