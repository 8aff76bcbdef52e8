"""Small fused kernels for the decode and verify steps: RMSNorm (optionally after a residual add, or
followed by a SiLU gate) and a gate's activation times a value (SwiGLU's silu(gate) * up, the attention
output's x * sigmoid(gate)), one Triton launch each.

Why: a decode step at batch 1 is bound by kernel launches outside its matmuls, and torch runs each of
these as two to five (bench/results/h200-step-2026-12-03). Every row is one program reducing in a fixed
order that depends on the row length only, so a row's result is the same bits whatever the number of
rows (a verify pass agrees with the AR step). Against the torch path they differ by fp32 rounding order
only (the tests bound it); the math is the same: fp32 norm, products in fp32, one rounding to the output
dtype.
"""

from __future__ import annotations

import torch

from flashtree.kernels import tl, triton
from flashtree.kernels.launch import pdl_options, wait_for_inputs
from flashtree.kernels.qmatmul import QuantizedActivations, quantize_blocks
from flashtree.kernels.rotary import rounded


@triton.jit
def _rms_norm_kernel(
    out_ptr, x_ptr, w_ptr, res_ptr, sum_ptr, gate_ptr, xq_ptr, scale_ptr, xqs_ptr, n_inner, D,
    stride_xo, stride_xi, stride_ro, stride_ri, stride_go, stride_gi, eps,
    HAS_RESIDUAL: tl.constexpr, HAS_GATE: tl.constexpr, BLOCK: tl.constexpr, X_BF16: tl.constexpr,
    OUT_BF16: tl.constexpr, QUANT: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """Row (o, i) of (outer, inner, D) tensors: [sum = x + res;] y = norm(sum or x) * w [* silu(gate)].
    bf16 results are rounded by `rounded` (ties to even, as the GPU's cast; the interpreter's truncates).
    QUANT: the int8 quantization of y, all rows read as one flat row (one token), for the matmul it feeds,
    as qmatmul.quantize_activations would make it."""
    wait_for_inputs(GDC)
    o, i = tl.program_id(0) // n_inner, tl.program_id(0) % n_inner
    cols = tl.arange(0, BLOCK)
    ok = cols < D
    x = tl.load(x_ptr + o * stride_xo + i * stride_xi + cols, mask=ok, other=0.0).to(tl.float32)
    # every load before the reduction, in flight together (after its barriers each would wait alone)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_GATE:
        g = tl.load(gate_ptr + o * stride_go + i * stride_gi + cols, mask=ok, other=0.0).to(tl.float32)
    row = tl.program_id(0) * D + cols  # contiguous outputs
    if HAS_RESIDUAL:  # rounded to the inputs' dtype once, as torch adds them
        res = tl.load(res_ptr + o * stride_ro + i * stride_ri + cols, mask=ok, other=0.0).to(tl.float32)
        x = rounded(x + res, X_BF16)
        tl.store(sum_ptr + row, x.to(sum_ptr.dtype.element_ty), mask=ok)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / D + eps)
    y = x * rstd * w
    if HAS_GATE:
        y = y * (g / (1.0 + tl.exp(-g)))
    y = rounded(y, OUT_BF16)
    tl.store(out_ptr + row, y.to(out_ptr.dtype.element_ty), mask=ok)
    if QUANT:  # this row's blocks of the flat row; columns past D are zeros of blocks not stored
        local = tl.arange(0, BLOCK // 32)
        blocks = tl.program_id(0) * (D // 32) + local
        quantize_blocks(tl.reshape(y, (BLOCK // 32, 8, 4)), blocks, local < D // 32, 0, 1, D // 32, xq_ptr,
                        scale_ptr, xqs_ptr)  # fmt: skip


def _int8_pointers(int8: QuantizedActivations | None, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The kernels' (codes, scales, code sums) arguments: `int8`'s buffers, sized for `out` as one row,
    or `out` thrice (never read) without them."""
    if int8 is None:
        return (out, out, out)
    if int8.codes.shape != (1, out.numel() // 4):
        raise ValueError(f"int8: buffers of one row of {out.numel()} values, not {tuple(int8.codes.shape)}")
    return tuple(int8)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as (outer, inner, D) with a unit last stride: a view when its strides allow (a head view of a
    merged projection's output does), else a copy."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 3:
        return x
    if x.dim() == 2:
        return x[:, None]
    return x.reshape(-1, 1, x.shape[-1])


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    int8: QuantizedActivations | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x's last dim in fp32, times weight, in out_dtype (default x's). With `residual`: of
    x + residual, returned too: (x + residual, its norm). With `gate` (x's shape): times silu(gate).
    int8 (one token: x's rows, heads say, read as one flat row; D a multiple of 32): buffers
    (qmatmul.new_activations(x.numel(), 1)) that receive the int8 quantization of that row for the matmul
    it feeds (qmatmul.MatmulInput), made in the same launch."""
    d = x.shape[-1]
    x3 = _rows(x)
    out = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    res3 = _rows(residual) if residual is not None else x3
    total = torch.empty_like(out, dtype=x.dtype) if residual is not None else out
    gate3 = _rows(gate.view(x.shape)) if gate is not None else x3
    block = triton.next_power_of_2(d)
    n_rows = x3.shape[0] * x3.shape[1]
    if int8 is not None and d % 32:
        raise ValueError(f"int8: rows of a multiple of 32 values, not {d}")
    act = _int8_pointers(int8, out)
    _rms_norm_kernel[(n_rows,)](
        out, x3, weight, res3, total, gate3, *act, x3.shape[1], d, x3.stride(0), x3.stride(1),
        res3.stride(0), res3.stride(1), gate3.stride(0), gate3.stride(1), eps,
        HAS_RESIDUAL=residual is not None, HAS_GATE=gate is not None, BLOCK=block,
        X_BF16=x.dtype == torch.bfloat16, OUT_BF16=out.dtype == torch.bfloat16, QUANT=int8 is not None,
        num_warps=max(1, min(8, block // 512)), enable_fp_fusion=False, **pdl_options(out),
    )  # fmt: skip
    return (total, out) if residual is not None else out


@triton.jit
def _gate_mul_kernel(
    out_ptr, gate_ptr, x_ptr, xq_ptr, scale_ptr, xqs_ptr, n_cols, stride_g, gate_inner, stride_gh, stride_x,
    BLOCK: tl.constexpr, BF16: tl.constexpr, SIGMOID: tl.constexpr, QUANT: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """out = act(gate) * x for columns [j * BLOCK, j * BLOCK + BLOCK) of row program_id(0), act = silu (or
    SIGMOID: sigmoid) in fp32 rounded to the inputs' dtype, then the product rounded, as torch's ops round.
    Gate column c of a row sits at (c // gate_inner) * stride_gh + c % gate_inner (heads of a strided
    view). QUANT (one row): the int8 quantization of these columns' blocks, as
    qmatmul.quantize_activations."""
    wait_for_inputs(GDC)
    row, cols = tl.program_id(0), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g_at = gate_ptr + row * stride_g + (cols // gate_inner) * stride_gh + cols % gate_inner
    g = tl.load(g_at, mask=ok, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    act = rounded((1.0 if SIGMOID else g) / (1.0 + tl.exp(-g)), BF16)  # sigmoid(g), or g * sigmoid(g)
    y = rounded(act * x, BF16)
    tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=ok)
    if QUANT:
        blocks = tl.program_id(1) * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
        n_blocks = n_cols // 32
        quantize_blocks(tl.reshape(y, (BLOCK // 32, 8, 4)), blocks, blocks < n_blocks, 0, 1, n_blocks, xq_ptr,
                        scale_ptr, xqs_ptr)  # fmt: skip


def gate_mul(
    gate: torch.Tensor, x: torch.Tensor, act: str = "silu", int8: QuantizedActivations | None = None
) -> torch.Tensor:
    """act(gate) * x, act "silu" (SwiGLU: gate and x the halves of a merged gate/up projection's output)
    or "sigmoid" (qwen3.5's attention output gate: gate (rows, heads, head_dim), a strided head view), x
    (rows, n), one launch. int8 (one row, n a multiple of 32): buffers (qmatmul.new_activations(n, 1))
    that receive the result's int8 quantization for the matmul it feeds (qmatmul.MatmulInput), made in
    the same launch."""
    gate, x = (t if t.stride(-1) == 1 else t.contiguous() for t in (gate, x))
    rows, n = x.shape
    inner, stride_gh = (n, 0) if gate.dim() == 2 else (gate.shape[-1], gate.stride(1))
    if int8 is not None and (rows != 1 or n % 32):
        raise ValueError(f"int8: one row of a multiple of 32 values, not {rows} x {n}")
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    quantized = _int8_pointers(int8, out)
    block = 1024
    _gate_mul_kernel[(rows, triton.cdiv(n, block))](
        out, gate, x, *quantized, n, gate.stride(0), inner, stride_gh, x.stride(0), BLOCK=block,
        BF16=x.dtype == torch.bfloat16, SIGMOID=act == "sigmoid", QUANT=int8 is not None, num_warps=4,
        enable_fp_fusion=False, **pdl_options(out),
    )  # fmt: skip
    return out
