"""Cross-entropy over a chunk of LM-head logits and its gradient, in place, for draft training
(train/loss.py FrozenHeadCrossEntropy).

Why: the torch path casts each chunk of bf16 logits to fp32 and walks it about ten times (logsumexp's
temporaries, argmax, subtract, exp, scale, cast back), and the loss is memory-bound
(bench/results/draft-training). Here a chunk is read twice and written once in its own dtype: one
program a row reduces (max, sum of exponentials, first argmax) in fp32, then a second kernel overwrites
the logits with (softmax - onehot(label)) * w, the gradient rows the caller multiplies by the head. Same
math as the torch path: fp32 exponentials and sums, one rounding to the logits' dtype.
"""

from __future__ import annotations

import torch

from flashtree import kernels
from flashtree.kernels import tl, triton

STATS_BLOCK = 2048
GRAD_BLOCK = 4096
FAR_BELOW = -1e30  # a running max that no logit is under; exp(FAR_BELOW - m) is 0 for any real m


@triton.jit
def _row_stats_kernel(
    logits_ptr, labels_ptr, lse_ptr, target_ptr, argmax_ptr, V, stride, FAR: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    """Row program_id(0): log-sum-exp, the label's logit and the first index of the maximum. Each lane
    keeps its running max, its sum of exp(x - max) and the first column where it saw the max."""
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    cols = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], FAR, tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    first = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        idx = start + cols
        x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, x)
        s = s * tl.exp(m - new_m) + tl.exp(x - new_m)
        first = tl.where(x > m, idx, first)  # strictly greater: a lane keeps its earliest maximum
        m = new_m
    top = tl.max(m, axis=0)
    total = tl.sum(s * tl.exp(m - top), axis=0)
    tl.store(lse_ptr + row, top + tl.log(total))
    tl.store(argmax_ptr + row, tl.min(tl.where(m == top, first, V), axis=0))
    label = tl.load(labels_ptr + row)
    tl.store(target_ptr + row, tl.load(base + label).to(tl.float32))


@triton.jit
def _softmax_grad_kernel(logits_ptr, lse_ptr, labels_ptr, w_ptr, V, stride, BLOCK: tl.constexpr):
    """Columns [j * BLOCK, (j + 1) * BLOCK) of row i = program_id(0, 1), in place:
    (exp(x - lse_i) - [col == label_i]) * w_i."""
    row = tl.program_id(0)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < V
    ptrs = logits_ptr + row.to(tl.int64) * stride + idx
    x = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + row)
    p = tl.exp(x - tl.load(lse_ptr + row))
    g = (p - tl.where(idx == tl.load(labels_ptr + row), 1.0, 0.0)) * w
    tl.store(ptrs, g.to(logits_ptr.dtype.element_ty), mask=ok)


def cross_entropy_rows(
    logits: torch.Tensor, labels: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For (rows, V) logits, int64 labels and fp32 row weights: the weighted cross-entropy
    sum_i w_i * (lse_i - x_i,label) (fp32 scalar), whether each row's first argmax is its label, and
    d loss / d logits = (softmax - onehot(label)) * w, which may overwrite `logits`: on the GPU the
    kernels (in the logits' dtype), elsewhere the torch path (fp32 or wider)."""
    if kernels.triton_kernels_for(logits):
        return cross_entropy_rows_triton(logits, labels, w)
    return cross_entropy_rows_torch(logits, labels, w)


def cross_entropy_rows_triton(
    logits: torch.Tensor, labels: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, vocab = logits.shape
    assert logits.stride(1) == 1
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    target = torch.empty_like(lse)
    argmax = torch.empty(rows, dtype=torch.int32, device=logits.device)
    _row_stats_kernel[(rows,)](
        logits, labels, lse, target, argmax, vocab, logits.stride(0), FAR=FAR_BELOW, BLOCK=STATS_BLOCK,
        num_warps=8,
    )  # fmt: skip
    _softmax_grad_kernel[(rows, triton.cdiv(vocab, GRAD_BLOCK))](
        logits, lse, labels, w, vocab, logits.stride(0), BLOCK=GRAD_BLOCK, num_warps=8
    )
    return ((lse - target) * w).sum(), argmax == labels, logits


def cross_entropy_rows_torch(
    logits: torch.Tensor, labels: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 logits are summed in fp32
    lse = x.logsumexp(-1)
    loss = ((lse - x.gather(1, labels[:, None]).squeeze(1)) * w).sum()
    correct = x.argmax(-1) == labels
    probs = x.sub_(lse[:, None]).exp_()  # softmax, in place
    probs.scatter_add_(1, labels[:, None], -torch.ones_like(lse)[:, None])
    return loss, correct, probs.mul_(w[:, None])
