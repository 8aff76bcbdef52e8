"""NeoX-style (rotate-half) rotary embedding in one Triton launch, where torch runs ~6 kernels (neg,
cat, two muls, add, and a cat for partial rotary) for q and again for k of every attention layer:
launches, not bytes, bound a decode step of a small model (see README, default pair).

The two products and their sum are rounded to x's dtype one at a time, as torch's separate ops round
them (fp32 math, rounded to bf16 for bf16 tensors), and the kernel is compiled without fp fusion (no
fma), so the result equals `layers.apply_rotary`'s torch path bit for bit: using the kernel changes no
output, and each row is computed alone, so an AR step and a verify row agree. Tests compare the two
under TRITON_INTERPRET=1; bench/gpu_small_kernels.py on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rounded(v, BF16: tl.constexpr):
    """fp32 v rounded to the nearest bf16 (ties to even), kept in fp32; v itself for fp32 tensors.
    In integer ops: Triton's interpreter (the CPU tests) truncates in its fp32 -> bf16 casts."""
    if BF16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        v = bits.to(tl.float32, bitcast=True)
    return v


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, stride_t, stride_h, H, D: tl.constexpr, ROT: tl.constexpr,
    BD: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    """Program (t, h): head h of token t, its first ROT dims rotated, the rest copied."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BD)
    half = ROT // 2
    rotating = d < ROT
    row = x_ptr + t * stride_t + h * stride_h
    x = tl.load(row + d, mask=d < D, other=0.0).to(tl.float32)
    partner = tl.load(row + tl.where(d < half, d + half, d - half), mask=rotating, other=0.0).to(tl.float32)
    rotated = tl.where(d < half, -partner, partner)  # cat([-x2, x1])
    cos = tl.load(cos_ptr + t * ROT + d, mask=rotating, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * ROT + d, mask=rotating, other=0.0).to(tl.float32)
    y = rounded(rounded(x * cos, BF16) + rounded(rotated * sin, BF16), BF16)
    out = tl.where(rotating, y, x)  # values of x's dtype: the store's cast is exact
    tl.store(out_ptr + (t * H + h) * D + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, head_dim) fp32 or bf16, unit stride along head_dim; cos / sin (T, rot) in x's dtype.
    Returns a new contiguous (T, heads, head_dim) tensor: `layers.apply_rotary`'s result."""
    t, h, d = x.shape
    rot = cos.shape[-1]
    out = torch.empty(t, h, d, dtype=x.dtype, device=x.device)
    _rotary_kernel[(t, h)](
        x, cos.contiguous(), sin.contiguous(), out, x.stride(0), x.stride(1), h, D=d, ROT=rot,
        BD=triton.next_power_of_2(d), BF16=x.dtype == torch.bfloat16, enable_fp_fusion=False,
    )  # fmt: skip
    return out
