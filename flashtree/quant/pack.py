"""Quantize float weights into GGML blocks (our own packers; gguf-py cannot pack k-quants).

All packers are vectorized torch code over (n_blocks, block_size) float32 and return (n_blocks, block_bytes)
uint8. The legacy types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) use the same arithmetic as ggml's reference
quantizers and produce the same bytes. The k-quants choose each sub-block's scale (and min) with a small
least-squares search over candidate scales like ggml's make_qkx2_quants / make_qx_quants, then store
those scales with 6 bits (Q4_K, Q5_K) or 8 bits (Q6_K) under one fp16 super-block scale.

`random_blocks` writes random packed blocks with bounded scales for random-weight models of real size.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from flashtree.errors import FlashtreeError
from flashtree.quant.formats import FLOAT_DTYPES, QT, block_bytes, block_size, row_bytes, type_name

# Values quantized per torch call: large enough to amortize overhead, small enough that the k-quant
# search's float32 temporaries stay in the tens of MB.
_CHUNK_VALUES = 1 << 21


def _f16_bytes(d: torch.Tensor) -> torch.Tensor:
    """(n, k) float -> (n, 2k) little-endian fp16 bytes."""
    return d.to(torch.float16).contiguous().view(torch.uint8)


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C roundf: ties away from zero (torch.round rounds ties to even). Exact for every float32."""
    a = x.abs()
    whole = a.floor()
    return torch.sign(x) * (whole + (2 * (a - whole)).floor())


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """1/d, with 0 where d == 0 (an all-zero block quantizes to zeros)."""
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(..., 2, m) values in [0, 15] -> (..., m) bytes: the first half in the low nibbles."""
    q = q.to(torch.uint8)
    return q[..., 0, :] | (q[..., 1, :] << 4)


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """(..., 8, m) bits -> (..., m) bytes: plane i becomes bit i (inverse of dequant._bits)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device).view(8, 1)
    return (bits.to(torch.uint8) << shifts).sum(dim=-2, dtype=torch.uint8)


# --- legacy 32-value blocks -------------------------------------------------------------------------


def _signed_scale(x: torch.Tensor, levels: int) -> torch.Tensor:
    """Q4_0/Q5_0 scale: the value of largest magnitude maps to -levels/2, keeping its sign. (n, 1)"""
    extreme = x.gather(1, x.abs().argmax(dim=1, keepdim=True))
    return extreme / -(levels // 2)


def _five_bit_fields(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (n, 32) in [0, 31] -> (qh (n, 4): bit 4 of every value, qs (n, 16): low nibbles)."""
    high = (q.to(torch.uint8) >> 4).view(-1, 4, 8).transpose(1, 2)  # (n, 8, 4): byte i//8 holds bit i%8
    return _pack_bits(high), _pack_nibbles((q.to(torch.uint8) & 0x0F).view(-1, 2, 16))


def _q8_0(x: torch.Tensor) -> torch.Tensor:
    d = x.abs().amax(dim=1, keepdim=True) / 127  # (n, 1)
    q = _round_half_away(x * _inverse(d)).to(torch.int8)  # (n, 32)
    return torch.cat([_f16_bytes(d), q.view(torch.uint8)], dim=1)


def _q4_0(x: torch.Tensor) -> torch.Tensor:
    d = _signed_scale(x, 16)
    q = torch.trunc(x * _inverse(d) + 8.5).clamp(0, 15)  # (n, 32)
    return torch.cat([_f16_bytes(d), _pack_nibbles(q.view(-1, 2, 16))], dim=1)


def _q5_0(x: torch.Tensor) -> torch.Tensor:
    d = _signed_scale(x, 32)
    q = torch.trunc(x * _inverse(d) + 16.5).clamp(0, 31)
    qh, qs = _five_bit_fields(q)
    return torch.cat([_f16_bytes(d), qh, qs], dim=1)


def _min_range(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1/Q5_1: d = (max - min) / (levels - 1), codes counted up from min. Returns d, min, q."""
    lo, hi = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)
    d = (hi - lo) / (levels - 1)
    q = torch.trunc((x - lo) * _inverse(d) + 0.5).clamp(0, levels - 1)
    return d, lo, q


def _q4_1(x: torch.Tensor) -> torch.Tensor:
    d, lo, q = _min_range(x, 16)
    return torch.cat([_f16_bytes(d), _f16_bytes(lo), _pack_nibbles(q.view(-1, 2, 16))], dim=1)


def _q5_1(x: torch.Tensor) -> torch.Tensor:
    d, lo, q = _min_range(x, 32)
    qh, qs = _five_bit_fields(q)
    return torch.cat([_f16_bytes(d), _f16_bytes(lo), qh, qs], dim=1)


# --- k-quants: 256-value super-blocks ---------------------------------------------------------------


def _fit_scale_min(
    x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of x (m, k): scale s >= 0 and offset b <= 0 minimizing sum w (s*q + b - x)^2, q in [0, nmax].

    Starts from the min/max grid, then tries nstep+1 slightly stretched grids; for each, the codes are fixed
    and (s, b) is the weighted least-squares solution; the best is kept. Returns (s, -b), both (m,).
    """
    lo = x.amin(dim=1).clamp(max=0)  # the offset never goes positive, so zero stays representable
    hi = x.amax(dim=1)
    span = torch.where(hi > lo, hi - lo, torch.ones_like(hi))
    sum_w, sum_x = w.sum(1), (w * x).sum(1)

    def codes(inv_scale: torch.Tensor) -> torch.Tensor:
        return torch.round(inv_scale[:, None] * (x - lo[:, None])).clamp(0, nmax)

    def error(s: torch.Tensor, b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return (w * (s[:, None] * q + b[:, None] - x) ** 2).sum(1)

    scale, offset = span / nmax, lo.clone()
    best = error(scale, offset, codes(nmax / span))
    for step in range(nstep + 1):
        q = codes((rmin + rdelta * step + nmax) / span)
        sum_l, sum_l2, sum_xl = (w * q).sum(1), (w * q * q).sum(1), (w * q * x).sum(1)
        det = sum_w * sum_l2 - sum_l * sum_l
        s = (sum_w * sum_xl - sum_x * sum_l) / det
        b = (sum_l2 * sum_x - sum_l * sum_xl) / det
        # a positive offset is not representable: refit the scale alone with b = 0
        s = torch.where(b > 0, sum_xl / sum_l2, s)
        b = b.clamp(max=0)
        err = error(s, b, q)
        better = (det > 0) & (err < best)
        scale, offset = torch.where(better, s, scale), torch.where(better, b, offset)
        best = torch.where(better, err, best)
    flat = hi <= lo  # constant sub-block (all equal to a value <= 0): the offset alone represents it
    return torch.where(flat, torch.zeros_like(scale), scale), -offset


def _fit_symmetric_scale(x: torch.Tensor, nmax: int) -> torch.Tensor:
    """Per row of x (m, k): a scale s for codes q in [-nmax, nmax-1] maximizing the x^2-weighted fit.

    Tries the grid through the largest-magnitude value and 18 slightly stretched or shrunk grids.
    """
    extreme = x.gather(1, x.abs().argmax(dim=1, keepdim=True)).squeeze(1)  # (m,)
    inv_extreme = _inverse(extreme)
    w = x * x

    def fit(stretch: float) -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.round(-(nmax + stretch) * inv_extreme[:, None] * x).clamp(-nmax, nmax - 1)
        sum_lx, sum_l2 = (w * x * q).sum(1), (w * q * q).sum(1)
        return sum_lx, sum_l2

    sum_lx, sum_l2 = fit(0.0)
    scale = torch.where(sum_l2 > 0, sum_lx / sum_l2, torch.zeros_like(sum_lx))
    best = scale * sum_lx
    for step in (*range(-9, 0), *range(1, 10)):
        sum_lx, sum_l2 = fit(0.1 * step)
        better = (sum_l2 > 0) & (sum_lx * sum_lx > best * sum_l2)
        scale = torch.where(better, sum_lx / sum_l2, scale)
        best = torch.where(better, scale * sum_lx, best)
    return scale


def pack_k_scales(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """Eight 6-bit scales and mins (n, 8) -> the 12-byte Q4_K/Q5_K field (inverse of k_scales_mins)."""
    sc, mn = sc.to(torch.uint8), mn.to(torch.uint8)
    lo_sc = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)  # sub-blocks 4-7 park their top 2 bits here
    lo_m = (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6)
    packed = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return torch.cat([lo_sc, lo_m, packed], dim=1)


def _k_scales(x: torch.Tensor, nmax: int, rmin: float, nstep: int):
    """Q4_K/Q5_K: fit each 32-value sub-block, quantize the fits to 6 bits, and requantize x on them.

    Returns (header (n, 16) bytes = d, dmin, scales; q (n, 8, 32) codes in [0, nmax]).
    """
    n = x.shape[0]
    sub = x.view(n * 8, 32)
    # weight each value by its magnitude plus the sub-block's RMS: large values matter more
    w = sub.abs() + sub.pow(2).mean(1, keepdim=True).sqrt()
    scale, neg_min = _fit_scale_min(sub, w, nmax, rmin, 0.1, nstep)
    scale, neg_min = scale.view(n, 8), neg_min.view(n, 8)
    max_scale, max_min = scale.amax(1, keepdim=True), neg_min.amax(1, keepdim=True)  # (n, 1)
    sc = torch.round(63 * _inverse(max_scale) * scale).clamp(max=63)
    mn = torch.round(63 * _inverse(max_min) * neg_min).clamp(max=63)
    d, dmin = (max_scale / 63).half().float(), (max_min / 63).half().float()  # as stored
    step = d * sc  # (n, 8) the effective per-sub-block scale after 6-bit rounding
    offset = dmin * mn
    q = torch.round((x.view(n, 8, 32) + offset[..., None]) * _inverse(step)[..., None]).clamp(0, nmax)
    header = torch.cat([_f16_bytes(d), _f16_bytes(dmin), pack_k_scales(sc, mn)], dim=1)
    return header, q


def _q4_k(x: torch.Tensor) -> torch.Tensor:
    header, q = _k_scales(x, 15, -1.0, 20)
    return torch.cat([header, _pack_nibbles(q.view(-1, 4, 2, 32)).flatten(1)], dim=1)


def _q5_k(x: torch.Tensor) -> torch.Tensor:
    header, q = _k_scales(x, 31, -0.5, 15)
    q = q.to(torch.uint8)  # (n, 8, 32)
    qh = _pack_bits(q >> 4)  # (n, 32): bit j of byte i is bit 4 of value i of sub-block j
    qs = _pack_nibbles((q & 0x0F).view(-1, 4, 2, 32)).flatten(1)
    return torch.cat([header, qh, qs], dim=1)


def _q6_k(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    scale = _fit_symmetric_scale(x.view(n * 16, 16), 32).view(n, 16)
    extreme = scale.gather(1, scale.abs().argmax(dim=1, keepdim=True))  # (n, 1)
    inv = -128 * _inverse(extreme)  # the largest sub-block scale becomes -128 (int8 range)
    d = _inverse(inv).half().float()  # (n, 1) as stored
    sc = torch.round(inv * scale).clamp(-128, 127)  # (n, 16) in [-128, 127]
    step = (d * sc)[..., None]  # (n, 16, 1)
    q = (torch.round(x.view(n, 16, 16) * _inverse(step)).clamp(-32, 31) + 32).to(torch.uint8)
    q = q.view(n, 2, 4, 32)  # [half, quarter, i]: quarter k of a half is values 32k..32k+31
    ql = ((q[:, :, :2] & 0x0F) | ((q[:, :, 2:] & 0x0F) << 4)).flatten(1)  # (n, 128)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=x.device).view(4, 1)
    qh = ((q >> 4) << shifts).sum(2, dtype=torch.uint8)  # (n, 2, 32): 2 bits from each quarter
    return torch.cat([ql, qh.flatten(1), sc.to(torch.int8).view(torch.uint8), _f16_bytes(d)], dim=1)


_BLOCK_PACK = {
    QT.Q8_0: _q8_0,
    QT.Q4_0: _q4_0,
    QT.Q4_1: _q4_1,
    QT.Q5_0: _q5_0,
    QT.Q5_1: _q5_1,
    QT.Q4_K: _q4_k,
    QT.Q5_K: _q5_k,
    QT.Q6_K: _q6_k,
}
PACKABLE_TYPES: frozenset[int] = frozenset(int(t) for t in (*_BLOCK_PACK, *FLOAT_DTYPES))


def _pack_rows(rows: torch.Tensor, qtype: QT) -> torch.Tensor:
    """(r, cols) float32 -> (r, row_bytes) uint8."""
    if qtype in FLOAT_DTYPES:  # round to nearest even, like ggml's fp32 -> fp16/bf16
        return rows.to(FLOAT_DTYPES[qtype]).view(torch.uint8)
    n_rows = rows.shape[0]
    blocks = rows.reshape(-1, block_size(qtype))
    return _BLOCK_PACK[qtype](blocks).view(n_rows, -1)


def quantize(x: torch.Tensor | np.ndarray, qtype: int) -> np.ndarray:
    """Quantize float values [..., cols] to GGML `qtype`: uint8 [..., row_bytes] (cols: whole blocks).

    A CUDA tensor is packed on its GPU (much faster for the k-quant search); the result is on the host.
    """
    if int(qtype) not in PACKABLE_TYPES:
        names = ", ".join(type_name(t) for t in sorted(PACKABLE_TYPES))
        raise FlashtreeError(f"cannot quantize to {type_name(qtype)} (supported: {names})")
    qtype = QT(qtype)
    x = torch.as_tensor(x)
    if not x.is_floating_point():
        raise FlashtreeError(f"quantize needs float values, got {x.dtype}")
    lead, cols = tuple(x.shape[:-1]), x.shape[-1]
    out = np.empty((*lead, row_bytes(qtype, cols)), dtype=np.uint8)
    rows, out_rows = x.reshape(-1, cols), out.reshape(-1, out.shape[-1])
    chunk = max(1, _CHUNK_VALUES // max(cols, 1))
    for start in range(0, rows.shape[0], chunk):
        part = rows[start : start + chunk].detach().float()  # packed where it lives: CPU or GPU
        if not torch.isfinite(part).all():  # NaN/Inf would silently poison whole blocks
            raise FlashtreeError("cannot quantize non-finite values (NaN or Inf)")
        out_rows[start : start + chunk] = _pack_rows(part, qtype).cpu().numpy()
    return out


# --- random packed weights --------------------------------------------------------------------------


def _uniform_std(levels: int) -> float:
    """Standard deviation of a code drawn uniformly from `levels` consecutive integers."""
    return math.sqrt((levels * levels - 1) / 12)


def _random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    words = rng.bit_generator.random_raw(-(-n // 8))  # the raw 64-bit stream is the fastest source
    return words.view(np.uint8)[:n]


def _put_f16(blocks: np.ndarray, at: int, value: float | np.ndarray) -> None:
    blocks[:, at : at + 2] = np.asarray(value, dtype=np.float16).reshape(-1, 1).view(np.uint8)


def random_blocks(
    qtype: int, rows: int, cols: int, rng: np.random.Generator, scale: float = 0.02
) -> np.ndarray:
    """Random packed weights (rows, row_bytes): random codes, fixed finite scales, values ~ N(0, scale)-ish.

    Codes are uniform random bits; the block and sub-block scales are set so each value has mean ~0 and
    standard deviation ~scale. Fast (one pass of random bytes plus small scale writes), never NaN/Inf.
    """
    qtype = QT(qtype)
    if qtype in FLOAT_DTYPES:
        values = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(scale)
        return quantize(values, qtype)
    if int(qtype) not in PACKABLE_TYPES:
        raise FlashtreeError(f"cannot write random {type_name(qtype)} blocks")
    n_blocks = rows * (cols // block_size(qtype))
    blocks = _random_bytes(rng, n_blocks * block_bytes(qtype)).reshape(n_blocks, block_bytes(qtype))
    _set_random_scales(blocks, qtype, rng, scale)
    return blocks.reshape(rows, row_bytes(qtype, cols))


def _set_random_scales(blocks: np.ndarray, qtype: QT, rng: np.random.Generator, scale: float) -> None:
    """Overwrite the scale fields of random blocks so values are centred with standard deviation ~scale."""
    n = blocks.shape[0]
    if qtype == QT.Q8_0:
        _put_f16(blocks, 0, scale / _uniform_std(256))
    elif qtype in (QT.Q4_0, QT.Q5_0):  # symmetric codes: value = d * (q - levels/2)
        _put_f16(blocks, 0, scale / _uniform_std(16 if qtype == QT.Q4_0 else 32))
    elif qtype in (QT.Q4_1, QT.Q5_1):  # value = d * q + m, centred by m = -d * (levels - 1) / 2
        levels = 16 if qtype == QT.Q4_1 else 32
        d = scale / _uniform_std(levels)
        _put_f16(blocks, 0, d)
        _put_f16(blocks, 2, -d * (levels - 1) / 2)
    elif qtype in (QT.Q4_K, QT.Q5_K):
        # value = d*sc*q - dmin*m with m = sc and dmin = d*nmax/2 centres every sub-block
        nmax = 15 if qtype == QT.Q4_K else 31
        d = scale / (_uniform_std(nmax + 1) * 47.5)  # 47.5 = mean of the sub-block scales
        _put_f16(blocks, 0, d)
        _put_f16(blocks, 2, d * nmax / 2)
        # packing scales per block is slow at 16 GB scale: draw each block's field from 4096 packed ones
        sc = torch.from_numpy(rng.integers(32, 64, (4096, 8), dtype=np.uint8))
        blocks[:, 4:16] = pack_k_scales(sc, sc).numpy()[rng.integers(0, 4096, n)]
    elif qtype == QT.Q6_K:  # value = d * sc * (q - 32), sc int8 > 0
        blocks[:, 192:208] = rng.integers(32, 128, (n, 16), dtype=np.uint8)
        _put_f16(blocks, 208, scale / (_uniform_std(64) * 79.5))  # 79.5 = mean of the sub-block scales
