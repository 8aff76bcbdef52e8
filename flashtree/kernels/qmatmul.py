"""y = x @ W^T straight from GGUF-packed weights (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K), in Triton.

Repack (once, at load, lossless, not a byte more). Each row is cut into super-blocks of P x W values:
one GGUF block of 256 values for the k-quants, G blocks of 32 for the legacy types (G in 8/4/2/1,
whichever divides the row). A super-block is stored as a few separate aligned arrays ("fields"). The
4-bit codes are regrouped as int32 words with nibble p of word w holding value W*p + w ("plane" p), so
one word gives 8 planes and each plane shares one scale (a k-quant sub-block, a legacy block). Every
other byte keeps its GGUF value; the repack is a fixed permutation of the super-block's nibbles
(`Layout.source`), which `unpack` inverts exactly.

Kernel. One program owns BN output rows and streams their super-blocks, decoding them in registers:
integer codes become floats by OR-ing them into the mantissa of 2**23 (exact, and cheaper than
int->float conversion, which runs at a fraction of the FMA rate). With M = 1 the values are multiplied
into an fp32 accumulator per lane (FMA units); with 2 <= M <= 64 the tile goes to the tensor cores as
bf16 (swap-AB: the weight tile is the A operand, so BN rows x M tokens). Either way each weight byte
is read once for all M rows. Above 64 rows the weight is dequantized to bf16 by the same decoder and
multiplied by cuBLAS (prefill is compute-bound; the extra pass costs ~10%).

Measured on an H200 (bench/results/issue6-2026-12-02): correct for every type, but only 0.15-0.19 of
copy bandwidth at M = 1 and ~0.1 at M = 16-64, slower than dense bf16 cuBLAS. The compiled loop
(sm_90 SASS) shows why: Triton lays the (rows, planes, W) decode tile out with planes across warps,
so every super-block goes through shared memory with barriers, and the word loads are scalar: ~9
instructions per weight value where ~4 would keep up with HBM. See the issue-6 report for the fix
(a row-interleaved repack so one thread owns whole super-blocks of a row, 2-D tiles only).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

from flashtree.errors import FlashtreeError
from flashtree.quant.formats import QK_K, QT, block_bytes, row_bytes, type_name

KERNEL_TYPES = frozenset(int(t) for t in (QT.Q4_0, QT.Q4_1, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K))
MAX_FUSED_M = 64  # above this many rows: dequantize to bf16 + cuBLAS


@dataclass(frozen=True)
class Layout:
    """How one GGUF type's super-block is repacked: P planes of W values, and the fields that hold it."""

    qtype: int
    group: int  # GGUF blocks per super-block
    planes: int  # P
    width: int  # W (values per plane)
    fields: tuple[tuple[str, int, torch.dtype], ...]  # (name, bytes per super-block, element dtype)
    source: torch.Tensor  # (2 * superblock bytes,) long: the GGUF nibble that lands at each repacked nibble

    @property
    def values(self) -> int:
        return self.planes * self.width

    @property
    def superblock_bytes(self) -> int:
        return self.group * block_bytes(self.qtype)


def _bytes(byte_index: torch.Tensor) -> torch.Tensor:
    """Nibble sources that copy whole bytes: byte b -> nibbles (2b, 2b + 1)."""
    return torch.stack([2 * byte_index, 2 * byte_index + 1], dim=-1).flatten()


def _words(value_nibble: torch.Tensor, width: int) -> torch.Tensor:
    """Nibble sources of the plane words: value_nibble (8 * W,) is where value v's 4 low bits live;
    nibble p of word w (repacked nibble 8w + p) takes value W*p + w."""
    return value_nibble.view(8, width).t().flatten()


def _k_quant_words(qs_at: int) -> torch.Tensor:
    """Q4_K/Q5_K codes: 32-byte groups of qs hold sub-block 2g (low nibbles) and 2g+1 (high)."""
    v = torch.arange(QK_K)
    sub, pos = v // 32, v % 32
    return _words(2 * (qs_at + 32 * (sub // 2) + pos) + sub % 2, 32)


def _q6_k_words() -> torch.Tensor:
    """Q6_K low 4 bits: ql byte 64h + j holds value 128h + j (low nibble) and 128h + 64 + j (high)."""
    v = torch.arange(QK_K)
    half, r = v // 128, v % 128
    return _words(2 * (64 * half + r % 64) + r // 64, 32)


def _legacy_words(group: int, qs_at: int, bb: int) -> torch.Tensor:
    """Q4_0/Q4_1: block b's value j is nibble j // 16 of byte qs_at + j % 16."""
    v = torch.arange(32 * group)
    blk, j = v // 32, v % 32
    return _words(2 * (bb * blk + qs_at + j % 16) + j // 16, 4 * group)


def _per_block(group: int, bb: int, at: int, size: int) -> torch.Tensor:
    """Bytes [at, at + size) of each of the `group` blocks, block after block."""
    return (bb * torch.arange(group)[:, None] + at + torch.arange(size)[None, :]).flatten()


def _span(start: int, stop: int) -> torch.Tensor:
    return torch.arange(start, stop)


@cache
def layout(qtype: int, n_cols: int) -> Layout:
    """The repacked layout of a `qtype` matrix with rows of `n_cols` values."""
    qtype = QT(qtype)
    if int(qtype) not in KERNEL_TYPES:
        raise FlashtreeError(f"no quantized-matmul kernel for {type_name(qtype)}")
    row_bytes(qtype, n_cols)  # raises unless the row is whole blocks
    i32, u8, i8, f16 = torch.int32, torch.uint8, torch.int8, torch.float16
    if qtype == QT.Q4_K:
        parts = [("qw", _k_quant_words(16), i32), ("hdr", _bytes(_span(0, 16)), u8)]
        return _make(qtype, 1, 8, 32, parts)
    if qtype == QT.Q5_K:
        parts = [
            ("qw", _k_quant_words(48), i32),
            ("qh", _bytes(_span(16, 48)), u8),
            ("hdr", _bytes(_span(0, 16)), u8),
        ]
        return _make(qtype, 1, 8, 32, parts)
    if qtype == QT.Q6_K:
        parts = [
            ("qw", _q6_k_words(), i32),
            ("qh", _bytes(_span(128, 192)), u8),
            ("sc", _bytes(_span(192, 208)), i8),
            ("d", _bytes(_span(208, 210)), f16),
        ]
        return _make(qtype, 1, 8, 32, parts)
    group = next(g for g in (8, 4, 2, 1) if (n_cols // 32) % g == 0)
    bb = block_bytes(qtype)
    if qtype == QT.Q8_0:
        parts = [
            ("q", _bytes(_per_block(group, bb, 2, 32)), i8),
            ("d", _bytes(_per_block(group, bb, 0, 2)), f16),
        ]
        return _make(qtype, group, group, 32, parts)
    if qtype == QT.Q4_0:
        parts = [("qw", _legacy_words(group, 2, bb), i32), ("d", _bytes(_per_block(group, bb, 0, 2)), f16)]
    else:  # Q4_1
        parts = [
            ("qw", _legacy_words(group, 4, bb), i32),
            ("d", _bytes(_per_block(group, bb, 0, 2)), f16),
            ("m", _bytes(_per_block(group, bb, 2, 2)), f16),
        ]
    return _make(qtype, group, 8, 4 * group, parts)


def _make(qtype: QT, group: int, planes: int, width: int, parts: list) -> Layout:
    source = torch.cat([src for _, src, _ in parts])
    fields = tuple((name, src.numel() // 2, dtype) for name, src, dtype in parts)
    lay = Layout(int(qtype), group, planes, width, fields, source)
    assert torch.equal(source.sort().values, torch.arange(2 * lay.superblock_bytes)), "not a permutation"
    return lay


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """(..., n) bytes -> (..., 2n) nibbles, low nibble first."""
    return torch.stack([b & 0x0F, b >> 4], dim=-1).flatten(-2)


def _join(nib: torch.Tensor) -> torch.Tensor:
    """(..., 2n) nibbles -> (..., n) bytes."""
    return nib[..., 0::2] | (nib[..., 1::2] << 4)


def repack(raw: torch.Tensor, qtype: int, n_cols: int) -> list[torch.Tensor]:
    """GGUF rows (n_rows, row_bytes) uint8 -> the layout's fields, each (n_rows, n_superblocks, k)."""
    lay = layout(qtype, n_cols)
    n_rows = raw.shape[0]
    sb = raw.reshape(n_rows, -1, lay.superblock_bytes)  # (rows, n_sb, bytes)
    moved = _join(_nibbles(sb)[..., lay.source.to(raw.device)])
    fields, at = [], 0
    for _, size, dtype in lay.fields:
        fields.append(moved[..., at : at + size].contiguous().view(dtype))
        at += size
    return fields


def unpack(fields: list[torch.Tensor], qtype: int, n_cols: int) -> torch.Tensor:
    """Inverse of `repack`: the original GGUF rows (n_rows, row_bytes) uint8, bit for bit."""
    lay = layout(qtype, n_cols)
    moved = _nibbles(torch.cat([f.view(torch.uint8) for f in fields], dim=-1))
    nib = torch.empty_like(moved)
    nib[..., lay.source.to(moved.device)] = moved
    return _join(nib).reshape(moved.shape[0], -1)


# --- Triton --------------------------------------------------------------------------------------------

# GGML type ids as compile-time constants, for the kernels' static branches
_Q4_0, _Q4_1, _Q8_0 = tl.constexpr(int(QT.Q4_0)), tl.constexpr(int(QT.Q4_1)), tl.constexpr(int(QT.Q8_0))
_Q4_K, _Q5_K, _Q6_K = tl.constexpr(int(QT.Q4_K)), tl.constexpr(int(QT.Q5_K)), tl.constexpr(int(QT.Q6_K))


@triton.jit
def _to_float(q, bias: tl.constexpr):
    """float(q) - bias, exactly, for int32 0 <= q < 2**23: q becomes the mantissa of 2**23 + q."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + bias)


@triton.jit
def _planes(qw_ptr, base, row_ok, W: tl.constexpr):
    """The 8 nibble planes of one super-block's words: (BN, 8, W) int32 in [0, 15]."""
    w = tl.arange(0, W)
    words = tl.load(qw_ptr + base * W + w[None, :], mask=row_ok[:, None], other=0)  # (BN, W)
    shifts = tl.arange(0, 8) * 4
    return (words[:, None, :] >> shifts[None, :, None]) & 0xF


@triton.jit
def _load_rows(ptr, base, row_ok, size: tl.constexpr, idx):
    """Elements idx (shape (K,)) of each row's `size`-element field slice: (BN, K)."""
    return tl.load(ptr + base * size + idx[None, :], mask=row_ok[:, None], other=0)


@triton.jit
def _k_scales_mins(hdr_ptr, hdr16_ptr, base, row_ok):
    """Q4_K/Q5_K header -> per-plane scale d*sc and offset dmin*m, (BN, 8) fp32 each."""
    j = tl.arange(0, 8)
    b_j = _load_rows(hdr_ptr, base, row_ok, 16, 4 + j).to(tl.int32)  # scale bytes 0..7
    b_j4 = _load_rows(hdr_ptr, base, row_ok, 16, 8 + j).to(tl.int32)  # scale bytes 4..11
    b_jm4 = _load_rows(hdr_ptr, base, row_ok, 16, 4 + j % 4).to(tl.int32)  # byte j - 4 for j >= 4
    low = j[None, :] < 4
    sc = tl.where(low, b_j & 63, (b_j4 & 15) | ((b_jm4 >> 6) << 4))
    mn = tl.where(low, b_j4 & 63, (b_j4 >> 4) | ((b_j >> 6) << 4))
    d = _load_rows(hdr16_ptr, base, row_ok, 8, tl.arange(0, 1)).to(tl.float32)  # (BN, 1)
    dmin = _load_rows(hdr16_ptr, base, row_ok, 8, tl.arange(0, 1) + 1).to(tl.float32)
    return d * sc.to(tl.float32), dmin * mn.to(tl.float32)


@triton.jit
def _decode(a_ptr, b_ptr, c_ptr, d_ptr, base, row_ok, QTYPE: tl.constexpr, G: tl.constexpr, W: tl.constexpr):
    """One super-block of BN rows -> (q (BN, P, W) fp32, scale (BN, P, 1 or W), offset (BN, P)):
    value = q * scale - offset (the offset is only meaningful for the types that have one)."""
    j = tl.arange(0, 8)
    if QTYPE == _Q4_K:  # a = words, b = header bytes, c = header as fp16
        q = _to_float(_planes(a_ptr, base, row_ok, W), 0.0)
        scale, offset = _k_scales_mins(b_ptr, c_ptr, base, row_ok)
        scale = scale[:, :, None]
    elif QTYPE == _Q5_K:  # a = words, b = qh (bit p of byte w = plane p's 5th bit), c = header, d = fp16
        qh = _load_rows(b_ptr, base, row_ok, 32, tl.arange(0, 32)).to(tl.int32)  # (BN, 32)
        high = ((qh[:, None, :] >> j[None, :, None]) & 1) << 4
        q = _to_float(_planes(a_ptr, base, row_ok, W) | high, 0.0)
        scale, offset = _k_scales_mins(c_ptr, d_ptr, base, row_ok)
        scale = scale[:, :, None]
    elif QTYPE == _Q6_K:  # a = words, b = qh (64 bytes), c = int8 scales per 16 values, d = fp16 d
        w = tl.arange(0, 32)
        qh_lo = _load_rows(b_ptr, base, row_ok, 64, w).to(tl.int32)  # planes 0-3, 2 bits each
        qh_hi = _load_rows(b_ptr, base, row_ok, 64, w + 32).to(tl.int32)  # planes 4-7
        high = (((qh_lo | (qh_hi << 8))[:, None, :] >> (2 * j)[None, :, None]) & 3) << 4
        q = _to_float(_planes(a_ptr, base, row_ok, W) | high, 32.0)
        d = _load_rows(d_ptr, base, row_ok, 1, tl.arange(0, 1)).to(tl.float32)  # (BN, 1)
        s_even = d * _load_rows(c_ptr, base, row_ok, 16, 2 * j).to(
            tl.float32
        )  # (BN, 8): values 0-15 of a plane
        s_odd = d * _load_rows(c_ptr, base, row_ok, 16, 2 * j + 1).to(tl.float32)  # values 16-31
        scale = tl.where(w[None, None, :] < 16, s_even[:, :, None], s_odd[:, :, None])
        offset = s_even
    elif QTYPE == _Q8_0:  # a = int8 codes, planes are the G blocks; b = fp16 d per block
        p = tl.arange(0, G)
        w = tl.arange(0, 32)
        codes = tl.load(
            a_ptr + base[:, :, None] * (32 * G) + (32 * p)[None, :, None] + w[None, None, :],
            mask=row_ok[:, None, None],
            other=0,
        ).to(tl.int32)  # (BN, G, 32) in [-128, 127]
        # 0x4B400000 is 1.5 * 2**23: a signed code added to its mantissa stays inside it
        q = (codes + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
        offset = _load_rows(b_ptr, base, row_ok, G, p).to(tl.float32)  # (BN, G); unused: no offset
        scale = offset[:, :, None]
    else:  # Q4_0 / Q4_1: a = words (W = 4G), b = fp16 d per block, c = fp16 m per block (Q4_1)
        blk = (j * G) // 8  # plane p spans values [W*p, W*p + W), all inside block W*p // 32
        scale = _load_rows(b_ptr, base, row_ok, G, blk).to(tl.float32)
        if QTYPE == _Q4_0:
            q = _to_float(_planes(a_ptr, base, row_ok, W), 8.0)
            offset = scale
        else:
            q = _to_float(_planes(a_ptr, base, row_ok, W), 0.0)
            offset = -_load_rows(c_ptr, base, row_ok, G, blk).to(tl.float32)
        scale = scale[:, :, None]
    return q, scale, offset


@triton.jit
def _qmm_kernel(
    x_ptr, y_ptr, a_ptr, b_ptr, c_ptr, d_ptr,
    M, N, n_sb, stride_x, stride_y,
    QTYPE: tl.constexpr, G: tl.constexpr, P: tl.constexpr, W: tl.constexpr, HAS_OFFSET: tl.constexpr,
    BN: tl.constexpr, BM: tl.constexpr, DOT: tl.constexpr, UNROLL: tl.constexpr, DOT_DTYPE: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    row_ok = rows < N
    row_sb = rows.to(tl.int64)[:, None] * n_sb  # (BN, 1): first super-block of each row
    kk = tl.arange(0, P)[:, None] * W + tl.arange(0, W)[None, :]  # (P, W) value index in a super-block
    if DOT:
        ms = tl.arange(0, BM)
        m_ok = ms < M
        acc = tl.zeros((BN, BM), tl.float32)
    else:
        acc = tl.zeros((BN, P, W), tl.float32)
        acc_off = tl.zeros((BN, P), tl.float32)
    for s0 in range(0, n_sb, UNROLL):
        for u in tl.static_range(UNROLL):  # independent super-blocks: their loads overlap
            s = s0 + u
            q, scale, offset = _decode(a_ptr, b_ptr, c_ptr, d_ptr, row_sb + s, row_ok, QTYPE, G, W)
            k0 = s * (P * W)
            if DOT:
                w = q * scale
                if HAS_OFFSET:
                    w = w - offset[:, :, None]
                w = tl.reshape(w.to(DOT_DTYPE), (BN, P * W))
                k = k0 + tl.arange(0, P * W)
                xt = tl.load(x_ptr + ms[None, :] * stride_x + k[:, None], mask=m_ok[None, :], other=0.0)
                acc += tl.dot(w, xt.to(DOT_DTYPE))  # (BN, BM)
            else:
                xv = tl.load(x_ptr + k0 + kk).to(tl.float32)  # (P, W)
                acc += q * (scale * xv[None, :, :])
                if HAS_OFFSET:
                    acc_off += offset * tl.sum(xv, axis=1)[None, :]
    if DOT:
        out = acc
        mask = row_ok[:, None] & m_ok[None, :]
        tl.store(y_ptr + ms[None, :] * stride_y + rows[:, None], out.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        out = tl.sum(tl.sum(acc, axis=2), axis=1)
        if HAS_OFFSET:
            out -= tl.sum(acc_off, axis=1)
        tl.store(y_ptr + rows, out.to(y_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _dequant_kernel(
    out_ptr, a_ptr, b_ptr, c_ptr, d_ptr, N, n_sb,
    QTYPE: tl.constexpr, G: tl.constexpr, P: tl.constexpr, W: tl.constexpr, HAS_OFFSET: tl.constexpr,
    BN: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    row_ok = rows < N
    s = tl.program_id(1)
    q, scale, offset = _decode(a_ptr, b_ptr, c_ptr, d_ptr, rows.to(tl.int64)[:, None] * n_sb + s, row_ok,
                               QTYPE, G, W)  # fmt: skip
    w = q * scale
    if HAS_OFFSET:
        w = w - offset[:, :, None]
    kk = s * (P * W) + tl.arange(0, P)[:, None] * W + tl.arange(0, W)[None, :]  # (P, W)
    ptrs = out_ptr + rows.to(tl.int64)[:, None, None] * (n_sb * P * W) + kk[None, :, :]
    tl.store(ptrs, w.to(out_ptr.dtype.element_ty), mask=row_ok[:, None, None])


# --- launchers -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TileConfig:
    rows: int  # BN: output rows per program
    warps: int
    unroll: int  # super-blocks decoded per loop step (used when it divides the row's count)


# Keys: "gemv" (M = 1) and "dot16"/"dot32"/"dot64" (M padded to that many tensor-core columns).
# Chosen by bench/gpu_kernels.py's sweep on an H200 (bench/results/issue6-2026-12-02/kernels_tune.json):
# small row tiles won both (more programs in flight; the decode, not x traffic, is what costs).
DEFAULT_TILES = {
    "gemv": TileConfig(8, 2, 2),
    "dot16": TileConfig(16, 4, 1),
    "dot32": TileConfig(16, 4, 1),
    "dot64": TileConfig(16, 4, 1),
}


def tiles_from_env() -> dict[str, TileConfig]:
    """DEFAULT_TILES, with overrides from FLASHTREE_QMM_TILES (JSON {"gemv": [rows, warps, unroll], ...}),
    the way a tuning sweep hands its choice to a benchmark run."""
    text = os.environ.get("FLASHTREE_QMM_TILES")
    if not text:
        return dict(DEFAULT_TILES)
    try:
        chosen = {key: TileConfig(*map(int, value)) for key, value in json.loads(text).items()}
    except (ValueError, TypeError) as e:
        raise FlashtreeError(
            f"FLASHTREE_QMM_TILES: expected JSON {{key: [rows, warps, unroll]}} ({e})"
        ) from None
    unknown = set(chosen) - set(DEFAULT_TILES)
    if unknown:
        raise FlashtreeError(
            f"FLASHTREE_QMM_TILES: unknown keys {sorted(unknown)} (use {sorted(DEFAULT_TILES)})"
        )
    return DEFAULT_TILES | chosen


TILES = tiles_from_env()


def tile_key(m: int) -> str:
    return "gemv" if m == 1 else f"dot{max(16, triton.next_power_of_2(m))}"


def _kernel_args(fields: list[torch.Tensor], lay: Layout) -> list[torch.Tensor]:
    """The four pointer arguments _decode expects for this type (unused ones repeat the first)."""
    if lay.qtype == QT.Q4_K:  # words, header bytes, header as fp16
        args = [fields[0], fields[1], fields[1].view(torch.float16)]
    elif lay.qtype == QT.Q5_K:  # words, qh, header bytes, header as fp16
        args = [fields[0], fields[1], fields[2], fields[2].view(torch.float16)]
    else:
        args = list(fields)
    return args + [args[0]] * (4 - len(args))


def _has_offset(qtype: int) -> bool:
    return qtype in (QT.Q4_K, QT.Q5_K, QT.Q4_1)


def quant_matmul(
    x: torch.Tensor, fields: list[torch.Tensor], qtype: int, n_rows: int, n_cols: int
) -> torch.Tensor:
    """x (M, n_cols) @ W^T for a repacked W (n_rows, n_cols) -> (M, n_rows) in x's dtype.

    Runs the fused kernel for M <= 64 and dequantize + matmul above. Works on CUDA tensors, and on CPU
    tensors under TRITON_INTERPRET=1."""
    lay = layout(qtype, n_cols)
    m = x.shape[0]
    if m > MAX_FUSED_M:
        return x @ dequantize_packed(fields, qtype, n_rows, n_cols, x.dtype).t()
    x = x.contiguous()
    y = torch.empty(m, n_rows, dtype=x.dtype, device=x.device)
    n_sb = n_cols // lay.values
    tile = TILES[tile_key(m)]
    unroll = tile.unroll if n_sb % tile.unroll == 0 else 1
    grid = (triton.cdiv(n_rows, tile.rows),)
    _qmm_kernel[grid](
        x, y, *_kernel_args(fields, lay),
        m, n_rows, n_sb, x.stride(0), y.stride(0),
        QTYPE=lay.qtype, G=lay.group, P=lay.planes, W=lay.width, HAS_OFFSET=_has_offset(lay.qtype),
        BN=tile.rows, BM=max(16, triton.next_power_of_2(m)), DOT=m > 1, UNROLL=unroll,
        DOT_DTYPE=tl.bfloat16 if x.is_cuda else tl.float32,  # the CPU interpreter's bf16 dot is wrong
        num_warps=tile.warps,
    )  # fmt: skip
    return y


def dequantize_packed(
    fields: list[torch.Tensor], qtype: int, n_rows: int, n_cols: int, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """The dense (n_rows, n_cols) weight, decoded by the kernels' own decoder."""
    lay = layout(qtype, n_cols)
    n_sb = n_cols // lay.values
    out = torch.empty(n_rows, n_cols, dtype=dtype, device=fields[0].device)
    rows = 32
    _dequant_kernel[(triton.cdiv(n_rows, rows), n_sb)](
        out, *_kernel_args(fields, lay), n_rows, n_sb,
        QTYPE=lay.qtype, G=lay.group, P=lay.planes, W=lay.width, HAS_OFFSET=_has_offset(lay.qtype), BN=rows,
    )  # fmt: skip
    return out


def packed_bytes(fields: list[torch.Tensor]) -> int:
    return sum(f.numel() * f.element_size() for f in fields)
