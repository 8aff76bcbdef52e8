"""The CPU's torch path with every decode row computed as the AR step computes it (issue #39).

A speculating engine keeps the verify's K/V, so a verify row must equal the AR step's row bit for bit, or a
KV cache that rounds (bf16, q8_0, ...) can store other values than AR would. On the GPU our kernels are
batch-invariant; on the CPU, BLAS picks its GEMM kernel by the number of rows (MKL: 1, 2, 4, 8 and 16+
rows differ, bench/results/cpu-kv-quality-2026-12-06) and so does SDPA. Here a linear computes its rows
in fixed blocks of BLOCK_ROWS (the last one padded), so every row comes out of one same-shape GEMM, and
attention computes each row alone over exactly the keys its AR step reads (KVCache.attend_each_row), when
an engine speculates (models.layers.use_row_invariant); the elementwise ops whose vector and scalar code
round apart are padded always (cheap)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

BLOCK_ROWS = 32  # a budget-22 tree's 23 rows in one call; MKL computed each row alike at any place
# More rows: a prefill chunk (plain F.linear; the engines sharing a model prefill alike). A verify of more
# rows is not row-invariant, as on the GPU (dense_matmul.MAX_ROWS).
DECODE_ROWS = 64
VECTOR_PAD = 64  # values: a multiple of torch's vector loop step (2 vectors of 32 bf16 or 16 fp32)


@functools.cache
def block_rows(dtype: torch.dtype) -> int:
    """BLOCK_ROWS where this machine's BLAS computes a row of a BLOCK_ROWS-row product the same whatever
    its place in the block and the other rows (checked once per process and dtype, on tiny shapes), else
    1: one-row calls, the same shape and place every time."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 96, generator=gen).to(dtype)
    x = torch.randn(BLOCK_ROWS, 96, generator=gen).to(dtype)
    y = F.linear(x, w)
    others = torch.randn(BLOCK_ROWS, 96, generator=gen).to(dtype)
    for place in range(BLOCK_ROWS):  # row 0 at every place, among other rows
        moved = others.clone()
        moved[place] = x[0]
        if not torch.equal(F.linear(moved, w)[place], y[0]):
            return 1
    if not torch.equal(F.linear(torch.roll(x, 5, 0), w), torch.roll(y, 5, 0)):
        return 1
    return BLOCK_ROWS


def wanted(on: bool, x: torch.Tensor) -> bool:
    """Whether a module whose row_invariant flag is `on` computes x's rows here: on the CPU, outside
    autograd (the self-check is of the CPU's BLAS; a GPU's torch path keeps its plain calls)."""
    return on and x.device.type == "cpu" and not torch.is_grad_enabled()


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) with every row of x (..., K) computed by the same call whatever the number of
    rows: in zero-padded blocks of block_rows(dtype) rows (up to DECODE_ROWS rows; more: plain F.linear)."""
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    if m > DECODE_ROWS:
        return F.linear(x, weight)
    b = block_rows(x2.dtype)
    padded = F.pad(x2, (0, 0, 0, (-m) % b))
    y = torch.cat([F.linear(padded[i : i + b], weight) for i in range(0, padded.shape[0], b)])
    return y[:m].reshape(*x.shape[:-1], weight.shape[0])


def elementwise(op, x: torch.Tensor) -> torch.Tensor:
    """op(x) for a torch elementwise op, each value computed alike wherever it lies: torch runs a tensor's
    tail past its vector loop through a scalar op, which rounds sigmoid, silu and softplus otherwise, so
    the last dim is zero-padded to a multiple of VECTOR_PAD values (one thread: a split of a large
    tensor across threads may still leave tails)."""
    n = x.shape[-1]
    if n % VECTOR_PAD == 0:
        return op(x)
    return op(F.pad(x, (0, (-n) % VECTOR_PAD)))[..., :n]
