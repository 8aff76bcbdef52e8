"""Dense fp32 y = x @ W^T for the few rows of a decode step (M <= 64): the matmuls of small targets and
of drafts, which the GPU computes in fp32 (models/loader.py: FP32_MAX_PARAMS).

Why our own: on the default pair (SmolLM2-135M, 576-wide) every matrix is a few MB, so a step is bound by
launch latency, not bytes, and cuBLAS's fp32 GEMM for 16-23 rows took ~5 us a launch against its GEMV's
~3 us at one row: 1.41 ms of the 2.93 ms tree step in 272 launches (bench/results/h200-launch-cuts-
2026-12-03/profile_pair.log). cuBLAS also picks other kernels for 1 and for 23 rows, so a verify row is
not computed as the AR step computes it; losslessness then rests on fp32 rounding differences never
flipping a greedy near-tie (on the H200 cuBLAS's rows of 15-64-row calls differ from its 1-row calls:
bench/results/h200-dense-matmul-2026-12-04). Here every row is computed by one instruction sequence
whatever M is: the program's (BN, BM) tile accumulates tensor-core dots over K in a fixed order, K-splits
come from the matrix shape only, and their partial sums are added in split order (qmatmul's `_finish`:
by the tile's last program, or a second launch). So row m of an M-row call equals a 1-row call on x[m]
bit for bit (checked on the H200 by bench/gpu_dense_matmul.py, on the CPU under TRITON_INTERPRET=1 by the
tests).

The dots are tf32x3: each fp32 operand split into a TF32 part and a TF32 remainder, three TF32 products
(the remainders' product dropped), ~fp32 accuracy (the checks bound it at 2e-6 of the largest output).
fp32 FMA dots (`input_precision="ieee"`) were 1.1-8x slower than cuBLAS at every shape of the pair.
A GEMV-like kernel (each program's W tile loaded once, x's rows taken a few at a time, exact fp32
products; 5f316c4) was measured and removed: at one row 3.9-7.5 us against this kernel's 5.8-10.0 (cuBLAS
3.5-6.6), but at the 16-23 rows of a draft block or a verify 2-6x slower than this kernel, and a matrix
must run one kernel for every M (bench/results/h200-rows-kernel-2026-12-04).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashtree.errors import FlashtreeError
from flashtree.kernels.launch import pdl_options, wait_for_inputs
from flashtree.kernels.qmatmul import _finish, k_splits, sum_splits, tile_counters

MAX_ROWS = 64  # above this many rows (prefill): cuBLAS, compute-bound there


def choose(speculative: bool) -> bool:
    """Whether an engine's target computes its decode rows with this kernel (layers.use_dense_kernel
    sets it): FLASHTREE_DENSE_KERNEL=1/0 if set; else for speculative decoding, where a verify row must
    equal the AR step's, and not for plain decoding, where cuBLAS's one-row GEMV is faster (3.6 vs 5-6
    us a launch on the pair's matrices: bench/results/h200-dense-matmul-2026-12-04)."""
    forced = os.environ.get("FLASHTREE_DENSE_KERNEL")
    return forced != "0" if forced is not None else speculative


@dataclass(frozen=True)
class DenseTiles:
    rows: int  # BN: output features per program
    k_block: int  # BK: K values per loop step
    warps: int
    stages: int
    programs: int  # K-splits are added until about this many programs run (qmatmul.k_splits)
    fused_sum: int = 1  # K-splits added by the tile's last program (1) or by a second launch (0)


DEFAULT_TILES = DenseTiles(rows=64, k_block=64, warps=4, stages=1, programs=264)
# Per matrix shape "NxK" (a matrix's tiles never depend on M: batch invariance): the SmolLM2-135M pair's,
# each the fastest over a speculative step's calls (draft block of 16 rows + verify of 23) in the sweep
# of bench/gpu_dense_matmul.py on the H200 (bench/results/h200-dense-matmul-2026-12-04/aef6cb2); other
# shapes take DEFAULT_TILES, the best single tile of the first tf32x3 sweep.
SHAPE_TILES: dict[str, DenseTiles] = {
    "960x576": DenseTiles(16, 32, 4, 2, 264),  # q/k/v
    "576x576": DenseTiles(16, 128, 4, 1, 264),  # o
    "3072x576": DenseTiles(64, 64, 4, 1, 264, fused_sum=0),  # gate/up
    "576x1536": DenseTiles(16, 32, 4, 2, 264),  # down
    "576x2880": DenseTiles(32, 32, 4, 2, 264),  # the draft's fc
    "49152x576": DenseTiles(64, 64, 4, 1, 264, fused_sum=0),  # LM head
}


def tiles_from_env() -> dict[str, DenseTiles]:
    """{"default": DEFAULT_TILES} | SHAPE_TILES, with overrides from FLASHTREE_DENSE_TILES (JSON {"default"
    or "NxK": [rows, k_block, warps, stages, programs(, fused_sum)]}), the way a tuning sweep hands its
    choice to a benchmark run."""
    tiles = {"default": DEFAULT_TILES} | SHAPE_TILES
    text = os.environ.get("FLASHTREE_DENSE_TILES")
    if not text:
        return tiles
    try:
        return tiles | {key: DenseTiles(*map(int, value)) for key, value in json.loads(text).items()}
    except (ValueError, TypeError, AttributeError) as e:
        raise FlashtreeError(
            'FLASHTREE_DENSE_TILES: expected JSON {"default" or "NxK": [rows, k_block, warps, stages,'
            f" programs(, fused_sum)]}} ({e})"
        ) from None


TILES = tiles_from_env()


def tiles_for(n: int, k: int) -> DenseTiles:
    return TILES.get(f"{n}x{k}", TILES["default"])


@triton.jit(do_not_specialize=["M", "N", "K", "stride_x", "stride_w", "per_split", "n_splits"])
def _dense_kernel(
    y_ptr, part_ptr, counter_ptr, x_ptr, w_ptr, M, N, K, stride_x, stride_w, per_split, n_splits,
    BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, FUSED_SUM: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """Program (i, s): output features [i * BN, i * BN + BN) of all M <= BM rows, over K blocks
    [s * per_split, s * per_split + per_split): acc (BN, BM) += W tile (BN, BK) . x^T tile (BK, BM), one
    tf32x3 dot per K block in K order."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    row_ok = rows < N
    split = tl.program_id(1)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    first = split * per_split
    last = tl.minimum(first + per_split, tl.cdiv(K, BK))
    wait_for_inputs(GDC)
    ms = tl.arange(0, BM)
    ks = tl.arange(0, BK)
    x_cols = x_ptr + ms[None, :] * stride_x
    acc = tl.zeros((BN, BM), tl.float32)
    for unit in range(first, last):
        k = unit * BK + ks
        w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
        xt = tl.load(x_cols + k[:, None], mask=(ms < M)[None, :] & (k < K)[:, None], other=0.0)
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


def dense_linear(x: torch.Tensor, weight: torch.Tensor, tiles: DenseTiles | None = None) -> torch.Tensor:
    """x (..., K) @ weight (N, K)^T -> (..., N), fp32, for at most MAX_ROWS rows of x (see the module doc).
    Works on CUDA tensors, and on CPU tensors under TRITON_INTERPRET=1."""
    n, k = weight.shape
    tiles = tiles or tiles_for(n, k)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        raise FlashtreeError("dense_linear: the weight's rows must be contiguous")
    m = x2.shape[0]
    bm = max(16, triton.next_power_of_2(m))  # the dot's smallest width; M = 1 padded with zero rows
    n_tiles = triton.cdiv(n, tiles.rows)
    n_splits, per_split = k_splits(n_tiles, triton.cdiv(k, tiles.k_block), tiles.programs)
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    parts = y if n_splits == 1 else torch.empty(n_splits, m, n, dtype=torch.float32, device=x.device)
    _dense_kernel[(n_tiles, n_splits)](
        y, parts, tile_counters(x.device, n_tiles), x2, weight, m, n, k, x2.stride(0), weight.stride(0),
        per_split, n_splits, BN=tiles.rows, BM=bm, BK=tiles.k_block,
        FUSED_SUM=bool(tiles.fused_sum), num_warps=tiles.warps, num_stages=tiles.stages, **pdl_options(y),
    )  # fmt: skip
    if n_splits > 1 and not tiles.fused_sum:
        sum_splits(y, parts)
    return y.view(*x.shape[:-1], n)
