"""y = x @ W^T straight from GGUF-packed weights (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K), in Triton.

Weights. `repack` (once, at load) splits every GGUF block into its byte ranges ("fields", `_FIELDS`) and
interleaves the rows in 16-byte chunks, so a warp's 32 threads (one row each) read one contiguous
512-byte run per load. Lossless: `unpack` puts the rows back together. One word holds 4 consecutive
values of a 32-value group: `w & 0x0F0F0F0F` gives their codes as 4 bytes, ready for an integer dot.

Arithmetic, one per model (`qlinear.use_arithmetic`; `KernelConfig.arithmetic_for` picks it):
- int8 (plain decoding): x is quantized per 32 values to int8 (xq = round(x * 127 / amax), ties to even),
  and the kernels compute exactly x_int8 @ W^T: integer sums z = sum(code * xq) per group (dp4a at
  M = 1, an int8 tensor-core dot for 2-64 rows), then fp32 terms by one shared function (`_accumulate`).
  The min terms of Q4_K/Q5_K/Q4_1 use x_int8's own block sums, so their rounding cancels.
- bf16 (speculative decoding): x rounded to bf16, each group's weights decoded to bf16 in registers (one
  rounding of scale and shift, then two bf16x2 FMAs per pair of values), one bf16 tensor-core dot per
  group into an fp32 accumulator for every M <= 64 (M = 1 padded to 16 columns).
- M > 64: `_dequant_kernel` decodes the weight to x's dtype and cuBLAS multiplies.
Off CUDA an exact integer emulation replaces every inline PTX op, so the CPU tests run the kernels'
real structure.

Batch invariance: integer sums are exact and every path adds the same fp32 terms in the same order (units
in K order inside a K-split, then splits in order), and the split count depends on the matrix shape only
(`k_splits`, or a per-matrix target in `KernelConfig.splits`). So for M <= 64 row m of an M-row call
equals a 1-row call on x[m] bit for bit (a verify row equals the AR step's). Kernels compile with fp
fusion off (explicit fma only), which also makes `dequantize_packed` bit-exact against quant.dequant.

K-splits: one thread per output row leaves too few threads for a decode step's short matrices, so each
row's units are cut into splits sized from the shape (`SPLIT_TARGET` (row, split) pairs). A tile's
partial sums are added by its last program (`_finish`, an arrival counter) or by a second launch
(`sum_splits`), as `TileConfig.fused_sum` says per bucket.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import NamedTuple

import torch

from flashtree.errors import FlashtreeError
from flashtree.kernels import tl, triton
from flashtree.kernels.launch import pdl_options, wait_for_inputs
from flashtree.kernels.tiles import DEFAULT_KERNELS, KernelConfig, TileConfig
from flashtree.quant.dequant import dequantize
from flashtree.quant.formats import QT, block_bytes, block_size, row_bytes, type_name

KERNEL_TYPES = frozenset(int(t) for t in (QT.Q4_0, QT.Q4_1, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K))
MAX_FUSED_M = 64  # above this many rows: dequantize to x's dtype + cuBLAS
SPLIT_TARGET = 1 << 17  # (row, K-split) pairs per matrix: M = 1 threads, ~30 warps per H200 SM
EMULATE_PTX = False  # test hook: True runs the integer emulations of the inline PTX on CUDA too

# --- layout --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """One byte range of every GGUF block, stored as its own array. The name is the role the kernels
    read it in: q = codes (low bits), qh = high bits, hdr = header/scale words, d / m = fp16 scale / min."""

    name: str
    start: int  # first byte inside the block
    size: int  # bytes per block
    dtype: torch.dtype


_I32, _F16 = torch.int32, torch.float16
_FIELDS = {  # (name, start, size, dtype) per GGUF block, from gguf-py's block layouts
    QT.Q4_0: (("q", 2, 16, _I32), ("d", 0, 2, _F16)),
    QT.Q4_1: (("q", 4, 16, _I32), ("d", 0, 2, _F16), ("m", 2, 2, _F16)),
    QT.Q8_0: (("q", 2, 32, _I32), ("d", 0, 2, _F16)),
    QT.Q4_K: (("q", 16, 128, _I32), ("hdr", 0, 16, _I32)),  # hdr: d, dmin (fp16), 12 bytes of scales
    QT.Q5_K: (("q", 48, 128, _I32), ("qh", 16, 32, _I32), ("hdr", 0, 16, _I32)),
    QT.Q6_K: (("q", 0, 128, _I32), ("qh", 128, 64, _I32), ("hdr", 192, 16, _I32), ("d", 208, 2, _F16)),
}


@dataclass(frozen=True)
class Layout:
    """How one GGUF type's rows are stored for the kernels: its fields, and the unit the kernels step by
    (one 256-value super-block, or `group` legacy 32-value blocks)."""

    qtype: int
    group: int  # GGUF blocks per unit
    fields: tuple[Field, ...]

    @property
    def values(self) -> int:
        """Values per unit."""
        return self.group * block_size(self.qtype)


@cache
def layout(qtype: int, n_cols: int) -> Layout:
    """The stored layout of a `qtype` matrix with rows of `n_cols` values."""
    if int(qtype) not in KERNEL_TYPES:
        raise FlashtreeError(f"no quantized-matmul kernel for {type_name(qtype)}")
    qtype = QT(qtype)
    row_bytes(qtype, n_cols)  # raises unless the row is whole blocks
    n_blocks = n_cols // block_size(qtype)
    group = 1 if block_size(qtype) == 256 else next(g for g in (8, 4, 2, 1) if n_blocks % g == 0)
    fields = tuple(Field(*f) for f in _FIELDS[qtype])
    bounds = [b for f in sorted(fields, key=lambda f: f.start) for b in (f.start, f.start + f.size)]
    # the fields tile the block: the first starts at 0, each ends where the next starts, the last at its end
    assert bounds[0] == 0 and bounds[-1] == block_bytes(qtype) and bounds[1:-1:2] == bounds[2:-1:2]
    return Layout(int(qtype), group, fields)


CHUNK = 16  # bytes: one vector load per thread, the unit in which rows are interleaved


def repack(raw: torch.Tensor, qtype: int, n_cols: int) -> list[torch.Tensor]:
    """GGUF rows (n_rows, row_bytes) uint8 -> the layout's fields, rows interleaved: a field of 16k bytes
    per block becomes (n_blocks, k, n_rows, 4) int32 words (chunk c of block b of all rows side by side),
    a 2-byte one (n_blocks, n_rows) fp16. Threads that own consecutive rows then read consecutive
    16-byte chunks: one coalesced 512-byte transaction per warp instead of 32 scattered ones."""
    fields = packed_fields(qtype, raw.shape[0], n_cols, raw.device)
    repack_into(fields, raw, qtype, n_cols)
    return fields


def packed_fields(qtype: int, n_rows: int, n_cols: int, device) -> list[torch.Tensor]:
    """`repack`'s fields of an (n_rows, n_cols) `qtype` matrix, allocated, not filled (repack_into)."""
    n_blocks = n_cols // block_size(qtype)
    return [
        torch.empty(
            (n_blocks, f.size // CHUNK, n_rows, CHUNK // 4) if f.size % CHUNK == 0 else (n_blocks, n_rows),
            dtype=f.dtype,
            device=device,
        )
        for f in layout(qtype, n_cols).fields
    ]


def repack_into(fields: list[torch.Tensor], raw: torch.Tensor, qtype: int, n_cols: int, row: int = 0) -> None:
    """Write GGUF rows `raw` (r, row_bytes) uint8 (on the fields' device) as rows row..row + r of `fields`
    (packed_fields), straight into their interleaved places: no full-size temporary, so a loader can
    repack a matrix a few rows at a time."""
    n_rows = raw.shape[0]
    blocks = raw.reshape(n_rows, -1, block_bytes(qtype))  # (rows, n_blocks, block_bytes)
    for f, dest in zip(layout(qtype, n_cols).fields, fields, strict=True):
        part = blocks[..., f.start : f.start + f.size]
        if f.size % CHUNK == 0:  # (n_blocks, chunks, rows, 16 bytes)
            part = part.reshape(n_rows, -1, f.size // CHUNK, CHUNK).permute(1, 2, 0, 3)
            dest.view(torch.uint8)[:, :, row : row + n_rows].copy_(part)
        else:  # one fp16 per block: (n_blocks, rows, 2 bytes)
            bytes_ = dest.view(torch.uint8).view(dest.shape[0], dest.shape[1], 2)
            bytes_[:, row : row + n_rows].copy_(part.permute(1, 0, 2))


def unpack(fields: list[torch.Tensor], qtype: int, n_cols: int, rows: slice = slice(None)) -> torch.Tensor:
    """Inverse of `repack`: the original GGUF rows (n_rows, row_bytes) uint8 (or those of `rows`), bit
    for bit."""
    lay = layout(qtype, n_cols)
    parts = []
    for f, t in sorted(zip(lay.fields, fields, strict=True), key=lambda pair: pair[0].start):
        if f.size % CHUNK == 0:  # (n_blocks, chunks, rows, 4) -> (rows, n_blocks, chunks * 16)
            part = t[:, :, rows].contiguous().view(torch.uint8).permute(2, 0, 1, 3)
        else:  # (n_blocks, rows) -> (rows, n_blocks, 2)
            part = t[:, rows].contiguous().view(torch.uint8).reshape(t.shape[0], -1, f.size).permute(1, 0, 2)
        parts.append(part.reshape(part.shape[0], part.shape[1], f.size))
    blocks = torch.cat(parts, dim=-1)  # (rows, n_blocks, block_bytes)
    return blocks.reshape(blocks.shape[0], -1)


def packed_bytes(fields: list[torch.Tensor]) -> int:
    return sum(f.numel() * f.element_size() for f in fields)


# --- Triton: shared pieces -----------------------------------------------------------------------------

# Sizes the kernels take at run time, not compiled in (Triton would compile a variant for each shape's
# divisibility by 16 and for 1): the addresses built from them get their alignment from constant
# factors. K and strides (vector loads need their divisibility) stay specialized.
_SHAPE_ARGS = ["M", "R", "N", "n_blocks", "units_per_split", "n_splits"]

# GGML type ids as compile-time constants, for the kernels' static branches
_Q4_0, _Q4_1, _Q8_0 = tl.constexpr(int(QT.Q4_0)), tl.constexpr(int(QT.Q4_1)), tl.constexpr(int(QT.Q8_0))
_Q4_K, _Q5_K, _Q6_K = tl.constexpr(int(QT.Q4_K)), tl.constexpr(int(QT.Q5_K)), tl.constexpr(int(QT.Q6_K))


@triton.jit
def _dp4a(a, b, c, A_SIGNED: tl.constexpr, ASM: tl.constexpr):
    """c + sum over the 4 bytes i of int32 words a, b of a_i * b_i, exactly; b's bytes are signed, a's
    signed if A_SIGNED. ASM: PTX dp4a (CUDA); otherwise the same sum in plain integer ops."""
    if ASM:
        if A_SIGNED:
            out = tl.inline_asm_elementwise(
                "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1
            )
        else:
            out = tl.inline_asm_elementwise(
                "dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1
            )
    else:
        out = c
        for i in tl.static_range(4):
            b_i = (b << (24 - 8 * i)) >> 24  # arithmetic shift: sign-extends byte i
            a_i = (a << (24 - 8 * i)) >> 24 if A_SIGNED else (a >> (8 * i)) & 0xFF
            out = out + a_i * b_i
    return out


@triton.jit
def _accumulate(acc, z, w_scale, w_off, code_sum, dx, HAS_OFFSET: tl.constexpr):
    """acc + dx * (w_scale * z - w_off * code_sum): a group's exact integer sums z = sum(code * xq) and
    code_sum = sum(xq) scaled, by the same fp32 operations on every path."""
    # float(z), exact for |z| < 2**22: z in the mantissa of 1.5 * 2**23 (int -> float conversions run at a
    # fraction of the add rate)
    t = w_scale * ((z + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0)
    if HAS_OFFSET:
        t = tl.fma(w_off, -code_sum.to(tl.float32), t)
    return tl.fma(t, dx, acc)


@triton.jit
def _f16(bits):
    """The fp16 whose bit pattern is the low 16 bits of int32 `bits`, as fp32."""
    return (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _signed_byte(word, i: tl.constexpr):
    return (word << (24 - 8 * i)) >> 24


@triton.jit
def _at(rows, N, blk, CHUNKS: tl.constexpr, chunk, WIDTH: tl.constexpr):
    """Where `rows` (int64) read chunk `chunk` of their block `blk` in a field of CHUNKS 16-byte chunks
    per block (see `repack`), in elements of 16 / WIDTH bytes: WIDTH = 4 words, 16 bytes, 1 fp16."""
    return ((blk * CHUNKS + chunk) * N + rows) * WIDTH


@triton.jit
def _unit_header(QTYPE: tl.constexpr, hdr_ptr, d_ptr, rows, N, blk, row_ok):
    """What a unit's groups share: (d, dmin, s0, s1, s2, s3), (BN,) each. Q4_K/Q5_K: d, dmin and the
    scale words s0-s2; Q6_K: d and the four words of int8 scales; legacy types: placeholders (their
    scales are per block, loaded by `_group_scales`)."""
    zero = tl.full(rows.shape, 0, tl.float32)
    if QTYPE == _Q4_K or QTYPE == _Q5_K or QTYPE == _Q6_K:  # noqa: SIM109 - Triton's compiler has no `in`
        # word by word: (BN,) loads land in whatever layout the consumers use, no conversion
        at = _at(rows, N, blk, 1, 0, 4)
        w0 = tl.load(hdr_ptr + at, mask=row_ok, other=0)
        w1 = tl.load(hdr_ptr + at + 1, mask=row_ok, other=0)
        w2 = tl.load(hdr_ptr + at + 2, mask=row_ok, other=0)
        w3 = tl.load(hdr_ptr + at + 3, mask=row_ok, other=0)
        if QTYPE == _Q6_K:
            d = tl.load(d_ptr + _at(rows, N, blk, 1, 0, 1), mask=row_ok, other=0.0).to(tl.float32)
            out = d, zero, w0, w1, w2, w3
        else:
            out = _f16(w0), _f16(w0 >> 16), w1, w2, w3, w3
    else:
        out = zero, zero, rows.to(tl.int32), rows.to(tl.int32), rows.to(tl.int32), rows.to(tl.int32)
    return out


@triton.jit
def _k_scale_min(w1, w2, w3, j: tl.constexpr):
    """Q4_K/Q5_K 6-bit scale and min of sub-block j from the scale words (bytes 0-3, 4-7, 8-11): bytes
    0-3 / 4-7 hold scales / mins 0-3; sub-blocks 4-7 keep 4 bits in bytes 8-11, 2 in bytes 0-7's tops."""
    if j < 4:
        sc = (w1 >> (8 * j)) & 63
        mn = (w2 >> (8 * j)) & 63
    else:
        packed = w3 >> (8 * (j - 4))
        sc = (packed & 15) | (((w1 >> (8 * (j - 4) + 6)) & 3) << 4)
        mn = ((packed >> 4) & 15) | (((w2 >> (8 * (j - 4) + 6)) & 3) << 4)
    return sc, mn


@triton.jit
def _group_scales(
    QTYPE: tl.constexpr, d, dmin, s0, s1, s2, s3, d_ptr, m_ptr, rows, N, blk, row_ok, g: tl.constexpr
):
    """Scales of 32-value group g of a unit, (BN,) fp32 each: value = w_scale * code - w_off, with
    w_scale_a for the group's first 16 values and w_scale_b for the last 16 (they differ for Q6_K only)."""
    if QTYPE == _Q4_K or QTYPE == _Q5_K:  # noqa: SIM109
        sc, mn = _k_scale_min(s0, s1, s2, g)
        ws_a = d * sc.to(tl.float32)
        ws_b = ws_a
        wo = dmin * mn.to(tl.float32)
    elif QTYPE == _Q6_K:  # int8 scale per 16 values: bytes 2g, 2g + 1 of the 16
        if g // 2 == 0:
            word = s0
        elif g // 2 == 1:
            word = s1
        elif g // 2 == 2:
            word = s2
        else:
            word = s3
        ws_a = d * _signed_byte(word, 2 * (g % 2)).to(tl.float32)
        ws_b = d * _signed_byte(word, 2 * (g % 2) + 1).to(tl.float32)
        wo = ws_a  # unused
    else:  # legacy: group g is block blk + g
        at = _at(rows, N, blk + g, 1, 0, 1)
        ws_a = tl.load(d_ptr + at, mask=row_ok, other=0.0).to(tl.float32)
        ws_b = ws_a
        # Q4_1: value = d * q + m; the others have no min (wo unused)
        wo = -tl.load(m_ptr + at, mask=row_ok, other=0.0).to(tl.float32) if QTYPE == _Q4_1 else ws_a
    return ws_a, ws_b, wo


@triton.jit
def _split_part(part_ptr, split, last, size, at, ok):
    """The partial sums of K-split `split` at offsets `at` (one past the last reads the last again, and
    the caller does not add it); from L2: other SMs wrote them."""
    return tl.load(part_ptr + tl.minimum(split, last) * size + at, mask=ok, other=0.0, cache_modifier=".cg")


@triton.jit
def _add_splits(total, part_ptr, at, ok, first, n_splits, size, FIRST: tl.constexpr):
    """total + the partial sums of splits first .. first + 7 (those < n_splits), in split order; FIRST:
    the round of split 0, which starts the sum (total unused). The eight loads are independent, so they
    are in flight together: a row's sum over the 24 splits of a 27B 5120-row matrix waits for 3 L2
    round trips, not 24 (the loads of one split after another did)."""
    last = n_splits - 1
    p0 = _split_part(part_ptr, first, last, size, at, ok)
    p1 = _split_part(part_ptr, first + 1, last, size, at, ok)
    p2 = _split_part(part_ptr, first + 2, last, size, at, ok)
    p3 = _split_part(part_ptr, first + 3, last, size, at, ok)
    p4 = _split_part(part_ptr, first + 4, last, size, at, ok)
    p5 = _split_part(part_ptr, first + 5, last, size, at, ok)
    p6 = _split_part(part_ptr, first + 6, last, size, at, ok)
    p7 = _split_part(part_ptr, first + 7, last, size, at, ok)
    total = p0 if FIRST else total + p0  # first <= last: the caller's loop
    total = tl.where(first + 1 <= last, total + p1, total)
    total = tl.where(first + 2 <= last, total + p2, total)
    total = tl.where(first + 3 <= last, total + p3, total)
    total = tl.where(first + 4 <= last, total + p4, total)
    total = tl.where(first + 5 <= last, total + p5, total)
    total = tl.where(first + 6 <= last, total + p6, total)
    return tl.where(first + 7 <= last, total + p7, total)


@triton.jit
def _sum_of_splits(part_ptr, at, ok, n_splits, size):
    """The partial sums (n_splits, size) at offsets `at` added in split order, in rounds of eight
    (`_add_splits`). Every path adds K-splits with this function, so their rows agree bit for bit."""
    total = _add_splits(tl.zeros(at.shape, tl.float32), part_ptr, at, ok, 0, n_splits, size, True)
    for first in range(8, n_splits, 8):
        total = _add_splits(total, part_ptr, at, ok, first, n_splits, size, False)
    return total


@triton.jit
def _split_rows(BN: tl.constexpr, N, per_split, n_units):
    """Program (i, s)'s output rows [i * BN, i * BN + BN), which of them are < N, its K-split s and the
    split's units [first, last)."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    row_ok = rows < N
    split = tl.program_id(1)
    first = split * per_split
    return rows, row_ok, split, first, tl.minimum(first + per_split, n_units)


@triton.jit
def _finish(y_ptr, part_ptr, counter_ptr, acc, at, ok, split, n_splits, size, FUSED_SUM: tl.constexpr):
    """Store a program's sums `acc` at offsets `at` (mask `ok`) of y, or, with K-splits, as split
    `split` of the partial sums (n_splits, size). FUSED_SUM: the program that completes its row tile
    last then adds the tile's partial sums in split order into y and resets the tile's counter (zero
    again for the next call and for CUDA-graph replays); otherwise `_sum_splits_kernel` adds them.
    Either way the same fp32 adds in the same order (`_sum_of_splits`)."""
    if n_splits == 1:
        tl.store(y_ptr + at, acc.to(y_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(part_ptr + split * size + at, acc, mask=ok)
        if FUSED_SUM:
            tl.debug_barrier()  # every thread's partial is stored before the count (released by it)
            tile = counter_ptr + tl.program_id(0)
            if tl.atomic_add(tile, 1, sem="acq_rel", scope="gpu") == n_splits - 1:
                total = _sum_of_splits(part_ptr, at, ok, n_splits, size)
                tl.store(y_ptr + at, total.to(y_ptr.dtype.element_ty), mask=ok)
                tl.atomic_xchg(tile, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=_SHAPE_ARGS)
def _sum_splits_kernel(y_ptr, part_ptr, n, n_splits, BLOCK: tl.constexpr, GDC: tl.constexpr):
    """y = the K-splits' partial sums (n_splits, n) added in split order."""
    wait_for_inputs(GDC)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    tl.store(y_ptr + i, _sum_of_splits(part_ptr, i, ok, n_splits, n).to(y_ptr.dtype.element_ty), mask=ok)


SUM_BLOCK = 128  # sums a program of `sum_splits` adds
SUM_WARPS = 2
# Small blocks give the 27B's 5120-row matrices more programs than SMs (swept at its verify shapes:
# bench/results/sum-splits-2026-12-06).


def sum_splits(y: torch.Tensor, parts: torch.Tensor, block: int = SUM_BLOCK, warps: int = SUM_WARPS) -> None:
    """y (M, N) = parts (n_splits, M, N), the K-splits' partial sums, added in split order (the order
    every path adds them in, `_sum_of_splits`): the second launch of a product whose tile does not add
    its own splits (`TileConfig.fused_sum`)."""
    n = y.numel()
    _sum_splits_kernel[(triton.cdiv(n, block),)](
        y, parts, n, parts.shape[0], BLOCK=block, num_warps=warps, **pdl_options(y)
    )


# --- Triton: M = 1, dp4a ------------------------------------------------------------------------------


@triton.jit
def _six_bit(low, high, r: tl.constexpr):
    """Q6_K codes of run r (of 4) from a ql word (nibble r // 2) and a qh word (bits 2r, 2r + 1)."""
    return ((low >> (4 * (r // 2))) & 0x0F0F0F0F) | (((high >> (2 * r)) & 0x03030303) << 4)


@triton.jit
def _group_words(QTYPE: tl.constexpr, q_ptr, qh_ptr, rows, N, blk, row_ok, g: tl.constexpr):
    """Codes of 32-value group g as two (BN, 4) int32 tiles of 4 codes per word (bytes), values 0-15 and
    16-31: unsigned, but Q8_0's are signed; the types' fixed offsets not yet subtracted. Each tile is one
    16-byte chunk of the row (`_at`)."""
    i = tl.arange(0, 4)[None, :]
    r = rows[:, None]
    ok = row_ok[:, None]
    if QTYPE == _Q4_K or QTYPE == _Q5_K:  # noqa: SIM109 - bytes 32c..32c+31: low nibbles group 2c, high 2c + 1
        c = 2 * (g // 2)
        ca = (tl.load(q_ptr + _at(r, N, blk, 8, c, 4) + i, mask=ok, other=0) >> (4 * (g % 2))) & 0x0F0F0F0F
        cb = (
            tl.load(q_ptr + _at(r, N, blk, 8, c + 1, 4) + i, mask=ok, other=0) >> (4 * (g % 2))
        ) & 0x0F0F0F0F
        if QTYPE == _Q5_K:  # bit g of qh byte j is the 5th bit of value j
            ca = ca | (
                ((tl.load(qh_ptr + _at(r, N, blk, 2, 0, 4) + i, mask=ok, other=0) >> g) & 0x01010101) << 4
            )
            cb = cb | (
                ((tl.load(qh_ptr + _at(r, N, blk, 2, 1, 4) + i, mask=ok, other=0) >> g) & 0x01010101) << 4
            )
    elif QTYPE == _Q6_K:  # values 128h + 32r + j: ql byte 64h + 32(r % 2) + j, qh byte 32h + j
        c = 4 * (g // 4) + 2 * (g % 4 % 2)
        h = 2 * (g // 4)
        low_a = tl.load(q_ptr + _at(r, N, blk, 8, c, 4) + i, mask=ok, other=0)
        low_b = tl.load(q_ptr + _at(r, N, blk, 8, c + 1, 4) + i, mask=ok, other=0)
        high_a = tl.load(qh_ptr + _at(r, N, blk, 4, h, 4) + i, mask=ok, other=0)
        high_b = tl.load(qh_ptr + _at(r, N, blk, 4, h + 1, 4) + i, mask=ok, other=0)
        ca = _six_bit(low_a, high_a, g % 4)
        cb = _six_bit(low_b, high_b, g % 4)
    elif QTYPE == _Q8_0:
        ca = tl.load(q_ptr + _at(r, N, blk + g, 2, 0, 4) + i, mask=ok, other=0)
        cb = tl.load(q_ptr + _at(r, N, blk + g, 2, 1, 4) + i, mask=ok, other=0)
    else:  # Q4_0 / Q4_1: byte j holds value j (low nibble) and value j + 16 (high)
        words = tl.load(q_ptr + _at(r, N, blk + g, 1, 0, 4) + i, mask=ok, other=0)
        ca = words & 0x0F0F0F0F
        cb = (words >> 4) & 0x0F0F0F0F
    return ca, cb


@triton.jit
def _matvec_unit(
    acc, unit, rows, N, row_ok, xq_ptr, scale_ptr, xqs_ptr, q_ptr, hdr_ptr, qh_ptr, d_ptr, m_ptr,
    QTYPE: tl.constexpr, G: tl.constexpr, V: tl.constexpr, HAS_OFFSET: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """acc (BN,) plus the unit's terms, group after group."""
    blk = unit * G
    d, dmin, s0, s1, s2, s3 = _unit_header(QTYPE, hdr_ptr, d_ptr, rows, N, blk, row_ok)
    for g in tl.static_range(V // 32):
        ca, cb = _group_words(QTYPE, q_ptr, qh_ptr, rows, N, blk, row_ok, g)  # (BN, 4) each
        k32 = unit * (V // 32) + g  # the group's 32-value block of x
        xa = tl.load(xq_ptr + k32 * 8 + tl.arange(0, 4))[None, :]  # (1, 4): xq of values 0-15
        xb = tl.load(xq_ptr + k32 * 8 + 4 + tl.arange(0, 4))[None, :]  # values 16-31
        dx = tl.load(scale_ptr + k32)
        sum_a, sum_b = tl.load(xqs_ptr + 2 * k32), tl.load(xqs_ptr + 2 * k32 + 1)  # of xa's, xb's codes
        ws_a, ws_b, wo = _group_scales(QTYPE, d, dmin, s0, s1, s2, s3, d_ptr, m_ptr, rows, N, blk, row_ok, g)
        zero = tl.zeros_like(ca)
        if QTYPE == _Q6_K:  # two 16-value sub-blocks, codes offset by 32
            za = tl.sum(_dp4a(ca, xa, zero, False, ASM), axis=1) - 32 * sum_a
            zb = tl.sum(_dp4a(cb, xb, zero, False, ASM), axis=1) - 32 * sum_b
            acc = _accumulate(acc, za, ws_a, wo, sum_a, dx, False)
            acc = _accumulate(acc, zb, ws_b, wo, sum_b, dx, False)
        else:
            signed = QTYPE == _Q8_0
            z = tl.sum(_dp4a(cb, xb, _dp4a(ca, xa, zero, signed, ASM), signed, ASM), axis=1)  # (BN,)
            if QTYPE == _Q4_0:  # codes offset by 8
                z -= 8 * (sum_a + sum_b)
            acc = _accumulate(acc, z, ws_a, wo, sum_a + sum_b, dx, HAS_OFFSET)
    return acc


@triton.jit(do_not_specialize=_SHAPE_ARGS)
def _matvec_kernel(
    y_ptr, part_ptr, counter_ptr, xq_ptr, scale_ptr, xqs_ptr, q_ptr, hdr_ptr, qh_ptr, d_ptr, m_ptr,
    N, n_blocks, units_per_split, n_splits,
    QTYPE: tl.constexpr, G: tl.constexpr, V: tl.constexpr, HAS_OFFSET: tl.constexpr, BN: tl.constexpr,
    UNROLL: tl.constexpr, FUSED_SUM: tl.constexpr, ASM: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """One row of x: program (i, s) adds split s of rows [i * BN, i * BN + BN), one thread per row,
    UNROLL units per step (their loads can be in flight together)."""
    rows, row_ok, split, first, last = _split_rows(BN, N, units_per_split, n_blocks // G)
    rows64 = rows.to(tl.int64)
    wait_for_inputs(GDC)
    acc = tl.zeros((BN,), tl.float32)
    unrolled_end = first + (last - first) // UNROLL * UNROLL
    for start in range(first, unrolled_end, UNROLL):
        for u in tl.static_range(UNROLL):
            acc = _matvec_unit(
                acc, start + u, rows64, N, row_ok, xq_ptr, scale_ptr, xqs_ptr, q_ptr, hdr_ptr, qh_ptr, d_ptr,
                m_ptr, QTYPE, G, V, HAS_OFFSET, ASM,
            )  # fmt: skip
    for unit in range(unrolled_end, last):  # the rest, one by one: the same adds in the same order
        acc = _matvec_unit(
            acc, unit, rows64, N, row_ok, xq_ptr, scale_ptr, xqs_ptr, q_ptr, hdr_ptr, qh_ptr, d_ptr, m_ptr,
            QTYPE, G, V, HAS_OFFSET, ASM,
        )  # fmt: skip
    _finish(y_ptr, part_ptr, counter_ptr, acc, rows, row_ok, split, n_splits, N, FUSED_SUM)


# --- Triton: 2 <= M <= 64, int8 tensor cores; dequantization -----------------------------------------


@triton.jit
def _field(x, SRC: tl.constexpr, WIDTH: tl.constexpr, DST: tl.constexpr, ASM: tl.constexpr):
    """Bits [SRC, SRC + WIDTH) of every byte of a uint8 tensor, moved to bit DST (fields stay in a byte)."""
    if ASM:  # 4 bytes per 32-bit rotate + and (LLVM would shift byte by byte); no other byte's bits
        # reach the mask, as the field never crosses its byte
        shift = tl.full(x.shape, (SRC - DST) % 32, tl.uint8)  # the low 5 bits of the packed register
        mask = tl.full(x.shape, ((1 << WIDTH) - 1) << DST, tl.uint8)
        out = tl.inline_asm_elementwise(
            "{ .reg .b32 t; shf.r.wrap.b32 t, $1, $1, $2; and.b32 $0, t, $3; }",
            "=r,r,r,r", [x, shift, mask], dtype=tl.uint8, is_pure=True, pack=4,
        )  # fmt: skip
    else:
        out = ((x >> SRC) & ((1 << WIDTH) - 1)) << DST
    return out


@triton.jit
def _nibble(x, high, ASM: tl.constexpr):
    """The low nibble of every byte of a uint8 tensor, its high nibble where `high` (a bool tensor)."""
    if ASM:  # one select of x or x >> 4 per byte, 4 bytes at a time (a select of bytes would unpack them)
        sel = tl.where(high, 0xFF, 0).to(tl.uint8)
        out = tl.inline_asm_elementwise(
            "{ .reg .b32 t; shr.b32 t, $1, 4; lop3.b32 t, $1, t, $2, 0xD8; and.b32 $0, t, 0x0F0F0F0F; }",
            "=r,r,r", [x, sel], dtype=tl.uint8, is_pure=True, pack=4,
        )  # fmt: skip
    else:
        out = tl.where(high, x >> 4, x & 15)
    return out


@triton.jit
def _centered(c, BITS: tl.constexpr, ASM: tl.constexpr):
    """c - 2**(BITS - 1) as int8, for BITS-bit unsigned codes c (uint8): flip the top bit, sign-extend."""
    v = c ^ (1 << (BITS - 1))
    if ASM:  # the flipped top bit times 0xF0 / 8 (or 0xC0 / 32) fills the byte's upper bits, no carries
        if BITS == 4:
            out = tl.inline_asm_elementwise(
                "{ .reg .b32 t; and.b32 t, $1, 0x08080808; mul.lo.u32 t, t, 30; or.b32 $0, $1, t; }",
                "=r,r", [v], dtype=tl.int8, is_pure=True, pack=4,
            )  # fmt: skip
        else:
            out = tl.inline_asm_elementwise(
                "{ .reg .b32 t; and.b32 t, $1, 0x20202020; mul.lo.u32 t, t, 6; or.b32 $0, $1, t; }",
                "=r,r", [v], dtype=tl.int8, is_pure=True, pack=4,
            )  # fmt: skip
    else:
        out = (c.to(tl.int32) - (1 << (BITS - 1))).to(tl.int8)
    return out


@triton.jit
def _group_raw(QTYPE: tl.constexpr, q_ptr, qh_ptr, rows, N, blk, row_ok, g: tl.constexpr, ASM: tl.constexpr):
    """Codes of 32-value group g as stored, (BN, 32): uint8 (Q4_0 / Q4_1 / Q4_K 0-15, Q5_K 0-31, Q6_K
    0-63), int8 for Q8_0. q_ptr / qh_ptr address bytes (int8 for Q8_0, else uint8); byte j of a 32-byte
    run is byte j % 16 of its chunk j // 16 (`_at`)."""
    j = tl.arange(0, 32)[None, :]
    half, byte = j // 16, j % 16
    r = rows[:, None]
    ok = row_ok[:, None]
    if QTYPE == _Q8_0:
        codes = tl.load(q_ptr + _at(r, N, blk + g, 2, half, 16) + byte, mask=ok, other=0)
    elif QTYPE == _Q6_K:
        low = tl.load(
            q_ptr + _at(r, N, blk, 8, 4 * (g // 4) + 2 * (g % 4 % 2) + half, 16) + byte, mask=ok, other=0
        )
        high = tl.load(qh_ptr + _at(r, N, blk, 4, 2 * (g // 4) + half, 16) + byte, mask=ok, other=0)
        codes = _field(low, 4 * (g % 4 // 2), 4, 0, ASM) | _field(high, 2 * (g % 4), 2, 4, ASM)
    elif QTYPE == _Q4_0 or QTYPE == _Q4_1:  # noqa: SIM109 - bytes 0-15: values j and j + 16
        byte = tl.load(q_ptr + _at(r, N, blk + g, 1, 0, 16) + byte, mask=ok, other=0)
        codes = _nibble(byte, j >= 16, ASM)
    else:  # Q4_K / Q5_K
        byte = tl.load(q_ptr + _at(r, N, blk, 8, 2 * (g // 2) + half, 16) + byte, mask=ok, other=0)
        codes = _field(byte, 4 * (g % 2), 4, 0, ASM)
        if QTYPE == _Q5_K:
            high = tl.load(qh_ptr + _at(r, N, blk, 2, half, 16) + j % 16, mask=ok, other=0)
            codes = codes | _field(high, g, 1, 4, ASM)
    return codes


@triton.jit
def _group_codes(
    QTYPE: tl.constexpr, q_ptr, qh_ptr, rows, N, blk, row_ok, g: tl.constexpr, ASM: tl.constexpr
):
    """Signed codes of 32-value group g, (BN, 32) int8, Q4_0's 8 and Q6_K's 32 subtracted:
    value = w_scale * code - w_off."""
    raw = _group_raw(QTYPE, q_ptr, qh_ptr, rows, N, blk, row_ok, g, ASM)
    if QTYPE == _Q8_0:
        codes = raw
    elif QTYPE == _Q6_K:
        codes = _centered(raw, 6, ASM)
    elif QTYPE == _Q4_0:
        codes = _centered(raw, 4, ASM)
    else:
        codes = raw.to(tl.int8, bitcast=True)
    return codes


def _bf16_fma_asm(offset: int) -> tl.constexpr:
    """PTX for 4 codes (bytes of $2, each < 128) -> 4 bf16 (code - offset) * scale + shift ($0, $1):
    0x43 above a code's byte makes the bf16 128 + code (exact: 8 significant bits), one exact fma
    subtracts 128 + offset, one rounding fma applies the scale ($3, $4) and shift ($5, $6)."""
    minus = f"{0x8000 | (torch.tensor(-128.0 - offset).abs().bfloat16().view(torch.int16).item()):04X}"
    return tl.constexpr(
        "{ .reg .b32 k, one, off, a, b;\n"
        f"mov.b32 k, 0x43434343; mov.b32 one, 0x3F803F80; mov.b32 off, 0x{minus}{minus};\n"
        "prmt.b32 a, $2, k, 0x5140; prmt.b32 b, $2, k, 0x7362;\n"
        "fma.rn.bf16x2 a, a, one, off; fma.rn.bf16x2 b, b, one, off;\n"
        "fma.rn.bf16x2 $0, a, $3, $5; fma.rn.bf16x2 $1, b, $4, $6; }"
    )


_BF16_FMA_0, _BF16_FMA_8, _BF16_FMA_32 = _bf16_fma_asm(0), _bf16_fma_asm(8), _bf16_fma_asm(32)


@triton.jit
def _bf16_weights(codes, scale, shift, OFFSET: tl.constexpr, ASM: tl.constexpr):
    """bf16((code - OFFSET) * scale + shift), one rounding, for uint8 codes < 128 and bf16 scale, shift
    (all (BN, 32)). Without ASM: the same in fp32, exact before the rounding to bf16 (8-bit codes times
    8-bit scales) unless the shift is 2**8 times the product's last bit or more."""
    if ASM:
        args = [codes, scale, shift]
        if OFFSET == 0:
            out = tl.inline_asm_elementwise(_BF16_FMA_0, "=r,=r,r,r,r,r,r", args, tl.bfloat16, True, 4)
        elif OFFSET == 8:
            out = tl.inline_asm_elementwise(_BF16_FMA_8, "=r,=r,r,r,r,r,r", args, tl.bfloat16, True, 4)
        else:
            out = tl.inline_asm_elementwise(_BF16_FMA_32, "=r,=r,r,r,r,r,r", args, tl.bfloat16, True, 4)
    else:
        value = (codes.to(tl.int32) - OFFSET).to(tl.float32)
        out = tl.fma(value, scale.to(tl.float32), shift.to(tl.float32)).to(tl.bfloat16)
    return out


@triton.jit
def _group_weights(
    QTYPE: tl.constexpr, q_ptr, qh_ptr, rows, N, blk, row_ok, g: tl.constexpr, ws_a, ws_b, wo,
    ASM: tl.constexpr,
):  # fmt: skip
    """Group g's weights as (BN, 32) bf16, decoded in registers: (code - offset) * scale - w_off, the
    group's scale and offset rounded to bf16 first (Q8_0: its fp32 code * d, rounded)."""
    raw = _group_raw(QTYPE, q_ptr, qh_ptr, rows, N, blk, row_ok, g, ASM)
    if QTYPE == _Q8_0:
        w = (raw.to(tl.float32) * ws_a[:, None]).to(tl.bfloat16)
    else:
        scale = tl.broadcast_to(ws_a.to(tl.bfloat16)[:, None], raw.shape)
        if QTYPE == _Q6_K:  # a scale per 16 values
            j = tl.arange(0, 32)[None, :]
            scale = tl.where(j < 16, scale, ws_b.to(tl.bfloat16)[:, None])
        if QTYPE == _Q4_K or QTYPE == _Q5_K or QTYPE == _Q4_1:  # noqa: SIM109
            shift = tl.broadcast_to((-wo).to(tl.bfloat16)[:, None], raw.shape)
        else:
            shift = tl.zeros(raw.shape, tl.bfloat16)
        if QTYPE == _Q6_K:
            w = _bf16_weights(raw, scale, shift, 32, ASM)
        elif QTYPE == _Q4_0:
            w = _bf16_weights(raw, scale, shift, 8, ASM)
        else:
            w = _bf16_weights(raw, scale, shift, 0, ASM)
    return w


@triton.jit
def _matmul_unit(
    acc, unit, header, rows, N, row_ok, x_ptr, scale_ptr, xqs_ptr, q_ptr, qh_ptr, d_ptr, m_ptr, M, K,
    QTYPE: tl.constexpr, G: tl.constexpr, V: tl.constexpr, HAS_OFFSET: tl.constexpr, BM: tl.constexpr,
    BF16: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """acc (BN, BM) plus the unit's terms, group after group; `header`: the unit's `_unit_header`,
    loaded one unit ahead. int8: one int8 dot per group (two for Q6_K) and its fp32 terms; BF16: the
    group's weights decoded to bf16, one bf16 dot into acc (x_ptr: x itself, (BM, K) bf16)."""
    ms = tl.arange(0, BM)
    j = tl.arange(0, 32)[:, None]
    blk = unit * G
    d, dmin, s0, s1, s2, s3 = header
    for g in tl.static_range(V // 32):
        k32 = unit * (V // 32) + g
        xt_ptrs = x_ptr + ms[None, :] * K + k32 * 32 + j  # (32, BM): x or its codes, K-major
        ws_a, ws_b, wo = _group_scales(QTYPE, d, dmin, s0, s1, s2, s3, d_ptr, m_ptr, rows, N, blk, row_ok, g)
        if BF16:
            w = _group_weights(QTYPE, q_ptr, qh_ptr, rows, N, blk, row_ok, g, ws_a, ws_b, wo, ASM)
            xt = tl.load(xt_ptrs, mask=(ms < M)[None, :], other=0.0)
            if ASM:
                acc = tl.dot(w, xt, acc)
            else:  # Triton's interpreter multiplies bf16 dot operands' raw bits: the same values in fp32
                acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        else:
            codes = _group_codes(QTYPE, q_ptr, qh_ptr, rows, N, blk, row_ok, g, ASM)  # (BN, 32) int8
            dx = tl.load(scale_ptr + k32 * BM + ms)[None, :]  # (1, BM)
            if HAS_OFFSET:  # (1, BM): the group's code sums, its two halves added (two loads, not a (BM, 2)
                # tile: its reduction would move through shared memory to the dot's layout, once per group)
                halves = xqs_ptr + (k32 * BM + ms) * 2
                code_sum = (tl.load(halves) + tl.load(halves + 1))[None, :]
            else:
                code_sum = dx  # unused
            if QTYPE == _Q6_K:  # one dot per 16-value sub-block: the other half of x loaded as zeros
                za = tl.dot(codes, tl.load(xt_ptrs, mask=j < 16, other=0))  # (BN, BM) int32
                zb = tl.dot(codes, tl.load(xt_ptrs, mask=j >= 16, other=0))
                acc = _accumulate(acc, za, ws_a[:, None], wo[:, None], code_sum, dx, False)
                acc = _accumulate(acc, zb, ws_b[:, None], wo[:, None], code_sum, dx, False)
            else:
                z = tl.dot(codes, tl.load(xt_ptrs))
                acc = _accumulate(acc, z, ws_a[:, None], wo[:, None], code_sum, dx, HAS_OFFSET)
    return acc


@triton.jit(do_not_specialize=_SHAPE_ARGS)
def _matmul_kernel(
    y_ptr, part_ptr, counter_ptr, x_ptr, scale_ptr, xqs_ptr, q_ptr, hdr_ptr, qh_ptr, d_ptr, m_ptr,
    M, N, K, n_blocks, units_per_split, n_splits,
    QTYPE: tl.constexpr, G: tl.constexpr, V: tl.constexpr, HAS_OFFSET: tl.constexpr, BN: tl.constexpr,
    BM: tl.constexpr, FUSED_SUM: tl.constexpr, BF16: tl.constexpr, ASM: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """M <= BM rows of x (x_ptr: its int8 codes padded with zero rows to (BM, K), or with BF16 x itself
    in bf16, (M, K)): program (i, s) adds split s of rows [i * BN, i * BN + BN) for all M, unit after
    unit. Each unit's header is loaded while the unit before it is computed (the pipeliner only
    overlaps the loads that feed the dots: a header load would stall every unit for a trip to memory)."""
    wait_for_inputs(GDC)
    rows, row_ok, split, first, last = _split_rows(BN, N, units_per_split, n_blocks // G)
    rows64 = rows.to(tl.int64)
    acc = tl.zeros((BN, BM), tl.float32)
    header = _unit_header(QTYPE, hdr_ptr, d_ptr, rows64, N, first * G, row_ok)
    for unit in range(first, last):
        ahead = tl.minimum(unit + 1, last - 1) * G  # the last unit loads its own header again
        following = _unit_header(QTYPE, hdr_ptr, d_ptr, rows64, N, ahead, row_ok)
        acc = _matmul_unit(
            acc, unit, header, rows64, N, row_ok, x_ptr, scale_ptr, xqs_ptr, q_ptr, qh_ptr, d_ptr, m_ptr, M,
            K, QTYPE, G, V, HAS_OFFSET, BM, BF16, ASM,
        )  # fmt: skip
        header = following
    ms = tl.arange(0, BM)
    at, ok = ms[None, :] * N + rows[:, None], row_ok[:, None] & (ms < M)[None, :]
    _finish(y_ptr, part_ptr, counter_ptr, acc, at, ok, split, n_splits, M * N, FUSED_SUM)


@triton.jit(do_not_specialize=_SHAPE_ARGS)
def _dequant_kernel(
    out_ptr, q_ptr, hdr_ptr, qh_ptr, d_ptr, m_ptr, N, K,
    QTYPE: tl.constexpr, G: tl.constexpr, V: tl.constexpr, HAS_OFFSET: tl.constexpr, BN: tl.constexpr,
    ASM: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """Unit program_id(1) of rows [i * BN, i * BN + BN) as dense values, the reference's float ops."""
    wait_for_inputs(GDC)
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    row_ok = rows < N
    unit = tl.program_id(1)
    rows64 = rows.to(tl.int64)
    blk = unit * G
    d, dmin, s0, s1, s2, s3 = _unit_header(QTYPE, hdr_ptr, d_ptr, rows64, N, blk, row_ok)
    j = tl.arange(0, 32)[None, :]
    for g in tl.static_range(V // 32):
        codes = _group_codes(QTYPE, q_ptr, qh_ptr, rows64, N, blk, row_ok, g, ASM).to(tl.float32)  # (BN, 32)
        ws_a, ws_b, wo = _group_scales(
            QTYPE, d, dmin, s0, s1, s2, s3, d_ptr, m_ptr, rows64, N, blk, row_ok, g
        )
        w = tl.where(j < 16, ws_a[:, None], ws_b[:, None]) * codes
        if HAS_OFFSET:
            w = w - wo[:, None]
        ptrs = out_ptr + rows.to(tl.int64)[:, None] * K + unit * V + 32 * g + j
        tl.store(ptrs, w.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def quantize_blocks(x, blocks, ok, m, R, n_blocks, xq_ptr, scale_ptr, xqs_ptr):
    """Stores the int8 quantization of blocks `blocks` (NB,) of row m, x (NB, 8, 4) fp32 (32 values a
    block), where `ok`: codes round(x * 127 / amax) (ties to even) packed 4 per int32 word (little-endian),
    dx = amax / 127, and the codes' sums per 16 values (QuantizedActivations' layout, R rows). Shared by
    `_quantize_kernel` and the kernels that produce a matmul's input (kernels/fused.py), which must be
    compiled without fp fusion like it, so that both give the same bits."""
    i = tl.arange(0, 4)[None, None, :]
    amax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)  # (NB,)
    # floored: 127 / amax stays finite for all-zero and subnormal blocks (their codes then stay small)
    inv = tl.math.div_rn(127.0, tl.maximum(amax, 1e-30))
    # |x * inv| <= 127: adding 1.5 * 2**23 rounds it to an integer (ties to even) held in the mantissa
    codes = (x * inv[:, None, None] + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000  # (NB, 8, 4)
    words = tl.sum((codes & 0xFF) << (8 * i), axis=2)  # (NB, 8): disjoint bytes, so sum = bitwise or
    word_sums = tl.sum(codes, axis=2)  # (NB, 8)
    first_half = tl.arange(0, 8)[None, :] < 4
    tl.store(
        xq_ptr + (m * n_blocks + blocks)[:, None] * 8 + tl.arange(0, 8)[None, :], words, mask=ok[:, None]
    )
    at = blocks * R + m  # block-major: a block's R rows side by side
    tl.store(scale_ptr + at, tl.math.div_rn(amax, 127.0), mask=ok)
    tl.store(xqs_ptr + 2 * at, tl.sum(tl.where(first_half, word_sums, 0), axis=1), mask=ok)
    tl.store(xqs_ptr + 2 * at + 1, tl.sum(tl.where(first_half, 0, word_sums), axis=1), mask=ok)


@triton.jit(do_not_specialize=_SHAPE_ARGS)
def _quantize_kernel(
    x_ptr, xq_ptr, scale_ptr, xqs_ptr, M, R, n_blocks, stride_x, NB: tl.constexpr, GDC: tl.constexpr
):
    """Blocks [j * NB, j * NB + NB) of row i of x (`quantize_blocks`). Rows M <= i < R (padding up to the
    tensor-core tile) come out all zero."""
    wait_for_inputs(GDC)
    m = tl.program_id(0)
    blocks = tl.program_id(1) * NB + tl.arange(0, NB)
    ok = blocks < n_blocks
    at = blocks[:, None, None] * 32 + tl.arange(0, 8)[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]
    real = ok & (blocks * 0 + m < M)  # (NB,): a block of one of x's rows, not of the padding
    x = tl.load(x_ptr + m * stride_x + at, mask=real[:, None, None], other=0.0).to(tl.float32)
    quantize_blocks(x, blocks, ok, m, R, n_blocks, xq_ptr, scale_ptr, xqs_ptr)


# --- launchers -----------------------------------------------------------------------------------------


def tile_key(m: int, arithmetic: str = "int8") -> str:
    columns = max(16, triton.next_power_of_2(m))
    if arithmetic == "bf16":
        return f"b{columns}"
    return "m1" if m == 1 else f"m{columns}"


def tile_for(m: int, arithmetic: str, qtype: int, kernels: KernelConfig = DEFAULT_KERNELS) -> TileConfig:
    """The tile of an M-row product on a `qtype` matrix: the type's own in the bucket if one is set
    ("b32:Q6_K"), else the bucket's."""
    return kernels.tile_for(tile_key(m, arithmetic), type_name(qtype))


def split_key(arithmetic: str, qtype: int, n_rows: int, n_cols: int) -> str:
    return f"{arithmetic}:{type_name(qtype)}:{n_rows}x{n_cols}"


def k_splits(n_rows: int, n_units: int, target: int | None = None) -> tuple[int, int]:
    """(splits, units per split) of each row's units, about `target` (default SPLIT_TARGET) (row, split)
    pairs in all (the dense kernel passes row tiles and programs): from the matrix shape only, so that
    every M adds the same partial sums in the same order (batch invariance)."""
    wanted = min(n_units, max(1, (target or SPLIT_TARGET) // n_rows))
    per_split = triton.cdiv(n_units, wanted)
    return triton.cdiv(n_units, per_split), per_split


class QuantizedActivations(NamedTuple):
    """x (M, K) quantized per 32 values, as R >= M rows (the rows past M all zero)."""

    codes: torch.Tensor  # (R, K / 4) int32: 4 int8 codes per word, little-endian
    scales: torch.Tensor  # (K / 32, R) fp32: dx = amax / 127, block-major
    code_sums: torch.Tensor  # (K / 32, R, 2) int32: the codes' sums over each half of a block


def new_activations(k: int, rows: int, device: torch.device) -> QuantizedActivations:
    """Uninitialized buffers for `rows` rows of K values quantized per 32."""
    return QuantizedActivations(
        torch.empty(rows, k // 4, dtype=torch.int32, device=device),
        torch.empty(k // 32, rows, dtype=torch.float32, device=device),
        torch.empty(k // 32, rows, 2, dtype=torch.int32, device=device),
    )


def quantize_activations(x: torch.Tensor, rows: int | None = None) -> QuantizedActivations:
    """x (M, K) float, K a multiple of 32 -> its int8 quantization per 32 values (see the module doc),
    padded with zero rows up to `rows` (default M)."""
    m, k = x.shape
    rows = rows or m
    n_blocks = k // 32
    act = new_activations(k, rows, x.device)
    nb = 32  # blocks per program
    _quantize_kernel[(rows, triton.cdiv(n_blocks, nb))](
        x, *act, m, rows, n_blocks, x.stride(0), NB=nb, num_warps=4, enable_fp_fusion=False, **pdl_options(x)
    )
    return act


class MatmulInput(NamedTuple):
    """A matmul's input x, with `int8` = quantize_activations(x.reshape(1, -1)) when the kernel that made
    x (one token) made that too (the norms and SwiGLU's activation in kernels/fused.py, in their own
    launch): the one-row product into packed int8 matrices then uses it instead of quantizing x again."""

    x: torch.Tensor
    int8: QuantizedActivations | None = None

    @staticmethod
    def of(x: torch.Tensor | MatmulInput) -> MatmulInput:
        """x as a MatmulInput: a plain tensor comes without its quantization."""
        return x if isinstance(x, MatmulInput) else MatmulInput(x)


def _pointers(fields: list[torch.Tensor], lay: Layout, as_bytes: bool) -> list[torch.Tensor]:
    """The kernels' (q, hdr, qh, d, m) arguments; a type's missing fields repeat q (never read).
    as_bytes: q and qh viewed as bytes (int8 for Q8_0's signed codes) for the tensor-core path."""
    by_name = {f.name: t for f, t in zip(lay.fields, fields, strict=True)}
    q, qh = by_name["q"], by_name.get("qh", by_name["q"])
    if as_bytes:
        q, qh = q.view(torch.int8 if lay.qtype == QT.Q8_0 else torch.uint8), qh.view(torch.uint8)
    return [q, by_name.get("hdr", q), qh, by_name.get("d", q), by_name.get("m", q)]


def _static_args(lay: Layout, device: torch.device) -> dict:
    """The kernels' compile-time arguments for a layout; ASM: inline PTX (CUDA) or its emulation."""
    has_offset = lay.qtype in (QT.Q4_K, QT.Q5_K, QT.Q4_1)
    asm = device.type == "cuda" and not EMULATE_PTX
    return {"QTYPE": lay.qtype, "G": lay.group, "V": lay.values, "HAS_OFFSET": has_offset, "ASM": asm}


def quant_matmul(
    x: torch.Tensor, fields: list[torch.Tensor], qtype: int, n_rows: int, n_cols: int,
    arithmetic: str = "int8", act: QuantizedActivations | None = None,
    kernels: KernelConfig = DEFAULT_KERNELS,
) -> torch.Tensor:  # fmt: skip
    """x (M, n_cols) @ W^T for a repacked W (n_rows, n_cols) -> (M, n_rows) in x's dtype.

    M <= 64: in `arithmetic` (int8 activations x the codes, or bf16 x x weights
    decoded to bf16), batch-invariant (see the module doc); above: dequantize + matmul. `act`: x's int8
    quantization when a producer made it (MatmulInput.int8), used by the one-row int8 product instead of
    quantizing x again. Works on CUDA tensors, and on CPU tensors under TRITON_INTERPRET=1."""
    lay = layout(qtype, n_cols)
    m = x.shape[0]
    if m > MAX_FUSED_M:
        return x @ dequantize_packed(fields, qtype, n_rows, n_cols, x.dtype).t()
    bf16 = arithmetic == "bf16"
    bm = 1 if m == 1 and not bf16 else max(16, triton.next_power_of_2(m))  # tensor-core columns
    n_blocks = n_cols // block_size(qtype)
    # a matrix's own target, if the settings give any (no key built per call otherwise)
    target = kernels.splits.get(split_key(arithmetic, qtype, n_rows, n_cols)) if kernels.splits else None
    n_splits, per_split = k_splits(n_rows, n_blocks // lay.group, target)
    y = torch.empty(m, n_rows, dtype=x.dtype, device=x.device)
    parts = y if n_splits == 1 else torch.empty(n_splits, m, n_rows, dtype=torch.float32, device=x.device)
    tile = tile_for(m, arithmetic, qtype, kernels)
    grid = (triton.cdiv(n_rows, tile.rows), n_splits)
    counters = tile_counters(x.device, grid[0])
    launch = _static_args(lay, x.device) | {"BN": tile.rows, "num_warps": tile.warps}
    launch |= {"num_stages": tile.stages, "FUSED_SUM": bool(tile.fused_sum)}
    if bf16:
        xb = x.to(torch.bfloat16).contiguous()  # also passed for the int8 scale pointers it never reads
        _matmul_kernel[grid](
            y, parts, counters, xb, xb, xb, *_pointers(fields, lay, True), m, n_rows, n_cols, n_blocks,
            per_split, n_splits, BM=bm, BF16=True, enable_fp_fusion=False, **launch, **pdl_options(y),
        )  # fmt: skip
    elif m == 1:
        if act is None or act.codes.shape != (1, n_cols // 4):
            act = quantize_activations(x.contiguous(), bm)
        _matvec_kernel[grid](
            y, parts, counters, *act, *_pointers(fields, lay, False), n_rows, n_blocks, per_split, n_splits,
            UNROLL=tile.unroll, enable_fp_fusion=False, **launch, **pdl_options(y),
        )  # fmt: skip
    else:
        act = quantize_activations(x.contiguous(), bm)
        _matmul_kernel[grid](
            y, parts, counters, act.codes.view(torch.int8), act.scales, act.code_sums,
            *_pointers(fields, lay, True), m, n_rows, n_cols, n_blocks, per_split, n_splits, BM=bm,
            BF16=False, enable_fp_fusion=False, **launch, **pdl_options(y),
        )  # fmt: skip
    if n_splits > 1 and not tile.fused_sum:
        sum_splits(y, parts)
    return y


MAX_TILES = 1 << 16  # row tiles per matrix the counters cover (4M rows at the smallest tile, 64)


def tile_counters(device: torch.device, n_tiles: int) -> torch.Tensor:
    """The kernels' per-row-tile arrival counters on `device` (see `_finish`): zero between calls, so
    one buffer, allocated once (before any CUDA-graph capture reads it), serves every matmul."""
    if n_tiles > MAX_TILES:
        raise FlashtreeError(f"quantized matmul: {n_tiles} row tiles, more than the {MAX_TILES} counted")
    return _counters(device)


@cache
def _counters(device: torch.device) -> torch.Tensor:
    return torch.zeros(MAX_TILES, dtype=torch.int32, device=device)


def dequantize_packed(
    fields: list[torch.Tensor], qtype: int, n_rows: int, n_cols: int, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """The dense (n_rows, n_cols) weight, decoded by the kernels' own decoder (bit-exact vs the reference
    dequantizer in fp32)."""
    lay = layout(qtype, n_cols)
    n_blocks = n_cols // block_size(qtype)
    out = torch.empty(n_rows, n_cols, dtype=dtype, device=fields[0].device)
    rows = 32
    _dequant_kernel[(triton.cdiv(n_rows, rows), n_blocks // lay.group)](
        out, *_pointers(fields, lay, True), n_rows, n_cols,
        BN=rows, num_warps=4, enable_fp_fusion=False, **_static_args(lay, out.device), **pdl_options(out),
    )  # fmt: skip
    return out


# --- references (plain torch, for the tests and the GPU checks) -----------------------------------------


def quantize_activations_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (codes (M, K / 32, 32) fp32, dx (M, K / 32)): what `quantize_activations` computes."""
    blocks = x.float().view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1)
    return torch.round(blocks * (127 / amax.clamp_min(1e-30))[..., None]), amax / 127


def reference_matmul(
    x: torch.Tensor, raw: torch.Tensor, qtype: int, n_rows: int, n_cols: int
) -> torch.Tensor:
    """The fused kernels' math in fp64, (M, n_rows): the int8-quantized x times the weights decoded by the
    reference dequantizer. GGUF rows raw (n_rows, row_bytes) uint8."""
    codes, dx = quantize_activations_reference(x)
    x_int8 = (codes.double() * dx.double()[..., None]).view(x.shape[0], n_cols)
    return x_int8 @ dequantize(raw, qtype, (n_rows, n_cols)).double().t()
