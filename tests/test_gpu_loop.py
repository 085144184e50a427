"""GPU tier: the colocated training loop's producer side, the target's CUDA graphs against its eager forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.compile.apply import compile_target
from app.compile.target_graphs import GraphedTargetFeatures
from app.compile.warmup import random_target_batch, warm_up_target
from app.data.shapes import TargetShapes
from app.model.target import load_target
from app.pipeline.features import eager_forward
from app.train.trainer import Trainer
from tests.helpers import random_target_config

pytestmark = pytest.mark.gpu
ON_ANY_STACK = {"allow_environment_drift": True}


@pytest.fixture(autouse=True)
def a_gpu_is_required():
    if not torch.cuda.is_available():
        pytest.fail("the gpu tier needs a CUDA GPU (CI deselects it; run `just test-gpu` on a GPU machine)")
    yield
    torch.compiler.set_stance("default")


def a_row_index(rows: int, length: int, budget: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed row's token index over a `rows x length` batch (real tokens first, then padding -1)."""
    generator = torch.Generator().manual_seed(seed)
    real = int(torch.randint(1, min(rows * length, budget) + 1, (), generator=generator))
    index = torch.zeros(budget, dtype=torch.int64)
    index[:real] = torch.randperm(rows * length, generator=generator)[:real].sort().values
    documents = torch.full((budget,), -1, dtype=torch.int32)
    documents[:real] = 0
    return index.cuda(), documents.cuda()


def assert_same_features(
    replayed: torch.Tensor, expected: torch.Tensor, documents: torch.Tensor, shape: tuple[int, int]
) -> None:
    padding = documents < 0
    assert replayed[padding].eq(0).all() and expected[padding].eq(0).all(), shape
    error = (replayed.float() - expected.float()).abs().max()
    assert error <= 1e-4 * expected.float().abs().max(), (shape, float(error))


def test_the_target_s_graphs_give_its_eager_features_at_every_shape(
    tiny_tokenizer_dir, tiny_conversations, tmp_path: Path
) -> None:
    """Replayed graphs compute what the eager forward and gather compute at every shape of the run, in
    any order, padding exactly zero; a shape outside the run's set is refused, not run eagerly. In fp32:
    under capture cuBLAS may pick other algorithms (on an H200 the bf16 results were not bit-identical),
    and a random-weight target's bf16 hidden states reach thousands, where one bf16 step is 16."""
    config = random_target_config(
        tiny_tokenizer_dir, tiny_conversations, tmp_path / "run", device="cuda", **ON_ANY_STACK
    )
    config.target.dtype = "fp32"
    target = load_target(config, "cuda")
    compile_target(target)
    warm_up_target(config, target, target.device)
    shapes = TargetShapes.from_config(config.data).all
    budget = config.data.token_budget
    graphs = GraphedTargetFeatures(target, shapes, budget)
    assert graphs.shapes == list(shapes)
    eager = eager_forward(target)
    held = []
    for number, (rows, length) in enumerate(reversed(shapes)):
        input_ids = random_target_batch(target, rows, length, seed=number)
        index, documents = a_row_index(rows, length, budget, seed=number)
        replayed = graphs(input_ids, index, documents)
        expected = eager(input_ids, index, documents)
        assert_same_features(replayed, expected, documents, (rows, length))
        held.append((replayed.clone(), replayed, expected))
    # each result is the caller's own: a later replay does not overwrite an earlier one
    assert all(torch.equal(copy, replayed) for copy, replayed, _ in held)
    rows, length = shapes[0]
    with pytest.raises(RuntimeError, match=f"{rows + 1}x{length} has no CUDA graph"):
        graphs(random_target_batch(target, rows + 1, length), *a_row_index(rows + 1, length, budget, 0))


@pytest.mark.parametrize("soft_targets", [0.0, 0.5])
def test_a_run_on_the_target_s_graphs_trains_what_the_eager_run_trains(
    tiny_tokenizer_dir, tiny_conversations, tmp_path: Path, persistent_tmp: Path, soft_targets: float
) -> None:
    """The same seed with and without `compile.target_cuda_graphs`: the same losses step for step, to
    the features' bf16 rounding (the graphs' matmuls may take other cuBLAS algorithms); with soft
    targets the graphs carry the target's final hidden states too."""
    losses = {}
    for graphed in (False, True):
        config = random_target_config(
            tiny_tokenizer_dir, tiny_conversations, tmp_path / f"run-{graphed}", device="cuda",
            precision="bf16", max_steps=8, eval_every=0, soft_targets=soft_targets, **ON_ANY_STACK,
        )  # fmt: skip
        config.compile.target_cuda_graphs = graphed
        config.compile.cache_dir = str(persistent_tmp / "compile_cache")
        config.compile.inductor_dir = str(persistent_tmp / "inductor")
        lines: list[str] = []
        trainer = Trainer(config, log=lines.append)
        assert (trainer.compile_report.target_forward is not None) == graphed
        assert any(line.startswith("target CUDA graphs:") for line in lines) == graphed
        losses[graphed] = trainer.run().losses
        torch.compiler.set_stance("default")
    assert len(losses[True]) == 8
    assert losses[True] == pytest.approx(losses[False], rel=2e-2)
