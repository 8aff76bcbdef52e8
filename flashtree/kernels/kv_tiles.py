"""KV cache tiles in any type of quant/kv.py, for the attention kernels: `kv_tile` loads the values of
some cache slots and head dims as a tensor operand (what a bf16 / f16 / f32 cache holds, as stored;
a quantized one's values in fp32), and `plane_args` gives a kernel a plane's pointers and strides.
Dequantizing happens in registers, tile by tile (each slot's bytes loaded whole, once, and unpacked
there): no dequantized copy of the cache is ever made.
Each value is computed alone (its code, its block's scale: one multiply), so a tile's values do not
depend on which other slots or rows it holds: a verify row reads the bits the AR step reads.
tq3_0's values stay rotated (quant/kv.py): the caller rotates the query and unrotates the output."""

from __future__ import annotations

from flashtree.kernels import tl, triton
from flashtree.quant.kv import BLOCK, CENTROIDS, THRESHOLDS, KVPlane

KINDS = {"bf16": 0, "f16": 0, "f32": 0, "q8_0": 1, "q4_0": 2, "tq3_0": 3}  # a plane's KIND constexpr
QBLOCK = tl.constexpr(BLOCK)
# tq3_0's centroid magnitudes, smallest first (CENTROIDS[4:]): index 4 + j is +C_j, index 3 - j is -C_j
C0, C1, C2, C3 = (tl.constexpr(c) for c in CENTROIDS[4:])
T0, T1, T2, T3, T4, T5, T6 = (tl.constexpr(t) for t in THRESHOLDS)


def plane_args(plane: KVPlane) -> tuple:
    """(data, scale, high, data's head and slot strides, scale's, high's, KIND) of a plane whose fields
    are (heads, slots, ...): the arguments `kv_tile`'s callers take. A float plane passes its data for
    the fields it lacks (never read)."""
    data = plane.data
    scale = data if plane.scale is None else plane.scale
    high = data if plane.high is None else plane.high
    strides = (s for f in (data, scale, high) for s in f.stride()[:2])
    return (data, scale, high, *strides, KINDS[plane.kind])


@triton.jit
def centroid(idx):
    """CENTROIDS[idx] of 3-bit indices (int32), in fp32."""
    return _centroid_of(idx, (idx >> 2) - 1)


@triton.jit
def _centroid_of(low, neg):
    """CENTROIDS[idx] in fp32 from the index's low two bits (bits 0-1 of `low`; its higher bits are
    ignored) and `neg`, -1 where the third bit is 0 (the negative half) and 0 where it is 1: the level of
    the magnitude is low's bits, flipped in the negative half; a few bit operations and selects a value,
    not a chain of compares (bench/results/cpu-sm90-attention-loops-2026-12-07)."""
    level = (low ^ neg) & 3
    odd = (level & 1) != 0
    mag = tl.where((level & 2) != 0, tl.where(odd, C3, C2), tl.where(odd, C1, C0))
    return (mag.to(tl.int32, bitcast=True) ^ (neg & -(1 << 31))).to(tl.float32, bitcast=True)


@triton.jit
def kv_tile(data, scale, high, slot, ok, s_data, s_scale, s_high, HD, N: tl.constexpr, BD: tl.constexpr,
            KIND: tl.constexpr, TRANS: tl.constexpr):  # fmt: skip
    """The values of head dims 0 .. BD - 1 at cache slots `slot` (N,): a (N, BD) tile, or its transpose
    (BD, N) with TRANS (K^T); 0 at slots where `ok` (N,) is false and at head dims >= HD. data, scale,
    high: one head's fields at slot 0 (`plane_args`); s_*: their slot strides. KIND 0 (bf16 / f16 /
    f32): the stored tensor itself (the caller casts it to its operand); else fp32."""
    if KIND == 0:
        d = tl.arange(0, BD)
        mask = ok[:, None] & (d < HD)[None, :]
        if TRANS:  # a float K^T is loaded transposed: nothing to unpack in (N, BD) order
            return tl.load(data + slot[None, :] * s_data + d[:, None], mask=tl.trans(mask), other=0.0)
        else:
            return tl.load(data + slot[:, None] * s_data + d[None, :], mask=mask, other=0.0)
    else:
        v = _dequantized(data, scale, high, slot, ok, s_data, s_scale, s_high, HD, N, BD, KIND)
        return tl.trans(v) if TRANS else v


@triton.jit
def _rows(field, slot, ok, stride, n, N: tl.constexpr, WIDTH: tl.constexpr):
    """Elements 0 .. WIDTH - 1 of a field at slots `slot` (N, WIDTH), as stored, 0 past the first n:
    one slot's are contiguous, so a thread loads several at once."""
    i = tl.arange(0, WIDTH)
    return tl.load(field + slot[:, None] * stride + i[None, :], mask=ok[:, None] & (i < n)[None, :], other=0)


@triton.jit
def _magic(n, offset: tl.constexpr):
    """n - offset in fp32, exactly, for int32 0 <= n < 2**23: n in the mantissa of 2**23, one bit operation
    and one subtraction instead of an int-to-float conversion (a quarter-rate pipe on sm_90)."""
    return (n | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + offset)


@triton.jit
def _dequantized(data, scale, high, slot, ok, s_data, s_scale, s_high, HD, N: tl.constexpr,
                 BD: tl.constexpr, KIND: tl.constexpr):  # fmt: skip
    """`kv_tile`'s (N, BD) tile of a quantized plane. Each byte is loaded once and its codes shifted
    out of it along a trailing axis (the values of a group of 2, 4 or 8), each block's scale loaded once
    and broadcast over its 32 values (HD is a multiple of 32: masks of whole groups are exact)."""
    if KIND == 1:  # q8_0 (an int8-to-float conversion a value: fewer instructions than `_magic` here)
        q = _rows(data, slot, ok, s_data, HD, N, BD).to(tl.float32)
    elif KIND == 2:  # q4_0: element 2i + j in bits 4j.. of byte i; split by groups of 8 values (4 bytes),
        # which stay in a thread's registers (a trailing pair axis went through shared memory: sm_90 SASS)
        byte = _rows(data, slot, ok, s_data, HD // 2, N, BD // 2).to(tl.int32)
        nibble = tl.reshape(byte, (N, BD // 8, 4, 1)) >> (tl.arange(0, 2) * 4)[None, None, None, :]
        q = _magic(tl.reshape(nibble, (N, BD // 8, 8)) & 15, 8.0)
    else:  # tq3_0, by groups of 8 values: 2 bytes of low bits (4i + j at bits 2j), 1 of third bits
        low = _rows(data, slot, ok, s_data, HD // 4, N, BD // 4).to(tl.int32)
        top = _rows(high, slot, ok, s_high, HD // 8, N, BD // 8).to(tl.int32)
        low = tl.reshape(low, (N, BD // 8, 2, 1)) >> (tl.arange(0, 4) * 2)[None, None, None, :]
        low = tl.reshape(low, (N, BD // 8, 8))  # value j's low index bits at bits 0-1
        # -1 where value j's third bit (bit j of its byte) is 0, else 0: the bit moved to the sign, spread
        neg = ((top[:, :, None] >> tl.arange(0, 8)[None, None, :]) & 1) - 1
        q = _centroid_of(low, neg)  # (N, BD / 8, 8)
    d_scale = _rows(scale, slot, ok, s_scale, HD // QBLOCK, N, BD // QBLOCK).to(tl.float32)
    blocks = tl.reshape(q, (N, BD // QBLOCK, QBLOCK)) * d_scale[:, :, None]
    return tl.reshape(blocks, (N, BD))


@triton.jit
def _pair_level(v, N: tl.constexpr, W: tl.constexpr):
    """v (N, 2W) -> (N, W): the sums of adjacent pairs."""
    a, b = tl.split(tl.reshape(v, (N, W, 2)))
    return a + b


@triton.jit
def _block_sums(v, N: tl.constexpr):
    """Sums of each row of v (N, 32) by adjacent pairs, level by level (quant/kv.py's pair_sum)."""
    v = _pair_level(_pair_level(_pair_level(v, N, 16), N, 8), N, 4)
    return tl.reshape(_pair_level(_pair_level(v, N, 2), N, 1), (N,))


@triton.jit
def _pack(v, N: tl.constexpr, LEVELS: tl.constexpr, BITS: tl.constexpr):
    """Bytes of 2 ** LEVELS adjacent values of BITS bits each (v (N,) int32), the first lowest."""
    for level in tl.static_range(LEVELS):
        a, b = tl.split(tl.reshape(v, (N >> (level + 1), 2)))
        v = a | (b << (BITS << level))
    return v.to(tl.uint8)


@triton.jit
def _butterfly(x, M: tl.constexpr, BD: tl.constexpr, H: tl.constexpr):
    """One Walsh-Hadamard level of each row of x (M, BD): (a, b) of each pair H apart becomes
    (a + b, a - b)."""
    v = tl.permute(tl.reshape(x, (M, BD // (2 * H), 2, H)), (0, 1, 3, 2))
    a, b = tl.split(v)
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (M, BD))


@triton.jit
def rotate_rows(x, signs, M: tl.constexpr, BD: tl.constexpr, R: tl.constexpr, RSCALE: tl.constexpr,
                INVERSE: tl.constexpr):  # fmt: skip
    """quant/kv.py's `rotate` (INVERSE: `unrotate`) of each row of x (M, BD) fp32 in groups of R: one
    sign vector, the butterfly levels, times RSCALE = 1 / sqrt(R), the other sign vector (signs:
    `rotation_signs`, the first R for rotate's first step), the same operations in the same order. Each
    row alone: its bits do not depend on the rows beside it."""
    d = tl.arange(0, BD)[None, :] % R
    first, second = tl.load(signs + d), tl.load(signs + R + d)
    x = x * (second if INVERSE else first)
    for level in tl.static_range(R.bit_length() - 1):
        x = _butterfly(x, M, BD, 1 << level)
    return x * RSCALE * (first if INVERSE else second)


@triton.jit
def _inverse(d):
    """1 / d, 0 where d is 0 (a block of zeros)."""
    return tl.where(d == 0, 0.0, tl.div_rn(1.0, tl.where(d == 0, 1.0, d)))


@triton.jit
def _centroid_index(u):
    """The index of the centroid nearest each u (quant/kv.py's THRESHOLDS, ties to the lower one)."""
    idx = (u > T0).to(tl.int32) + (u > T1).to(tl.int32) + (u > T2).to(tl.int32) + (u > T3).to(tl.int32)
    return idx + (u > T4).to(tl.int32) + (u > T5).to(tl.int32) + (u > T6).to(tl.int32)


@triton.jit
def _scaled_blocks(x, NB: tl.constexpr, KIND: tl.constexpr):
    """Codes (NB, 32) int32 and fp16 scales (NB,) of the blocks of x (NB, 32) fp32 in type KIND
    (quant/kv.py's `quantize`, operation for operation: q8_0 signed codes, q4_0 nibbles, tq3_0 indices)."""
    if KIND == 1:  # q8_0
        d = tl.div_rn(tl.max(tl.abs(x), axis=1), 127.0).to(tl.float16)
        q = tl.floor(x * _inverse(d.to(tl.float32))[:, None] + 0.5)
        return tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int32), d
    elif KIND == 2:  # q4_0: the first value of the largest magnitude maps to -8
        col = tl.arange(0, QBLOCK)[None, :]
        big = tl.abs(x) == tl.max(tl.abs(x), axis=1)[:, None]
        first = tl.min(tl.where(big, col, QBLOCK), axis=1)
        d = tl.div_rn(tl.sum(tl.where(col == first[:, None], x, 0.0), axis=1), -8.0).to(tl.float16)
        n = tl.floor(x * _inverse(d.to(tl.float32))[:, None] + 8.0 + 0.5)
        return tl.minimum(tl.maximum(n, 0.0), 15.0).to(tl.int32), d
    else:  # tq3_0: nearest centroids of x / rms, their least-squares scale, nearest again against it
        rms = tl.sqrt_rn(tl.div_rn(_block_sums(x * x, NB), 32.0))
        c = centroid(_centroid_index(x * _inverse(rms)[:, None]))
        norm = tl.where(rms == 0, 1.0, _block_sums(c * c, NB))
        d = tl.div_rn(_block_sums(x * c, NB), norm).to(tl.float16)
        return _centroid_index(x * _inverse(d.to(tl.float32))[:, None]), d


@triton.jit
def store_row(x, data, scale, high, signs, D: tl.constexpr, BD: tl.constexpr, R: tl.constexpr,
              RSCALE: tl.constexpr, KIND: tl.constexpr):  # fmt: skip
    """One K or V vector x (BD,) (its first D values; fp32 holding the values `quantize` is given)
    stored in type KIND at its slot's fields data, scale, high (float types: data's dtype). tq3_0 rotates
    it first (`rotate_rows`)."""
    d = tl.arange(0, BD)
    if KIND == 0:
        tl.store(data + d, x.to(data.dtype.element_ty), mask=d < D)
    else:
        if KIND == 3:
            x = tl.reshape(rotate_rows(tl.reshape(x, (1, BD)), signs, 1, BD, R, RSCALE, False), (BD,))
        codes, d_scale = _scaled_blocks(tl.reshape(x, (BD // QBLOCK, QBLOCK)), BD // QBLOCK, KIND)
        codes = tl.reshape(codes, (BD,))
        nb = tl.arange(0, BD // QBLOCK)
        tl.store(scale + nb, d_scale, mask=nb < D // QBLOCK)
        if KIND == 1:
            tl.store(data + d, codes.to(tl.int8), mask=d < D)
        elif KIND == 2:
            half = tl.arange(0, BD // 2)
            tl.store(data + half, _pack(codes, BD, 1, 4), mask=half < D // 2)
        else:
            quarter, eighth = tl.arange(0, BD // 4), tl.arange(0, BD // 8)
            tl.store(data + quarter, _pack(codes & 3, BD, 2, 2), mask=quarter < D // 4)
            tl.store(high + eighth, _pack(codes >> 2, BD, 3, 1), mask=eighth < D // 8)
