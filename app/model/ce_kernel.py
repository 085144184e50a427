"""The loss's cross-entropy chunk on CUDA: one Triton kernel, two passes over each row of logits.

`weighted_ce_chunk` (app/model/objective.py) says what a chunk computes; this is the same in the
bytes it needs. Per row of `logits [n, V]`, one program: the first pass keeps, per lane, a running
max, the sum of exponentials under it (the online softmax) and the first index of the largest logit;
the second pass writes `w * (softmax - one_hot)` over the logits in place. So the logits are read
twice and written once, and the chunk allocates no vocab-sized buffer. Each row's weighted CE goes
to a buffer of `n` floats before the sum; a caller that needs the rows (the acceptance objectives,
app/model/acceptance.py) hands that buffer in. Inductor's kernel for the same expression ran at a
third of the memory bandwidth (its argmax in the loop of the online softmax); this one takes about
60% of its time (BENCHMARKS.md, 2026-12-02, fifth session).

Triton compiles it at the first call for the run's vocab and logits dtype (`VOCAB` is a constant of
the kernel, and a run has one); `dflash build-cache` bakes that compile into the cache entry, so a
warm start loads it (app/compile/build.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096
"""Logits per loop iteration of a row's program: 8 per thread at 16 warps (measured on an H200 against
2048 to 16384 at 4 to 32 warps: within 3% of the best at both production vocabs)."""
WARPS = 16


@triton.jit
def _weighted_ce_rows(
    logits_ptr,
    labels_ptr,
    weights_ptr,
    loss_ptr,
    argmax_ptr,
    stride,
    VOCAB: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * stride
    lanes = tl.arange(0, BLOCK)
    # a finite floor instead of -inf: (floor - floor) is 0 where (-inf - -inf) would be nan
    floor = -3.0e38
    running_max = tl.full([BLOCK], floor, tl.float32)
    running_sum = tl.zeros([BLOCK], tl.float32)
    best = tl.full([BLOCK], floor, tl.float32)
    best_index = tl.zeros([BLOCK], tl.int32)
    for start in range(0, VOCAB, BLOCK):
        index = start + lanes
        x = tl.load(logits_ptr + index, mask=index < VOCAB, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, x)
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.exp(x - new_max)
        running_max = new_max
        better = x > best  # strict: a lane keeps the first index of its largest logit
        best_index = tl.where(better, index, best_index)
        best = tl.where(better, x, best)
    row_max = tl.max(running_max, 0)
    total = tl.sum(running_sum * tl.exp(running_max - row_max), 0)
    top = tl.max(best, 0)
    tl.store(argmax_ptr + row, tl.min(tl.where(best == top, best_index, VOCAB), 0).to(tl.int64))
    label = tl.load(labels_ptr + row)
    weight = tl.load(weights_ptr + row)
    label_logit = tl.load(logits_ptr + label).to(tl.float32)
    tl.store(loss_ptr + row, (row_max + tl.log(total) - label_logit) * weight)
    scale = weight / total
    for start in range(0, VOCAB, BLOCK):
        index = start + lanes
        inside = index < VOCAB
        x = tl.load(logits_ptr + index, mask=inside, other=0.0).to(tl.float32)
        grad = tl.exp(x - row_max) * scale - tl.where(index == label, weight, 0.0)
        tl.store(logits_ptr + index, grad.to(logits_ptr.dtype.element_ty), mask=inside)


def forget_compiled_kernel() -> None:
    """Drop the compiled copies Triton holds of the kernel in this process's memory, so its next call
    goes through Triton's cache dir: build-cache bakes what that call writes there, also in a process
    that ran the kernel before (a notebook, the test suite)."""
    _weighted_ce_rows.device_caches.clear()


def triton_ce_chunk(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, row_ce: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`weighted_ce_chunk`'s (weighted CE sum, d/d logits, argmax) for `logits [n, V]`, labels `[n]`
    and weights `[n]`; the gradient is written over `logits`, which comes back as the second value
    (the caller's logits are spent). `row_ce` (`[n]` fp32, contiguous), when given, receives each
    row's weighted CE: the kernel writes its rows there instead of into a buffer of its own, so that
    output costs nothing."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("triton_ce_chunk: the logits' vocab dim must be contiguous")
    if row_ce is None:
        loss = torch.empty(rows, device=logits.device, dtype=torch.float32)
    elif row_ce.shape != (rows,) or row_ce.dtype != torch.float32 or not row_ce.is_contiguous():
        raise ValueError("triton_ce_chunk: row_ce must be a contiguous fp32 [n] buffer")
    else:
        loss = row_ce
    predictions = torch.empty(rows, device=logits.device, dtype=torch.long)
    _weighted_ce_rows[(rows,)](
        logits,
        labels,
        weights.float(),
        loss,
        predictions,
        logits.stride(0),
        VOCAB=vocab,
        BLOCK=BLOCK,
        num_warps=WARPS,
    )
    return loss.sum(), logits, predictions
