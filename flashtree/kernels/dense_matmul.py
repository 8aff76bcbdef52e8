"""Dense fp32 y = x @ W^T for the few rows of a decode step (M <= 64): the matmuls of small targets and
of drafts, which the GPU computes in fp32 (models/loader.py: FP32_MAX_PARAMS).

Why our own: small models' steps are launch-bound, and cuBLAS picks other kernels for 1 and for 23 rows,
so its verify row is not the AR step's (bench/results/h200-dense-matmul-2026-12-04). Here every row is
computed by one instruction sequence whatever M is: the program's (BN, BM) tile accumulates tensor-core
dots over K in a fixed order, K-splits come from the matrix shape only, and their partial sums are added
in split order (qmatmul's `_finish` or `sum_splits`). So row m of an M-row call equals a 1-row call on
x[m] bit for bit. The dots are tf32x3 (each fp32 operand as a TF32 part and remainder, three products):
~fp32 accuracy, bounded at 2e-6 of the largest output by the tests.
"""

from __future__ import annotations

import torch

from flashtree.errors import FlashtreeError
from flashtree.kernels import tl, triton
from flashtree.kernels.launch import pdl_options, wait_for_inputs
from flashtree.kernels.qmatmul import _finish, _split_rows, k_splits, sum_splits, tile_counters
from flashtree.kernels.tiles import DEFAULT_KERNELS, DenseTiles, KernelConfig

MAX_ROWS = 64  # above this many rows (prefill): cuBLAS, compute-bound there


def tiles_for(n: int, k: int, kernels: KernelConfig = DEFAULT_KERNELS) -> DenseTiles:
    return kernels.dense_tiles_for(n, k)


@triton.jit(do_not_specialize=["M", "N", "K", "stride_x", "stride_w", "per_split", "n_splits"])
def _dense_kernel(
    y_ptr, part_ptr, counter_ptr, x_ptr, up_ptr, w_ptr, M, N, K, stride_x, stride_w, per_split, n_splits,
    BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, FUSED_SUM: tl.constexpr, SWIGLU: tl.constexpr,
    GDC: tl.constexpr,
):  # fmt: skip
    """Program (i, s): output features [i * BN, i * BN + BN) of all M <= BM rows, over K blocks
    [s * per_split, s * per_split + per_split): acc (BN, BM) += W tile (BN, BK) . x^T tile (BK, BM), one
    tf32x3 dot per K block in K order. SWIGLU: x is SwiGLU's gate and the product's input silu(x) * up
    (up read at x's offsets from up_ptr), made as the tile is loaded: no launch of its own."""
    rows, row_ok, split, first, last = _split_rows(BN, N, per_split, tl.cdiv(K, BK))
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    wait_for_inputs(GDC)
    ms = tl.arange(0, BM)
    ks = tl.arange(0, BK)
    x_cols = x_ptr + ms[None, :] * stride_x
    up_cols = up_ptr + ms[None, :] * stride_x
    acc = tl.zeros((BN, BM), tl.float32)
    for unit in range(first, last):
        k = unit * BK + ks
        w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
        x_ok = (ms < M)[None, :] & (k < K)[:, None]
        xt = tl.load(x_cols + k[:, None], mask=x_ok, other=0.0)
        if SWIGLU:  # fused.gate_mul's fp32 silu(gate) * up; padding stays 0 (silu(0) * 0)
            up = tl.load(up_cols + k[:, None], mask=x_ok, other=0.0)
            xt = xt / (1.0 + tl.exp(-xt)) * up
        acc = tl.dot(w, xt, acc, input_precision="tf32x3")
    at, ok = ms[None, :] * N + rows[:, None], row_ok[:, None] & (ms < M)[None, :]
    _finish(y_ptr, part_ptr, counter_ptr, acc, at, ok, split, n_splits, M * N, FUSED_SUM)


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether dense_linear takes this product: fp32 x and W, at most MAX_ROWS rows of x."""
    return (
        x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.numel() // max(1, x.shape[-1]) <= MAX_ROWS
    )


def dense_linear(
    x: torch.Tensor, weight: torch.Tensor, tiles: DenseTiles | None = None, up: torch.Tensor | None = None
) -> torch.Tensor:
    """x (..., K) @ weight (N, K)^T -> (..., N), fp32, for at most MAX_ROWS rows of x (see the module doc).
    With `up` (x's shape): (silu(x) * up) @ weight^T, SwiGLU's activation made in the same launch, as
    fused.gate_mul makes it. Works on CUDA tensors, and on CPU tensors under TRITON_INTERPRET=1."""
    n, k = weight.shape
    tiles = tiles or tiles_for(n, k)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    up2 = x2 if up is None else up.reshape(-1, k)
    if up2.stride() != x2.stride():  # the kernel reads both with x's row stride
        x2, up2 = x2.contiguous(), up2.contiguous()
    if weight.stride(-1) != 1:
        raise FlashtreeError("dense_linear: the weight's rows must be contiguous")
    m = x2.shape[0]
    bm = max(16, triton.next_power_of_2(m))  # the dot's smallest width; M = 1 padded with zero rows
    n_tiles = triton.cdiv(n, tiles.rows)
    n_splits, per_split = k_splits(n_tiles, triton.cdiv(k, tiles.k_block), tiles.programs)
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    parts = y if n_splits == 1 else torch.empty(n_splits, m, n, dtype=torch.float32, device=x.device)
    _dense_kernel[(n_tiles, n_splits)](
        y, parts, tile_counters(x.device, n_tiles), x2, up2, weight, m, n, k, x2.stride(0), weight.stride(0),
        per_split, n_splits, BN=tiles.rows, BM=bm, BK=tiles.k_block, FUSED_SUM=bool(tiles.fused_sum),
        SWIGLU=up is not None, num_warps=tiles.warps, num_stages=tiles.stages, **pdl_options(y),
    )  # fmt: skip
    if n_splits > 1 and not tiles.fused_sum:
        sum_splits(y, parts)
    return y.view(*x.shape[:-1], n)
