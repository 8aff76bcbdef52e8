"""Causal flash attention for a prefill chunk, in Triton: no mask tensor, no score matrix in memory.

A chunk of T tokens at positions start .. start + T - 1 has its K/V already written to the cache at
those slots; row t attends to slots 0 .. start + t (or, with a window, to the last `window` of them).
The torch path builds a (T, start + T) mask and runs SDPA over it: at a 256K prompt a 2048-row chunk's
mask alone is 512 MB and SDPA with a mask takes its slow kernels. Here a program takes R consecutive
rows of one KV head with all G query heads of that KV head (query i: row i // G, head i % G, as the
decode kernel lays them), so each K/V tile it loads serves G x R queries; it walks the key tiles every
one of its rows sees without a mask, then the few tiles on the causal edge with one, and never a tile
past its last row's position (nor, with a window, before its first row's window). Online softmax in
fp32, dots as kernels/attention.py takes them (`dot_mode`). The row blocks are launched last first:
the longest rows start first and the short ones fill in behind. K and V are planes of any KV cache
type (quant/kv.py), their tiles dequantized in registers (kernels/kv_tiles.py); a tq3_0 cache holds
rotated vectors, so q is rotated for a tq3_0 K and the output rotated back for a tq3_0 V. Unpacking a
quantized tile costs several times its dots, and every row block of a chunk reads every key before it:
so without a window a chunk's keys are unpacked once into values (the ones the in-kernel path rounds its
operands to), the chunk's own and then the earlier ones a bounded slab at a time (SLAB_BYTES), and the
slabs' attentions merged by their log-sum-exp. The decode and verify kernels, which read each key once,
never do this.
"""

from __future__ import annotations

from functools import partial

import torch

from flashtree.kernels import tl, triton
from flashtree.kernels.attention import _dot, _operand, dot_mode
from flashtree.kernels.kv_tiles import kv_tile, plane_args
from flashtree.kernels.launch import pdl_options, wait_for_inputs
from flashtree.quant.kv import FLOAT_TYPES, KVPlane, as_plane, rotate, unrotate

LOG2E = 1.4426950408889634
# (query slots a program, key positions a step, warps) by head size: FlashAttention-2's tiles for these
# head sizes (a 256-wide head's fp32 accumulator of 64 x 256 is what 8 warps' registers hold)
TILES = {64: (128, 64, 4), 128: (128, 64, 8), 256: (64, 64, 8)}
NUM_STAGES = 2
# A quantized cache's earlier keys are read through slabs of their values this large (prefill_attention)
SLAB_BYTES = 64 << 20


def tiles_for(head_dim: int) -> tuple[int, int, int]:
    """(QB, BLOCK, warps) for heads of `head_dim` values: the entry of the next size up."""
    bd = triton.next_power_of_2(head_dim)
    return TILES.get(bd, TILES[64] if bd < 64 else TILES[256])


@triton.jit
def _key_tile(
    q, kd, ks, kh, skd, sks, skh, vd, vs, vh, svd, svs, svh, b, n_keys, pos, m, denom, acc, qk_scale,
    HD: tl.constexpr, BD: tl.constexpr, DOTS: tl.constexpr, BLOCK: tl.constexpr, EDGE: tl.constexpr,
    WINDOW: tl.constexpr, window, KIND_K: tl.constexpr, KIND_V: tl.constexpr,
):  # fmt: skip
    """Keys b .. b + BLOCK - 1 added to the online softmax (base 2) of the queries at positions `pos`.
    K^T (BD, BLOCK) and V (BLOCK, BD) as kv_tile loads them. EDGE: the tile crosses some row's causal
    edge (or window): keys a row does not see are masked."""
    keys = b + tl.arange(0, BLOCK)
    kv_ok = keys < n_keys
    k = kv_tile(kd, ks, kh, keys, kv_ok, skd, sks, skh, HD, BLOCK, BD, KIND_K, True)
    v = kv_tile(vd, vs, vh, keys, kv_ok, svd, svs, svh, HD, BLOCK, BD, KIND_V, False)
    scores = _dot(q, _operand(k, DOTS), DOTS) * qk_scale  # (QB, BLOCK), in log2 units
    if EDGE:
        seen = (keys[None, :] <= pos[:, None]) & (keys[None, :] < n_keys)
        if WINDOW:
            seen = seen & (keys[None, :] > pos[:, None] - window)
        scores = tl.where(seen, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    if WINDOW:  # a row whose window starts past this tile has seen no key yet: m_new -inf, keep exp's 0
        m_new = tl.where(m_new == float("-inf"), -1e30, m_new)
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(scores - m_new[:, None])
    denom = denom * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(_operand(p, DOTS), _operand(v, DOTS), DOTS)
    return m_new, denom, acc


@triton.jit
def _prefill_kernel(
    q_ptr, kd, ks, kh, skd_h, skd, sks_h, sks, skh_h, skh, vd, vs, vh, svd_h, svd, svs_h, svs, svh_h, svh,
    out_ptr, lse_ptr, start, n_rows, n_blocks, window, key_hi, stride_qt, stride_qh, stride_ot,
    stride_oh, qk_scale, G: tl.constexpr, R: tl.constexpr, QB: tl.constexpr, HD: tl.constexpr,
    BD: tl.constexpr, BLOCK: tl.constexpr, DOTS: tl.constexpr, WINDOW: tl.constexpr, KIND_K: tl.constexpr,
    KIND_V: tl.constexpr, LSE: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """Program (row block, KV head): rows first .. first + R - 1 of the chunk, G query heads each. K and
    V: planes (kd, ks, kh: K's data, scale and high fields; s*_h / s*: their head and slot strides).
    Keys below key_hi only; LSE: each query's log2-sum-exp2 of its scores also stored at lse_ptr (row,
    head), for `_merge`."""
    block, kvh = n_blocks - 1 - tl.program_id(0), tl.program_id(1)  # the longest rows first
    i = tl.arange(0, QB)
    d = tl.arange(0, BD)
    first = block * R
    real = (i < R * G) & (first + i // G < n_rows)
    # padding queries compute the block's last row again (it sees its own key), never stored
    row = tl.minimum(first + tl.minimum(i // G, R - 1), n_rows - 1)
    heads = kvh * G + i % G
    pos = start + row  # (QB,) each query's position: it sees keys 0 .. pos
    head_dims = (d < HD)[None, :]
    q_at = q_ptr + row[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :]
    wait_for_inputs(GDC)
    q = tl.load(q_at, mask=head_dims, other=0.0)
    q = _operand(q, DOTS)
    m = tl.full((QB,), float("-inf"), tl.float32)
    denom = tl.zeros((QB,), tl.float32)
    acc = tl.zeros((QB, BD), tl.float32)
    first_pos = start + first
    n_keys = tl.minimum(start + tl.minimum(first + R, n_rows), key_hi)  # one past the last key read
    lo = 0
    shared_end = tl.minimum(first_pos + 1, n_keys) // BLOCK * BLOCK  # tiles every row sees whole
    if WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0) // BLOCK * BLOCK
        shared_end = lo  # a window's lower edge moves with the row: every tile is an edge tile
    kd, ks, kh = kd + kvh * skd_h, ks + kvh * sks_h, kh + kvh * skh_h
    vd, vs, vh = vd + kvh * svd_h, vs + kvh * svs_h, vh + kvh * svh_h
    for b in range(lo, shared_end, BLOCK):
        m, denom, acc = _key_tile(
            q, kd, ks, kh, skd, sks, skh, vd, vs, vh, svd, svs, svh, b, n_keys, pos, m, denom, acc,
            qk_scale, HD, BD, DOTS, BLOCK, False, WINDOW, window, KIND_K, KIND_V,
        )  # fmt: skip
    for b in range(shared_end, n_keys, BLOCK):
        m, denom, acc = _key_tile(
            q, kd, ks, kh, skd, sks, skh, vd, vs, vh, svd, svs, svh, b, n_keys, pos, m, denom, acc,
            qk_scale, HD, BD, DOTS, BLOCK, True, WINDOW, window, KIND_K, KIND_V,
        )  # fmt: skip
    outs = out_ptr + row[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(outs, (acc / denom[:, None]).to(out_ptr.dtype.element_ty), mask=real[:, None] & head_dims)
    if LSE:
        tl.store(lse_ptr + row * (G * tl.num_programs(1)) + heads, m + tl.log2(denom), mask=real)


def prefill_attention(
    q: torch.Tensor,  # (T, n_heads, head_dim), unit stride along head_dim
    k_cache: torch.Tensor | KVPlane,  # (n_kv, slots, head_dim) or a plane of fields (n_kv, slots, ...):
    v_cache: torch.Tensor | KVPlane,  # the chunk's own K/V already at slots start ..
    start: int,  # the chunk's first position (committed tokens before it), known on the host
    scale: float,
    window: int = 0,  # > 0: row at p attends to positions max(0, p - window + 1) .. p only
    tile: tuple[int, int, int] | None = None,  # (QB, BLOCK, warps); None: tiles_for(head_dim)
    stages: int = NUM_STAGES,
    slab_bytes: int = SLAB_BYTES,
) -> torch.Tensor:
    """Causal softmax(q K^T * scale) V of a prefill chunk over the cache's positions 0 .. start + T - 1,
    (T, n_heads, head_dim) in q's dtype. `tile` and `stages`: a test's or a sweep's launch.

    Without a window, a quantized cache's keys are unpacked once into values (a row block would
    otherwise unpack every key it reads again: T / rows times a chunk): the chunk's own, read causally,
    and the earlier ones in slabs of at most `slab_bytes`, merged by their log-sum-exp."""
    k_cache, v_cache = as_plane(k_cache), as_plane(v_cache)
    dtype = q.dtype
    if k_cache.kind == "tq3_0":
        q = rotate(q).to(dtype)
    quantized = k_cache.kind not in FLOAT_TYPES or v_cache.kind not in FLOAT_TYPES
    tile = tile or tiles_for(q.shape[-1])
    launch = partial(_launch, q, scale=scale, window=window, tile=tile, stages=stages)
    rotated_out = v_cache.kind == "tq3_0"  # rotated back from fp32: one rounding to q's dtype
    if not quantized or window:  # a window bounds the keys a row block reads: unpacked in-kernel
        out = launch(k_cache, v_cache, start, out_dtype=torch.float32 if rotated_out else dtype)[0]
        return unrotate(out).to(dtype) if rotated_out else out
    # the chunk's own keys (from the tile edge below it) causally, then the earlier ones by slabs
    split = start // tile[1] * tile[1]
    own = (_values(plane, split, start + q.shape[0], q.shape[-1], dtype) for plane in (k_cache, v_cache))
    out, lse = launch(*own, start - split, out_dtype=torch.float32, lse=split > 0)  # freed before the slabs
    per_key = 2 * k_cache.data.shape[0] * q.shape[-1] * q.element_size()  # a slot's K and V values
    slab = max(tile[1], slab_bytes // per_key // tile[1] * tile[1])
    for a in range(0, split, slab):
        b = min(a + slab, split)
        keys = [_values(plane, a, b, q.shape[-1], dtype) for plane in (k_cache, v_cache)]
        out, lse = _merge(out, lse, *launch(*keys, b - a, out_dtype=torch.float32, lse=True))
    return unrotate(out).to(dtype) if rotated_out else out.to(dtype)


def _values(plane: KVPlane, a: int, b: int, hd: int, dtype: torch.dtype) -> torch.Tensor:
    """Slots a .. b - 1 of a plane (n_kv, slots, ...) as values (n_kv, b - a, hd) in the dots' dtype
    (what the kernel's operands round them to), in one pass of `kv_tile`'s own unpacking."""
    part = plane.map(lambda f: f[:, a:b])
    if plane.kind in FLOAT_TYPES:
        return part.data
    n_kv, n = part.scale.shape[0], b - a
    out = torch.empty(n_kv, n, hd, dtype=dtype, device=part.data.device)
    *fields, kind = plane_args(part)
    _values_kernel[(triton.cdiv(n, VALUE_SLOTS), n_kv)](
        out, *fields, n, out.stride(0), out.stride(1), hd,
        N=VALUE_SLOTS, BD=triton.next_power_of_2(hd), KIND=kind, **pdl_options(out),
    )  # fmt: skip
    return out


VALUE_SLOTS = 32  # slots a program of `_values_kernel` unpacks


@triton.jit
def _values_kernel(
    out, data, scale, high, sd_h, sd, ss_h, ss, sh_h, sh, n, so_h, so, HD, N: tl.constexpr,
    BD: tl.constexpr, KIND: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """Program (slot block, KV head): the values of N slots, as `kv_tile` loads them, in out's dtype."""
    block, h = tl.program_id(0), tl.program_id(1)
    slot = block * N + tl.arange(0, N)
    ok = slot < n
    wait_for_inputs(GDC)
    v = kv_tile(
        data + h * sd_h, scale + h * ss_h, high + h * sh_h, slot, ok, sd, ss, sh, HD, N, BD, KIND, False
    )
    d = tl.arange(0, BD)
    at = out + h * so_h + slot[:, None] * so + d[None, :]
    tl.store(at, v.to(out.dtype.element_ty), mask=ok[:, None] & (d < HD)[None, :])


def _merge(out, lse, other, other_lse):
    """Two attentions of the same queries over disjoint keys, normalized, with their log2-sum-exp2s, as
    one: (out (T, H, hd) fp32, lse (T, H))."""
    top = torch.maximum(lse, other_lse)
    w, w_other = torch.exp2(lse - top), torch.exp2(other_lse - top)
    total = w + w_other
    out = (out * (w / total)[..., None]).addcmul_(other, (w_other / total)[..., None])
    return out, top + torch.log2(total)


def _launch(q, k_cache, v_cache, start, *, out_dtype, lse=False, scale, window, tile, stages):
    """One kernel launch over keys 0 .. start + T - 1 (all of a slab's for a slab: start = its length,
    so every row sees every key): (out, lse or None)."""
    k_cache, v_cache = as_plane(k_cache), as_plane(v_cache)
    t, n_heads, hd = q.shape
    n_kv = k_cache.data.shape[0]
    group = n_heads // n_kv
    queries, block, warps = tile
    queries = max(queries, triton.next_power_of_2(group))
    rows = queries // group
    n_blocks = triton.cdiv(t, rows)
    out = torch.empty(t, n_heads, hd, dtype=out_dtype, device=q.device)
    sums = torch.empty(t, n_heads, dtype=torch.float32, device=q.device) if lse else out
    *k_args, kind_k = plane_args(k_cache)
    *v_args, kind_v = plane_args(v_cache)
    key_hi = min(start + t, k_cache.data.shape[1])
    _prefill_kernel[(n_blocks, n_kv)](
        q, *k_args, *v_args, out, sums, start, t, n_blocks, window, key_hi, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), scale * LOG2E,
        G=group, R=rows, QB=queries, HD=hd, BD=triton.next_power_of_2(hd), BLOCK=block, DOTS=dot_mode(q),
        WINDOW=window > 0, KIND_K=kind_k, KIND_V=kind_v, LSE=lse, num_warps=warps, num_stages=stages,
        **pdl_options(q),
    )  # fmt: skip
    return out, (sums if lse else None)
