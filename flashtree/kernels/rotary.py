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

from flashtree.kernels import tl, triton
from flashtree.kernels.kv_tiles import plane_args, store_row
from flashtree.kernels.launch import pdl_options, wait_for_inputs
from flashtree.quant.kv import KVPlane, as_plane, rotation_scale, rotation_signs, rotation_size


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
def _rotated_row(
    row, cos_ptr, sin_ptr, t, w_ptr, eps, D: tl.constexpr, ROT: tl.constexpr, BD: tl.constexpr,
    BF16: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    """One head of token t at `row`: its first ROT dims rotated, the rest as they are; (BD,) fp32
    holding values of the tensor's dtype (so the store's cast is exact). NORM: the head RMSNorm-ed
    first (weight w_ptr), as fused.rms_norm computes and rounds it (qwen3's q / k norms)."""
    d = tl.arange(0, BD)
    half = ROT // 2
    rotating = d < ROT
    across = tl.where(d < half, d + half, d - half)
    x = tl.load(row + d, mask=d < D, other=0.0).to(tl.float32)
    partner = tl.load(row + across, mask=rotating, other=0.0).to(tl.float32)
    if NORM:  # the partner's norm: its row's (this row's) rstd times its own weight
        rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / D + eps)
        x = rounded(x * rstd * tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32), BF16)
        partner = rounded(
            partner * rstd * tl.load(w_ptr + across, mask=rotating, other=0.0).to(tl.float32), BF16
        )
    rotated = tl.where(d < half, -partner, partner)  # cat([-x2, x1])
    cos = tl.load(cos_ptr + t * ROT + d, mask=rotating, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * ROT + d, mask=rotating, other=0.0).to(tl.float32)
    y = rounded(rounded(x * cos, BF16) + rounded(rotated * sin, BF16), BF16)
    return tl.where(rotating, y, x)


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, stride_t, stride_h, H, D: tl.constexpr, ROT: tl.constexpr,
    BD: tl.constexpr, BF16: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """Program (t, h): head h of token t."""
    wait_for_inputs(GDC)
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BD)
    out = _rotated_row(
        x_ptr + t * stride_t + h * stride_h, cos_ptr, sin_ptr, t, x_ptr, 0.0, D, ROT, BD, BF16, False
    )
    tl.store(out_ptr + (t * H + h) * D + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def _rotary_store_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, kd, ks, kh, skd_h, skd, sks_h, sks, skh_h, skh,
    vd, vs, vh, svd_h, svd, svs_h, svs, svh_h, svh, signs, slots_ptr, qw_ptr, kw_ptr,
    q_st, q_sh, k_st, k_sh, v_st, v_sh, NQ, eps, D: tl.constexpr, ROT: tl.constexpr, BD: tl.constexpr,
    BF16: tl.constexpr, NORM: tl.constexpr, KIND_K: tl.constexpr, KIND_V: tl.constexpr, R: tl.constexpr,
    RSCALE: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """Program (t, h): query head h of token t (h < NQ), else KV head h - NQ: its rotated K and its V
    stored at the token's cache slot, each in its plane's type (kernels/kv_tiles.py's store_row; kd, ks,
    kh: K's data, scale and high fields, s*_h / s* their head and slot strides). NORM: q and k
    RMSNorm-ed per head first (weights qw_ptr, kw_ptr)."""
    wait_for_inputs(GDC)
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BD)
    if h < NQ:
        out = _rotated_row(
            q_ptr + t * q_st + h * q_sh, cos_ptr, sin_ptr, t, qw_ptr, eps, D, ROT, BD, BF16, NORM
        )
        tl.store(q_out_ptr + (t * NQ + h) * D + d, out.to(q_out_ptr.dtype.element_ty), mask=d < D)
    else:
        j = h - NQ
        slot = tl.load(slots_ptr + t)
        k = _rotated_row(
            k_ptr + t * k_st + j * k_sh, cos_ptr, sin_ptr, t, kw_ptr, eps, D, ROT, BD, BF16, NORM
        )
        k_fields = kd + j * skd_h + slot * skd, ks + j * sks_h + slot * sks, kh + j * skh_h + slot * skh
        store_row(k, *k_fields, signs, D, BD, R, RSCALE, KIND_K)
        v = tl.load(v_ptr + t * v_st + j * v_sh + d, mask=d < D)
        if KIND_V != 0:  # quantized from fp32, as `quantize` is given it
            v = v.to(tl.float32)
        v_fields = vd + j * svd_h + slot * svd, vs + j * svs_h + slot * svs, vh + j * svh_h + slot * svh
        store_row(v, *v_fields, signs, D, BD, R, RSCALE, KIND_V)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, head_dim) fp32 or bf16, unit stride along head_dim; cos / sin (T, rot) in x's dtype.
    Returns a new contiguous (T, heads, head_dim) tensor: `layers.apply_rotary`'s result."""
    t, h, d = x.shape
    rot = cos.shape[-1]
    out = torch.empty(t, h, d, dtype=x.dtype, device=x.device)
    _rotary_kernel[(t, h)](
        x, cos.contiguous(), sin.contiguous(), out, x.stride(0), x.stride(1), h, D=d, ROT=rot,
        BD=triton.next_power_of_2(d), BF16=x.dtype == torch.bfloat16, enable_fp_fusion=False,
        **pdl_options(x),
    )  # fmt: skip
    return out


def rotary_store(
    q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor | KVPlane, v_cache: torch.Tensor | KVPlane, slots: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor | None:  # fmt: skip
    """One launch for an attention layer's RoPE and cache write: q (T, heads, hd) rotated into a new
    tensor (returned; None without q), k (T, n_kv, hd) rotated and v as it is stored at `slots` (T,) of
    the caches (n_kv, max_ctx, hd) or planes of any KV type (quantized as quant/kv.py's `quantize`
    does, bit for bit), unit stride along hd and slots. The same bits as two `rotary` calls and two
    index copies (four launches: a small model's decode step is bound by launches). norms (q's weight,
    k's, eps): q and k RMSNorm-ed per head first, as two fused.rms_norm launches would (qwen3's and
    qwen3.5's q / k norms: 2 launches fewer per attention layer and step)."""
    if q is None:  # keys and values only (the draft's context): no query programs
        rotary_store(k[:, :0], k, v, cos, sin, k_cache, v_cache, slots, norms)
        return None
    t, nq, d = q.shape
    n_kv = k.shape[1]
    q_out = torch.empty(t, nq, d, dtype=q.dtype, device=q.device)
    q_weight, k_weight, eps = norms or (q, q, 0.0)
    *k_args, kind_k = plane_args(as_plane(k_cache))
    *v_args, kind_v = plane_args(as_plane(v_cache))
    r = rotation_size(d)
    # one warp when norming: fused.rms_norm's launch for a head row of this width, so the same sum order
    warps = 1 if norms else 4
    _rotary_store_kernel[(t, nq + n_kv)](
        q, k, v, cos.contiguous(), sin.contiguous(), q_out, *k_args, *v_args, rotation_signs(r, q.device),
        slots, q_weight, k_weight, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), nq, eps, D=d, ROT=cos.shape[-1], BD=triton.next_power_of_2(d),
        BF16=q.dtype == torch.bfloat16, NORM=norms is not None, KIND_K=kind_k, KIND_V=kind_v, R=r,
        RSCALE=rotation_scale(r), num_warps=warps, enable_fp_fusion=False, **pdl_options(q),
    )  # fmt: skip
    return q_out
