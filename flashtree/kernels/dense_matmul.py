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

from typing import NamedTuple

import torch

from flashtree.errors import FlashtreeError
from flashtree.kernels import tl, triton
from flashtree.kernels.launch import pdl_options, wait_for_inputs
from flashtree.kernels.qmatmul import _finish, _split_rows, k_splits, sum_splits, tile_counters
from flashtree.kernels.tiles import DEFAULT_KERNELS, DenseTiles, KernelConfig

MAX_ROWS = 64  # above this many rows (prefill): cuBLAS, compute-bound there


def tiles_for(n: int, k: int, kernels: KernelConfig = DEFAULT_KERNELS) -> DenseTiles:
    return kernels.dense_tiles_for(n, k)


@triton.jit
def _input_tile(x_cols, other_cols, k, x_ok, SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr):
    """x^T's tile (BK, BM) at K offsets k: x, or SwiGLU's fp32 silu(x) * up as fused.gate_mul makes it
    (other = up; padding stays 0, silu(0) * 0), or x + residual (other = the residual)."""
    xt = tl.load(x_cols + k[:, None], mask=x_ok, other=0.0)
    if SWIGLU:
        up = tl.load(other_cols + k[:, None], mask=x_ok, other=0.0)
        xt = xt / (1.0 + tl.exp(-xt)) * up
    if RESIDUAL:
        xt = xt + tl.load(other_cols + k[:, None], mask=x_ok, other=0.0)
    return xt


@triton.jit(do_not_specialize=["M", "N", "K", "stride_x", "stride_w", "per_split", "n_splits"])
def _dense_kernel(
    y_ptr, part_ptr, counter_ptr, x_ptr, other_ptr, w_ptr, norm_ptr, total_ptr, M, N, K, stride_x, stride_w,
    per_split, n_splits, eps, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, FUSED_SUM: tl.constexpr,
    SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr, NORM: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """Program (i, s): output features [i * BN, i * BN + BN) of all M <= BM rows, over K blocks
    [s * per_split, s * per_split + per_split): acc (BN, BM) += W tile (BN, BK) . x^T tile (BK, BM), one
    tf32x3 dot per K block in K order. The input is made as its tiles load, no launch of its own:
    SWIGLU, silu(x) * up (x SwiGLU's gate, up at other_ptr); RESIDUAL, x + the residual at other_ptr,
    stored to total_ptr (M, K) by the first row tile's programs; NORM, that row's RMSNorm times the weight
    at norm_ptr, as fused.rms_norm computes it but for the sum of squares: a tf32x3 dot with ones over
    the whole row (every program), whose rows come out alike whatever M is, as the product's do."""
    rows, row_ok, split, first, last = _split_rows(BN, N, per_split, tl.cdiv(K, BK))
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    wait_for_inputs(GDC)
    ms = tl.arange(0, BM)
    ks = tl.arange(0, BK)
    x_cols = x_ptr + ms[None, :] * stride_x
    other_cols = other_ptr + ms[None, :] * stride_x
    if NORM:
        squares = tl.zeros((16, BM), tl.float32)
        ones = tl.full((16, BK), 1.0, tl.float32)
        for unit in range(0, tl.cdiv(K, BK)):
            k = unit * BK + ks
            xt = _input_tile(x_cols, other_cols, k, (ms < M)[None, :] & (k < K)[:, None], SWIGLU, RESIDUAL)
            squares = tl.dot(ones, xt * xt, squares, input_precision="tf32x3")
        rstd = 1.0 / tl.sqrt_rn(tl.max(squares, axis=0) / K + eps)  # (BM,): the 16 rows are equal
    acc = tl.zeros((BN, BM), tl.float32)
    for unit in range(first, last):
        k = unit * BK + ks
        w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
        x_ok = (ms < M)[None, :] & (k < K)[:, None]
        xt = _input_tile(x_cols, other_cols, k, x_ok, SWIGLU, RESIDUAL)
        if RESIDUAL:  # the first row tile's programs store the sum, each its own K blocks
            first_tile = (ms * 0 + tl.program_id(0)) == 0
            tl.store(total_ptr + ms[None, :] * K + k[:, None], xt, mask=x_ok & first_tile[None, :])
        if NORM:
            xt = xt * rstd[None, :] * tl.load(norm_ptr + k, mask=k < K, other=0.0)[:, None]
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


class Norm(NamedTuple):
    """An RMSNorm a product applies to its input x as it loads it (dense_linear's `norm`): of x + residual
    when a residual is given, that sum then stored to `total` (x's shape, contiguous)."""

    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None
    total: torch.Tensor | None = None


def dense_linear(
    x: torch.Tensor, weight: torch.Tensor, tiles: DenseTiles | None = None, up: torch.Tensor | None = None,
    norm: Norm | None = None,
) -> torch.Tensor:  # fmt: skip
    """x (..., K) @ weight (N, K)^T -> (..., N), fp32, for at most MAX_ROWS rows of x (see the module doc).
    With `up` (x's shape): (silu(x) * up) @ weight^T, SwiGLU's activation made in the same launch, as
    fused.gate_mul makes it; with `norm`, the product of x's (or x + residual's) RMSNorm, made in the same
    launch (see _dense_kernel). Works on CUDA tensors, and on CPU tensors under TRITON_INTERPRET=1."""
    n, k = weight.shape
    tiles = tiles or tiles_for(n, k)
    if up is not None and norm is not None and norm.residual is not None:
        raise ValueError("dense_linear: SwiGLU's up and a residual share the kernel's second input")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    other = up if up is not None else norm.residual if norm is not None else None
    other2 = x2 if other is None else other.reshape(-1, k)
    if other2.stride() != x2.stride():  # the kernel reads both with x's row stride
        x2, other2 = x2.contiguous(), other2.contiguous()
    if weight.stride(-1) != 1:
        raise FlashtreeError("dense_linear: the weight's rows must be contiguous")
    residual = norm is not None and norm.residual is not None
    if residual and not (norm.total.is_contiguous() and norm.total.numel() == x2.numel()):
        raise ValueError("dense_linear: norm.total must be a contiguous tensor of x's size")
    m = x2.shape[0]
    bm = max(16, triton.next_power_of_2(m))  # the dot's smallest width; M = 1 padded with zero rows
    n_tiles = triton.cdiv(n, tiles.rows)
    n_splits, per_split = k_splits(n_tiles, triton.cdiv(k, tiles.k_block), tiles.programs)
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    parts = y if n_splits == 1 else torch.empty(n_splits, m, n, dtype=torch.float32, device=x.device)
    norm_weight = norm.weight if norm is not None else weight
    total = norm.total if residual else y
    _dense_kernel[(n_tiles, n_splits)](
        y, parts, tile_counters(x.device, n_tiles), x2, other2, weight, norm_weight, total, m, n, k,
        x2.stride(0), weight.stride(0), per_split, n_splits, norm.eps if norm is not None else 0.0,
        BN=tiles.rows, BM=bm, BK=tiles.k_block, FUSED_SUM=bool(tiles.fused_sum), SWIGLU=up is not None,
        RESIDUAL=residual, NORM=norm is not None, num_warps=tiles.warps, num_stages=tiles.stages,
        **pdl_options(y),
    )  # fmt: skip
    if n_splits > 1 and not tiles.fused_sum:
        sum_splits(y, parts)
    return y.view(*x.shape[:-1], n)
