"""KV cache types: how one K or V vector of `head_dim` values is stored, and its bytes.

Layouts (every field has the cache's leading dims, e.g. (layers, n_kv, max_ctx, ...); blocks of BLOCK = 32
values along head_dim share one fp16 scale):
- bf16 / f16 / f32: data (…, hd) in that dtype; no scale. f32 is the cache of a model computing in fp32
  (the small models' default: `resolve_kv_type`).
- q8_0: data int8 (…, hd); scale fp16 (…, hd / 32); value = data * scale.
- q4_0: data uint8 (…, hd / 2), byte i = n[2i] | n[2i + 1] << 4 (unsigned nibbles); scale fp16 (…, hd / 32);
  value = (n - 8) * scale.
- tq3_0: the vector is first rotated (`rotate`: groups of R = min(128, hd) values, random signs, an
  orthonormal Walsh-Hadamard transform, random signs) and stays rotated in the cache: a query is rotated
  to read rotated keys, and an output of rotated values is rotated back. Each rotated value is a 3-bit
  index into CENTROIDS: data uint8 (…, hd / 4) holds the indices' low two bits (element 4i + j at bits
  2j, 2j + 1 of byte i), high uint8 (…, hd / 8) their third bit (element 8i + j at bit j of byte i);
  scale fp16 (…, hd / 32); value = scale * CENTROIDS[index]. 3.5 bits a value.

Quantizing (`quantize`, and the same operations in kernels/kv_tiles.py's `store_row`, bit for bit):
q8_0 and q4_0 as GGML's reference rows (q8_0: d = amax / 127; q4_0: d = the value of largest magnitude
/ -8), but each value rounded against the stored fp16 scale (the one `dequantize` multiplies by), half
up. tq3_0: indices of the centroids nearest y / rms(block), then the least-squares scale for them
d = <y, c> / <c, c>, stored as fp16, and the indices assigned again against it (each step lowers the
block's squared error). Block sums are pairwise over adjacent halves (`pair_sum`), an order a kernel
can repeat.
"""

from __future__ import annotations

import math
from functools import cache
from typing import NamedTuple

import torch

from flashtree.errors import FlashtreeError

KV_TYPES = ("bf16", "f16", "q8_0", "q4_0", "tq3_0", "f32")
BLOCK = 32  # values a scale covers
ROTATION = 128  # tq3_0 rotates groups of this many values (of head_dim, if smaller)
FLOAT_TYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
# The 8-level Lloyd-Max quantizer of a unit Gaussian, ascending (index 4 + j is -CENTROIDS[3 - j])
CENTROIDS = (-2.1519797, -1.3439092, -0.7560052, -0.2450942, 0.2450942, 0.7560052, 1.3439092, 2.1519797)
THRESHOLDS = tuple(
    (a + b) / 2 for a, b in zip(CENTROIDS[:-1], CENTROIDS[1:], strict=True)
)  # nearest-centroid bounds
ROTATION_SEED = 0x7E3A  # the sign vectors' generator seed: fixed, so every cache agrees


class KVPlane(NamedTuple):
    """One of K or V, in type `kind`: the fields above (scale and high None where a type has none)."""

    kind: str
    data: torch.Tensor
    scale: torch.Tensor | None = None
    high: torch.Tensor | None = None

    @property
    def fields(self) -> tuple[torch.Tensor, ...]:
        return tuple(f for f in (self.data, self.scale, self.high) if f is not None)

    def map(self, fn) -> KVPlane:
        """The plane with fn applied to each field (an index, a slice of the leading dims)."""
        return KVPlane(self.kind, *(None if f is None else fn(f) for f in (self.data, self.scale, self.high)))


def check_kv_type(kind: str, head_dim: int) -> str:
    """`kind`, or a FlashtreeError naming what is wrong (an unknown type, a head size it cannot hold)."""
    if kind not in KV_TYPES:
        raise FlashtreeError(f"unknown KV cache type {kind!r} (one of {', '.join(KV_TYPES)})")
    if kind not in FLOAT_TYPES and head_dim % BLOCK:
        raise FlashtreeError(f"KV cache type {kind} needs a head size divisible by {BLOCK}, not {head_dim}")
    r = rotation_size(head_dim)
    if kind == "tq3_0" and (r & (r - 1) or head_dim % r):
        raise FlashtreeError(
            f"KV cache type tq3_0 needs a head size that is a power of two or a multiple of {ROTATION}, "
            f"not {head_dim}"
        )
    return kind


def resolve_kv_type(kind: str | None, dtype: torch.dtype) -> str:
    """The KV type asked for, or (None) the compute dtype's own: bf16 for bf16 models, f32 for fp32."""
    if kind is not None:
        return kind
    return {torch.bfloat16: "bf16", torch.float16: "f16"}.get(dtype, "f32")


def vector_bytes(kind: str, head_dim: int) -> int:
    """Bytes one K or V vector of `head_dim` values takes in type `kind` (every field)."""
    scales = 2 * (head_dim // BLOCK)
    return {
        "bf16": 2 * head_dim,
        "f16": 2 * head_dim,
        "f32": 4 * head_dim,
        "q8_0": head_dim + scales,
        "q4_0": head_dim // 2 + scales,
        "tq3_0": head_dim // 4 + head_dim // 8 + scales,
    }[check_kv_type(kind, head_dim)]


def field_shapes(kind: str, head_dim: int) -> tuple[tuple[int, torch.dtype] | None, ...]:
    """(last dim, dtype) of data, scale and high for type `kind` (None: no such field)."""
    if kind in FLOAT_TYPES:
        return (head_dim, FLOAT_TYPES[kind]), None, None
    scale = (head_dim // BLOCK, torch.float16)
    data = {"q8_0": (head_dim, torch.int8), "q4_0": (head_dim // 2, torch.uint8)}
    if kind == "tq3_0":
        return (head_dim // 4, torch.uint8), scale, (head_dim // 8, torch.uint8)
    return data[kind], scale, None


def empty_plane(kind: str, lead: tuple[int, ...], head_dim: int, device) -> KVPlane:
    """A zeroed plane of type `kind` for vectors of `head_dim` values, fields (*lead, ...)."""
    fields = (
        None if f is None else torch.zeros(*lead, f[0], dtype=f[1], device=device)
        for f in field_shapes(check_kv_type(kind, head_dim), head_dim)
    )
    return KVPlane(kind, *fields)


def rotation_size(head_dim: int) -> int:
    return min(ROTATION, head_dim)


@cache
def rotation_signs(r: int, device: torch.device) -> torch.Tensor:
    """The rotation's two fixed ±1 vectors (fp32) for groups of r values, one after the other (2r,)."""
    g = torch.Generator().manual_seed(ROTATION_SEED + r)
    return (torch.randint(0, 2, (2 * r,), generator=g) * 2 - 1).float().to(device)


def rotation_scale(r: int) -> float:
    """The orthonormal transform's factor, applied after the butterfly levels."""
    return 1.0 / math.sqrt(r)


def _hadamard(x: torch.Tensor, r: int) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard transform of each group of r values along the last dim: butterfly
    levels of adds and subtracts of pairs h apart (h = 1, 2, .., r / 2), then one multiply by
    1 / sqrt(r). Elementwise only, so a row's bits do not depend on the rows beside it (a matmul's
    would)."""
    shape = x.shape
    h = 1
    while h < r:
        v = x.reshape(*shape[:-1], shape[-1] // (2 * h), 2, h)
        a, b = v[..., 0, :], v[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(shape)
        h *= 2
    return x * rotation_scale(r)


def _grouped(x: torch.Tensor, r: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // r, r)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """tq3_0's rotation of vectors x (..., hd), in fp32: signs, Walsh-Hadamard, signs, per group."""
    r = rotation_size(x.shape[-1])
    first, second = rotation_signs(r, x.device).split(r)
    y = _hadamard((_grouped(x.float(), r) * first).reshape(x.shape), r)
    return (_grouped(y, r) * second).reshape(x.shape)


def unrotate(y: torch.Tensor) -> torch.Tensor:
    """The inverse of `rotate` (the transform is symmetric and orthonormal), in fp32."""
    r = rotation_size(y.shape[-1])
    first, second = rotation_signs(r, y.device).split(r)
    x = _hadamard((_grouped(y.float(), r) * second).reshape(y.shape), r)
    return (_grouped(x, r) * first).reshape(y.shape)


def pair_sum(v: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (a power of two) by adjacent pairs, level by level."""
    while v.shape[-1] > 1:
        v = v[..., 0::2] + v[..., 1::2]
    return v[..., 0]


def _round_half_up(v: torch.Tensor) -> torch.Tensor:
    return torch.floor(v + 0.5)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """1 / d, 0 where d is 0 (a block of zeros)."""
    return torch.where(d == 0, 0.0, 1.0 / torch.where(d == 0, 1.0, d))


def _centroid_index(u: torch.Tensor) -> torch.Tensor:
    """The index of the centroid nearest each u (ties to the lower one)."""
    idx = torch.zeros_like(u, dtype=torch.uint8)
    for t in THRESHOLDS:
        idx += (u > t).to(torch.uint8)
    return idx


def _quantize_tq3(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices uint8, fp16 scales) of rotated blocks y (..., BLOCK) fp32."""
    table = torch.tensor(CENTROIDS, device=y.device)
    rms = torch.sqrt(pair_sum(y * y) / BLOCK)
    c = table[_centroid_index(y * _inverse(rms)[..., None]).long()]
    d = (pair_sum(y * c) / torch.where(rms == 0, 1.0, pair_sum(c * c))).half()
    return _centroid_index(y * _inverse(d.float())[..., None]), d


def quantize(x: torch.Tensor, kind: str) -> KVPlane:
    """Vectors x (..., hd) (fp32 or bf16) in type `kind`: a KVPlane of fields (..., ...)."""
    hd = x.shape[-1]
    check_kv_type(kind, hd)
    if kind in FLOAT_TYPES:
        return KVPlane(kind, x.to(FLOAT_TYPES[kind]))
    x = rotate(x) if kind == "tq3_0" else x.float()
    blocks = x.reshape(*x.shape[:-1], hd // BLOCK, BLOCK)
    if kind == "tq3_0":
        idx, d = _quantize_tq3(blocks)
        idx = idx.reshape(x.shape)
        low = _pack(idx & 3, 4, 2)
        return KVPlane(kind, low, d, _pack(idx >> 2, 8, 1))
    if kind == "q8_0":
        d = (blocks.abs().amax(-1) / 127).half()
        q = _round_half_up(blocks * _inverse(d.float())[..., None]).clamp(-127, 127)
        return KVPlane(kind, q.to(torch.int8).reshape(x.shape), d)
    first = (blocks.abs() == blocks.abs().amax(-1, keepdim=True)).int().argmax(-1, keepdim=True)
    d = (blocks.gather(-1, first)[..., 0] / -8).half()
    n = _round_half_up(blocks * _inverse(d.float())[..., None] + 8).clamp(0, 15).to(torch.uint8)
    return KVPlane(kind, _pack(n.reshape(x.shape), 2, 4), d)


def _pack(v: torch.Tensor, per_byte: int, bits: int) -> torch.Tensor:
    """uint8 values of `bits` bits, `per_byte` adjacent ones a byte (the first in the low bits)."""
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per_byte, per_byte)
    out = torch.zeros(v.shape[:-1], dtype=torch.uint8, device=v.device)
    for j in range(per_byte):
        out |= v[..., j] << (bits * j)
    return out


def _unpack(b: torch.Tensor, per_byte: int, bits: int) -> torch.Tensor:
    parts = [(b >> (bits * j)) & ((1 << bits) - 1) for j in range(per_byte)]
    return torch.stack(parts, dim=-1).reshape(*b.shape[:-1], b.shape[-1] * per_byte)


def dequantize(plane: KVPlane) -> torch.Tensor:
    """The fp32 values (..., hd) a plane holds (tq3_0's still rotated: `unrotate` them for the originals)."""
    if plane.kind in FLOAT_TYPES:
        return plane.data.float()
    if plane.kind == "q8_0":
        q = plane.data.float()
    elif plane.kind == "q4_0":
        q = _unpack(plane.data, 2, 4).float() - 8
    else:
        idx = _unpack(plane.data, 4, 2) | (_unpack(plane.high, 8, 1) << 2)
        q = torch.tensor(CENTROIDS, device=idx.device)[idx.long()]
    blocks = q.reshape(*q.shape[:-1], q.shape[-1] // BLOCK, BLOCK)
    return (blocks * plane.scale.float()[..., None]).reshape(q.shape)


def as_plane(x: torch.Tensor | KVPlane) -> KVPlane:
    """x itself, or a float tensor as the plane of its type (a cache kept as a plain tensor)."""
    if isinstance(x, KVPlane):
        return x
    kinds = {dtype: kind for kind, dtype in FLOAT_TYPES.items()}
    return KVPlane(kinds[x.dtype], x)
