"""`dflash bench tree`: what one DDTree round costs at a config's shapes, part by part.

A round of tree-verified decoding is the drafter's block forward (`draft_logits`), the tree's
construction from its per-depth distributions (`build_tree`, at each budget), and one target forward
that verifies the root and the tree's nodes under their ancestor mask after the KV-cached context.
The benchmark times each alone, so a budget's construction cost reads against the verification
forward it feeds. Weights are random (the costs do not depend on them); the target must be
attention-only, since a hybrid target's linear-attention layers take no ancestor mask.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from app.compile.warmup import random_target_batch, synchronize
from app.config import RunConfig
from app.errors import UserError
from app.evaluate.speculative import CachedTarget, drafter_autocast
from app.evaluate.tree import tree_verification_inputs
from app.model.drafter import DFlashDrafter, DrafterArch
from app.model.target import is_hybrid, load_target, target_text_config
from app.model.tree import DraftTree, build_tree


@dataclass
class BudgetTiming:
    """One budget: the tree's construction and its verification forward, milliseconds per repeat."""

    budget: int
    nodes: int
    build_ms: list[float]
    verify_ms: list[float]


@dataclass
class TreeBenchResult:
    device: str
    target_layers: int
    vocab: int
    context: int
    depths: int
    top_k: int
    draft_ms: list[float]
    budgets: list[BudgetTiming]


def run_tree_bench(
    config: RunConfig,
    budgets: Sequence[int],
    top_k: int,
    context: int,
    repeats: int,
    device: str | None = None,
) -> TreeBenchResult:
    """Time a round's parts after a random `context`-token prompt: the drafter's block, then per
    budget the tree's construction and its verification forward (each first call untimed)."""
    if not budgets or min(budgets) < 1 or top_k < 1 or context < 1 or repeats < 1:
        raise UserError("bench tree: --budgets, --top-k, --context and --repeats must be >= 1")
    if is_hybrid(target_text_config(config.target)):  # before any weights load
        raise UserError(
            "bench tree: the target has linear-attention layers, which take no ancestor mask; "
            "time tree verification on an attention-only target"
        )
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    target = load_target(config, device)
    drafter = DFlashDrafter(DrafterArch.from_config(config, target), seed=config.train.seed, device=device)
    autocast = torch.bfloat16 if device.type == "cuda" and config.train.precision == "bf16" else None
    prompt = random_target_batch(target, 1, context + 1)[0]
    verifier = CachedTarget(target, DynamicCache(config=target.model.config))
    draft_cache = drafter.new_cache()
    with torch.inference_mode(), drafter_autocast(drafter, autocast):
        _, features = verifier.forward(prompt[:context], 1)
        verifier.commit(context)
        drafter.extend_context(features, torch.arange(context, device=device), draft_cache)

        def draft() -> torch.Tensor:
            return drafter.draft_logits(
                draft_cache, prompt[context], context, target.embed_tokens, target.lm_head
            )

        draft_ms = _time(draft, repeats, device)
        logits = draft()
        timings = []
        for budget in budgets:
            tree = build_tree(logits, budget, top_k)
            build_ms = _time(lambda budget=budget: build_tree(logits, budget, top_k), repeats, device)
            verify_ms = _time(lambda tree=tree: _verify(verifier, prompt[context], tree), repeats, device)
            timings.append(BudgetTiming(budget, len(tree.tokens), build_ms, verify_ms))
    return TreeBenchResult(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        target_layers=target.num_layers,
        vocab=target.vocab_size,
        context=context,
        depths=drafter.arch.block_size - 1,
        top_k=top_k,
        draft_ms=draft_ms,
        budgets=timings,
    )


def _verify(verifier: CachedTarget, root: torch.Tensor, tree: DraftTree) -> torch.Tensor:
    """The tree's verification forward after the cached context, which it leaves as it found it."""
    bias, positions = tree_verification_inputs(
        tree, verifier.cache.get_seq_length(), verifier.target.dtype, root.device
    )
    block = torch.cat([root[None], torch.tensor(tree.tokens, dtype=torch.long, device=root.device)])
    logits, _ = verifier.forward(block, len(block), bias, positions)
    verifier.commit(0)
    return logits


def _time(call: Callable[[], object], repeats: int, device: torch.device) -> list[float]:
    """Milliseconds of `repeats` calls after one untimed call, each to the device's completion."""
    call()
    synchronize(device)
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        synchronize(device)
        timings.append((time.perf_counter() - started) * 1e3)
    return timings


def format_report(result: TreeBenchResult) -> str:
    """Per budget: the tree's nodes, construction and verification medians, and their ratio."""
    lines = [
        f"device: {result.device}",
        f"target: {result.target_layers} layers, vocab {result.vocab}; context {result.context} tokens "
        f"(KV-cached); tree over {result.depths} depths, top-{result.top_k} per depth",
        f"drafter block forward (draft_logits): {statistics.median(result.draft_ms):.2f} ms",
        f"{'budget':>6} {'nodes':>6} {'build_tree ms':>14} {'verify forward ms':>18} {'build / verify':>15}",
    ]
    for timing in result.budgets:
        build, verify = statistics.median(timing.build_ms), statistics.median(timing.verify_ms)
        lines.append(
            f"{timing.budget:>6} {timing.nodes:>6} {build:>14.2f} {verify:>18.2f} {100 * build / verify:>14.1f}%"
        )
    return "\n".join(lines)
