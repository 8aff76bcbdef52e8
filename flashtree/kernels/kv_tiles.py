"""KV cache tiles in any type of quant/kv.py, for the attention kernels: `kv_tile` loads the values of
some cache slots and head dims as a tensor operand (what a bf16 / f16 / f32 cache holds, as stored;
a quantized one's values in fp32), and `plane_args` gives a kernel a plane's pointers and strides.
Dequantizing happens in registers, tile by tile: no dequantized copy of the cache is ever made.
Each value is computed alone (its code, its block's scale: one multiply), so a tile's values do not
depend on which other slots or rows it holds: a verify row reads the bits the AR step reads.
tq3_0's values stay rotated (quant/kv.py): the caller rotates the query and unrotates the output."""

from __future__ import annotations

from flashtree.kernels import tl, triton
from flashtree.quant.kv import BLOCK, CENTROIDS, KVPlane

KINDS = {"bf16": 0, "f16": 0, "f32": 0, "q8_0": 1, "q4_0": 2, "tq3_0": 3}  # a plane's KIND constexpr
QBLOCK = tl.constexpr(BLOCK)
# tq3_0's centroid magnitudes, smallest first (CENTROIDS[4:]): index 4 + j is +C_j, index 3 - j is -C_j
C0, C1, C2, C3 = (tl.constexpr(c) for c in CENTROIDS[4:])


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
    low = idx & 3
    level = tl.where(idx >= 4, low, 3 - low)
    mag = tl.where(level == 0, C0, tl.where(level == 1, C1, tl.where(level == 2, C2, C3)))
    return tl.where(idx >= 4, mag, -mag)


@triton.jit
def kv_tile(data, scale, high, slot, d, ok, s_data, s_scale, s_high, KIND: tl.constexpr):
    """The values at cache slots `slot` and head dims `d`, broadcast together ((N, 1) and (1, BD): a
    (positions, head_dim) tile; (1, N) and (BD, 1): the transposed K^T tile), masked by `ok` (0 there).
    data, scale, high: one head's fields at slot 0 (`plane_args`); s_*: their slot strides. KIND 0
    (bf16 / f16 / f32): the stored tensor itself (the caller casts it to its operand); else fp32."""
    if KIND == 0:
        return tl.load(data + slot * s_data + d, mask=ok, other=0.0)
    else:
        d_scale = tl.load(scale + slot * s_scale + d // QBLOCK, mask=ok, other=0.0).to(tl.float32)
        if KIND == 1:  # q8_0
            q = tl.load(data + slot * s_data + d, mask=ok, other=0).to(tl.float32)
        elif KIND == 2:  # q4_0: element 2i + j in bits 4j.. of byte i
            byte = tl.load(data + slot * s_data + d // 2, mask=ok, other=0).to(tl.int32)
            q = ((byte >> ((d % 2) * 4)) & 15).to(tl.float32) - 8.0
        else:  # tq3_0: the index's low two bits in data, its third in high
            low = tl.load(data + slot * s_data + d // 4, mask=ok, other=0).to(tl.int32)
            top = tl.load(high + slot * s_high + d // 8, mask=ok, other=0).to(tl.int32)
            q = centroid(((low >> ((d % 4) * 2)) & 3) | (((top >> (d % 8)) & 1) << 2))
        return q * d_scale
