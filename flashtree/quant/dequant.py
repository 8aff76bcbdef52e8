"""Dequantize GGML blocks with plain torch ops, so the same code runs on CPU and GPU.

Every function takes `blocks` (n_blocks, block_bytes) uint8 and returns (n_blocks, block_size) float32.
The arithmetic mirrors gguf-py's numpy dequantizers operation by operation (same products, same order),
so results match them bit for bit.
"""

from __future__ import annotations

import math

import torch

from flashtree.errors import FlashtreeError
from flashtree.quant.formats import FLOAT_DTYPES, QT, block_bytes, check_supported, type_name


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(n, 2k) little-endian fp16 bytes -> (n, k) float32."""
    return b.contiguous().view(torch.float16).float()


def _planes(x: torch.Tensor, shifts: tuple[int, ...], mask: int) -> torch.Tensor:
    """(..., m) bytes -> (..., len(shifts), m): plane i holds the bit field (x >> shifts[i]) & mask."""
    # one op per plane (at most 8) over all blocks; no index tensors, so it is also CUDA-graph safe
    return torch.stack([(x >> s) & mask for s in shifts], dim=-2)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., m) -> (..., 2, m): low nibbles first, then high nibbles (the GGML order)."""
    return _planes(qs, (0, 4), 0x0F)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """(..., m) -> (..., 8, m): plane i holds bit i of every byte."""
    return _planes(qh, tuple(range(8)), 1)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks[:, :2])  # (n, 1)
    q = blocks[:, 2:].contiguous().view(torch.int8).float()  # (n, 32)
    return q * d


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks[:, :2])  # (n, 1)
    q = _nibbles(blocks[:, 2:]).flatten(1).float() - 8  # (n, 32)
    return d * q


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])  # (n, 1) each
    q = _nibbles(blocks[:, 4:]).flatten(1).float()  # (n, 32)
    return d * q + m


def _five_bit(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Legacy 5-bit quants: qh (n, 4) holds one high bit per value (a little-endian uint32), qs (n, 16)."""
    high = _bits(qh).transpose(1, 2).flatten(1)  # (n, 32): value i <- bit i%8 of byte i//8
    return (_nibbles(qs).flatten(1) | (high << 4)).float()  # (n, 32) in [0, 31]


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks[:, :2])
    return d * (_five_bit(blocks[:, 2:6], blocks[:, 6:]) - 16)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    return d * _five_bit(blocks[:, 4:8], blocks[:, 8:]) + m


def k_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte Q4_K/Q5_K scale field into eight 6-bit scales and eight 6-bit mins, (n, 8) each.

    Bytes 0-3 hold scales 0-3 (low 6 bits), bytes 4-7 mins 0-3; sub-blocks 4-7 keep their low 4 bits in
    bytes 8-11 and their top 2 bits in the spare high bits of bytes 0-7.
    """
    s = scales.view(-1, 3, 4)
    lo_sc, lo_m, packed = s[:, 0], s[:, 1], s[:, 2]  # (n, 4) each
    sc = torch.cat([lo_sc & 0x3F, (packed & 0x0F) | ((lo_sc >> 2) & 0x30)], dim=1)
    mn = torch.cat([lo_m & 0x3F, (packed >> 4) | ((lo_m >> 2) & 0x30)], dim=1)
    return sc, mn


def _k_affine(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Apply Q4_K/Q5_K's per-sub-block scale and min to q (n, 8, 32)."""
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])  # (n, 1) each
    sc, mn = k_scales_mins(blocks[:, 4:16])
    scale = (d * sc.float()).unsqueeze(-1)  # (n, 8, 1)
    offset = (dmin * mn.float()).unsqueeze(-1)  # (n, 8, 1)
    return (scale * q - offset).flatten(1)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # each 32-byte group of qs holds sub-block 2i (low nibbles) and 2i+1 (high nibbles)
    q = _nibbles(blocks[:, 16:].view(-1, 4, 32)).reshape(-1, 8, 32)  # (n, 8, 32)
    return _k_affine(blocks, q.float())


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    low = _nibbles(blocks[:, 48:].view(-1, 4, 32)).reshape(-1, 8, 32)  # (n, 8, 32)
    high = _bits(blocks[:, 16:48])  # (n, 8, 32): bit j of qh byte i is value i of sub-block j
    return _k_affine(blocks, (low | (high << 4)).float())


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    low = _nibbles(blocks[:, :128].view(n, 2, 64)).reshape(n, 8, 32)  # (n, 8, 32)
    # each 32-byte group of qh holds the top 2 bits of four consecutive 32-value runs
    high = _planes(blocks[:, 128:192].view(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 8, 32)  # (n, 8, 32)
    q = (low | (high << 4)).view(n, 16, 16).float() - 32  # (n, 16, 16) in [-32, 31]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()  # (n, 16)
    d = (_f16(blocks[:, 208:210]) * scales).unsqueeze(-1)  # (n, 16, 1)
    return (d * q).flatten(1)


_BLOCK_DEQUANT = {
    QT.Q8_0: _q8_0,
    QT.Q4_0: _q4_0,
    QT.Q4_1: _q4_1,
    QT.Q5_0: _q5_0,
    QT.Q5_1: _q5_1,
    QT.Q4_K: _q4_k,
    QT.Q5_K: _q5_k,
    QT.Q6_K: _q6_k,
}


def dequantize(
    raw: torch.Tensor, qtype: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Decode the packed bytes of one tensor (uint8, any shape, any device) to `dtype` with torch `shape`."""
    check_supported(qtype)
    qtype = QT(qtype)
    flat = raw.reshape(-1)
    if qtype in FLOAT_DTYPES:
        out = flat.view(FLOAT_DTYPES[qtype])
    else:
        n_bytes = block_bytes(qtype)
        if flat.numel() % n_bytes:
            raise FlashtreeError(f"{type_name(qtype)} data of {flat.numel()} bytes is not whole blocks")
        out = _BLOCK_DEQUANT[qtype](flat.view(-1, n_bytes))
    if out.numel() != math.prod(shape):
        raise FlashtreeError(
            f"{type_name(qtype)} data holds {out.numel()} values, which does not fit shape {tuple(shape)}"
        )
    return out.reshape(shape).to(dtype)
