"""KV cache types: how one K or V vector of `head_dim` values is stored, and its bytes.

Layouts (every field has the cache's leading dims, e.g. (layers, n_kv, max_ctx, ...); blocks of BLOCK = 32
values along head_dim share one fp16 scale):
- bf16 / f16: data (…, hd) in that dtype; no scale.
- q8_0: data int8 (…, hd); scale fp16 (…, hd / 32); value = data * scale.
- q4_0: data uint8 (…, hd / 2), byte i = n[2i] | n[2i + 1] << 4 (unsigned nibbles); scale fp16 (…, hd / 32);
  value = (n - 8) * scale.
- tq3_0: the vector is first rotated (`rotate`: groups of R = min(128, hd) values, random signs, an
  orthonormal Walsh-Hadamard transform, random signs) and stays rotated in the cache: a query is rotated
  to read rotated keys, and an output of rotated values is rotated back. Each rotated value is a 3-bit
  index into CENTROIDS: data uint8 (…, hd / 4) holds the indices' low two bits (element 4i + j at bits
  2j, 2j + 1 of byte i), high uint8 (…, hd / 8) their third bit (element 8i + j at bit j of byte i);
  scale fp16 (…, hd / 32); value = scale * CENTROIDS[index]. 3.5 bits a value.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashtree.errors import FlashtreeError

KV_TYPES = ("bf16", "f16", "q8_0", "q4_0", "tq3_0")
BLOCK = 32  # values a scale covers
ROTATION = 128  # tq3_0 rotates groups of this many values (of head_dim, if smaller)


class KVPlane(NamedTuple):
    """One of K or V, in type `kind`: the fields above (scale and high None where a type has none)."""

    kind: str
    data: torch.Tensor
    scale: torch.Tensor | None = None
    high: torch.Tensor | None = None


def check_kv_type(kind: str, head_dim: int) -> str:
    """`kind`, or a FlashtreeError naming what is wrong (an unknown type, a head size it cannot hold)."""
    if kind not in KV_TYPES:
        raise FlashtreeError(f"unknown KV cache type {kind!r} (one of {', '.join(KV_TYPES)})")
    if kind not in ("bf16", "f16") and head_dim % BLOCK:
        raise FlashtreeError(f"KV cache type {kind} needs a head size divisible by {BLOCK}, not {head_dim}")
    return kind


def vector_bytes(kind: str, head_dim: int) -> int:
    """Bytes one K or V vector of `head_dim` values takes in type `kind` (every field)."""
    scales = 2 * (head_dim // BLOCK)
    return {
        "bf16": 2 * head_dim,
        "f16": 2 * head_dim,
        "q8_0": head_dim + scales,
        "q4_0": head_dim // 2 + scales,
        "tq3_0": head_dim // 4 + head_dim // 8 + scales,
    }[check_kv_type(kind, head_dim)]
