"""Decode and verify attention over the KV cache in Triton, computing every query row alone in the order
of its positions, so that a verify row equals the AR step at the same position bit for bit.

Why: speculative decoding is lossless only if the verify pass computes what plain decoding would; with
int8-quantized activations a last-bit difference can flip a greedy near-tie downstream, as torch's SDPA
(other kernels for 1 and for 23 rows) did (bench/results/h200-step-2026-12-03). And a tree stores its
nodes' K/V at slots in block order, not at their positions: summing keys by slot would group them
differently than the AR step.

So row t (at position start + depth[t]) walks its positions 0 .. start + depth[t]: committed ones at
their own slots, its ancestors' at start + path[t][position - start]. Positions are cut into splits
(position-aligned, of a size fixed by the cache: the same for every call of an engine, split_positions),
each split in tiles of TILE_POSITIONS positions (online softmax in fp32, the same tiles for every row);
the program of a (row group, KV head) that finishes its split last combines the splits in order (an
arrival counter: one launch a layer). A split past a row's last position adds exact zeros, so the number
of splits launched (a CUDA graph's fixed key bucket) does not matter either.
Query heads of one KV head (GQA) share a program, and a verify's program takes several rows (`row_group`)
that read each committed K/V tile once (bench/results/h100-replay-2026-12-05).
K and V are planes of any KV cache type (quant/kv.py), their tiles dequantized in registers
(kernels/kv_tiles.py): no dequantized copy of the cache.
Compiled without fp fusion: the AR step and the verify are two variants of the kernel, and whether a
multiply and an add become one fma depends on the code around them.
"""

from __future__ import annotations

import torch

from flashtree.kernels import tl, triton
from flashtree.kernels.kv_tiles import kv_tile, plane_args, rotate_rows
from flashtree.kernels.launch import pdl_options, wait_for_inputs
from flashtree.kernels.qmatmul import tile_counters
from flashtree.quant.kv import KVPlane, as_plane, rotation_scale, rotation_signs, rotation_size

MAX_SPLIT = 512  # positions per split at most: a program's share of a long context
SPLITS_PER_CACHE = 64  # a whole cache is cut into at most this many splits (unless a tile is longer)
# Why: long contexts want long splits, short ones many (bench/results/h100-attention-splits-2026-12-05);
# a verify writes rows x heads x splits partial outputs, so more splits cost it bytes.
TILE_POSITIONS = 64  # positions per inner step, whatever the head size
BF16_DOTS = True  # bf16 models: dots on bf16 operands (`dot_mode`)
NUM_WARPS = 8  # warps a program for heads of 256 values (4 for smaller heads)
NUM_STAGES = 2  # the software pipeline's depth over the committed K/V tiles: two tiles of K and V in flight
# Why: 64-position steps of bf16 dots instead of a serial walk of small tf32 dots; three stages did not
# fit an SM's shared memory (bench/results/h100-attention-tiles64-2026-12-06).
COMBINE_ROUND = tl.constexpr(16)  # splits whose maxima the combine loads at once
COMBINE_SLOTS = 128  # ... and query slots x splits whose partial outputs it loads at once
MAX_ROWS = 16  # rows of a tree a program takes at most
SHORT_ROWS = 2  # ... and below ROWS_FROM_KEYS key positions at most this many
ROWS_FROM_KEYS = 2048
# Why: at a few hundred keys a program's serial part is its rows' own tiles and their combine, not the
# committed tiles they share; the AR step's row alone, as padding it only cost
# (bench/results/h100-default-pair-2026-12-06).
VERIFY_QUERIES = 32  # a verify's wider query tile, where it pays (`row_group`)
WIDE_FROM_KEYS = 4096  # key positions from which a verify may take the wider tile
# Why: the wider tile reads each KV head's cache fewer times for a long verify, but pads more queries, which
# costs at short contexts and for few heads a KV head (bench/results/attention-rows-2026-12-06).
UNPACKED_QUERIES = 64  # a verify's widest tile, over a cache the kernel unpacks (UNPACKED_TYPES) ...
UNPACKED_FROM_KEYS = 16384  # ... from this many key positions, where it takes the fewest programs
# Why: each program unpacks every tile it reads, so there programs cost, not padded queries; over bf16
# and q8_0 caches and below 16K keys the 64-query tile loses (bench/results/h100-verify-tile64-2026-12-07).
UNPACKED_TYPES = ("q4_0", "tq3_0")


def row_group(group: int, rows: int, n_keys: int, unpacks: bool = False) -> tuple[int, int]:
    """(rows R, query tile QB) of one program of a call of `rows` rows over `n_keys` key positions: QB
    is the tile one row's `group` query heads pad to (a power of two, >= 16 for the dots), and a verify's
    R rows fill it (the 27B's 6 heads a KV head: 2 rows in 16; SmolLM2's 3: 5 rows), at most SHORT_ROWS
    below ROWS_FROM_KEYS keys; an AR step's one row is alone. A program's rows share every committed K/V
    tile they read. From WIDE_FROM_KEYS keys a verify takes VERIFY_QUERIES queries instead where that
    computes fewer query slots (programs x QB) than the narrow tile: the 27B's 5 rows in 32. Over a cache
    the kernel unpacks (`unpacks`), from UNPACKED_FROM_KEYS keys, it takes the tile of the fewest programs
    of these and UNPACKED_QUERIES (the 27B's 10 rows in 64; a tie: the narrower). A row's bits do not
    depend on the tile or its rows (`_tile_update`), so a verify's rows equal the AR step's."""
    narrow = max(16, triton.next_power_of_2(group))
    if rows == 1:  # the AR step
        return 1, narrow

    def filled(queries: int, most: int = MAX_ROWS) -> tuple[int, int]:
        return max(1, min(most, queries // group)), queries

    tiles = [filled(narrow, SHORT_ROWS if n_keys < ROWS_FROM_KEYS else MAX_ROWS)]
    if n_keys >= WIDE_FROM_KEYS and narrow < VERIFY_QUERIES:
        tiles.append(filled(VERIFY_QUERIES))
    if unpacks and n_keys >= UNPACKED_FROM_KEYS and narrow < UNPACKED_QUERIES:
        tiles.append(filled(UNPACKED_QUERIES))
        return min(tiles, key=lambda tile: (triton.cdiv(rows, tile[0]), tile[1]))  # fewest programs
    return min(tiles, key=lambda tile: triton.cdiv(rows, tile[0]) * tile[1])  # fewest query slots


def combine_in_flight(queries: int) -> int:
    """Splits whose partial outputs a combine of a `queries`-query tile loads at once: COMBINE_SLOTS query
    rows' worth, 1 to 4. More rounds cost more L2 round trips; more loads at once need their registers
    in the same kernel as the split's loop (a 64-query tile's 4 x 64 KB spilled into it)."""
    return max(1, min(4, COMBINE_SLOTS // queries))


def split_positions(slots: int) -> int:
    """Positions per split for a KV cache of `slots` slots: a power of two from one tile to MAX_SPLIT
    cutting the whole cache into at most SPLITS_PER_CACHE splits. It depends on the cache only, so the
    AR step and every verify of an engine split alike (their rows agree bit for bit). Not always
    MAX_SPLIT: at a few hundred keys a step's attention would be a handful of programs each walking
    several tiles in turn."""
    want = triton.next_power_of_2(triton.cdiv(slots, SPLITS_PER_CACHE))
    return min(MAX_SPLIT, max(TILE_POSITIONS, want))


@triton.jit
def _operand(x, DOTS: tl.constexpr):
    """x as a tensor-core operand of `DOTS` (see `dot_mode`): bf16 for "bf16", bf16 values held in fp32
    for "bf16 in fp32", else fp32."""
    if DOTS == "bf16":
        return x.to(tl.bfloat16)
    elif DOTS == "bf16 in fp32":
        return x.to(tl.bfloat16).to(tl.float32)
    else:
        return x.to(tl.float32)


@triton.jit
def _dot(a, b, DOTS: tl.constexpr):
    """a @ b of `_operand` tiles on tensor cores, fp32 accumulation (see `dot_mode`)."""
    if DOTS == "tf32x3":
        return tl.dot(a, b, input_precision="tf32x3")
    elif DOTS == "tf32":
        return tl.dot(a, b, input_precision="tf32")
    elif DOTS == "bf16":
        return tl.dot(a, b, out_dtype=tl.float32)
    else:
        return tl.dot(a, b, input_precision="ieee")


def dot_mode(q: torch.Tensor) -> str:
    """The dots' operands for queries q. fp32 models: "tf32x3", each operand a TF32 part plus a TF32
    remainder, ~fp32 accuracy (exact-product FMA dots, "ieee", ran several times slower in the fp32
    matmul: bench/results/h200-dense-matmul-2026-12-04). bf16 models (BF16_DOTS): "bf16", q, K, V and
    the softmax weights p as bf16 (p rounded to bf16, as FlashAttention does; the rest are bf16 values
    already, so their products are exact): half the registers and none of the fp32 conversions of
    "tf32" (fp32 tiles, exact for values that came from bf16, p rounded to TF32). Triton's interpreter
    multiplies bf16 dots' raw bits, so off CUDA the bf16 operands are held in fp32: "bf16 in fp32"."""
    if q.dtype == torch.float32:
        return "tf32x3"
    if q.dtype != torch.bfloat16 or not BF16_DOTS:
        return "tf32"
    return "bf16" if q.is_cuda else "bf16 in fp32"


@triton.jit
def _row_sums(p, DOTS: tl.constexpr):
    """p's row sums by the tensor cores (the same products and order as the p @ V dot's), not by a
    reduction across threads, whose order follows how the tile is laid over the warps: so a row's sum is
    the same in a 16-query tile (the AR step) and a 32-query one (a verify). Each row of the (QB, 16) dot
    holds the sum 16 times; their max is it, exactly."""
    ones = tl.full((p.shape[1], 16), 1.0, tl.float32)
    return tl.max(_dot(_operand(p, DOTS), _operand(ones, DOTS), DOTS), axis=1)


@triton.jit
def _tile_update(
    q, k, v, key_ok, valid, mine, m, denom, acc, scale,
    DOTS: tl.constexpr, KEY_MASK: tl.constexpr, ROW: tl.constexpr,
):  # fmt: skip
    """One tile of keys added to the online softmax (m, denom, acc) of q's queries: the same operations
    for a tile shared by all of a program's rows and for one row's own tile (ROW: only the `mine`
    queries take it; the others add exact zeros), so that a query's sums do not depend on which way its
    tiles came. k: the tile's K^T (BD, BLOCK); valid: (BLOCK,) positions inside the split and the row's
    reach; key_ok: (QB or 1, BLOCK) committed keys each query attends to (KEY_MASK)."""
    scores = _dot(q, _operand(k, DOTS), DOTS)  # (QB, BLOCK)
    if KEY_MASK:
        scores = tl.where(key_ok, scores, -1e30)
    scores = tl.where(valid[None, :], scores * scale, float("-inf"))
    if ROW:
        scores = tl.where(mine[:, None], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(scores - m_new[:, None])
    if ROW:  # the others' m may still be -inf: exp(-inf + inf) is nan
        alpha = tl.where(mine, alpha, 1.0)
        p = tl.where(mine[:, None], p, 0.0)
    denom = denom * alpha + _row_sums(p, DOTS)
    acc = acc * alpha[:, None] + _dot(_operand(p, DOTS), _operand(v, DOTS), DOTS)
    return m_new, denom, acc


@triton.jit
def _kv_tiles(
    kd, ks, kh, skd, sks, skh, vd, vs, vh, svd, svs, svh, slot, ok, HD: tl.constexpr,
    BLOCK: tl.constexpr, BD: tl.constexpr, KIND_K: tl.constexpr, KIND_V: tl.constexpr,
):  # fmt: skip
    """The K^T tile (BD, BLOCK) and the V tile (BLOCK, BD) of cache slots `slot` (kernels/kv_tiles.py),
    together: the V tile's load is in flight while the scores are computed."""
    k = kv_tile(kd, ks, kh, slot, ok, skd, sks, skh, HD, BLOCK, BD, KIND_K, True)
    v = kv_tile(vd, vs, vh, slot, ok, svd, svs, svh, HD, BLOCK, BD, KIND_V, False)
    return k, v


@triton.jit
def _shared_tiles(
    q, m, denom, acc, kd, ks, kh, skd, sks, skh, vd, vs, vh, svd, svs, svh, key_ok_ptr, stride_ok,
    row, real, low, first, end, hi, scale, HD: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr,
    DOTS: tl.constexpr, KEY_MASK: tl.constexpr, WINDOW: tl.constexpr, KIND_K: tl.constexpr,
    KIND_V: tl.constexpr,
):  # fmt: skip
    """Tiles [first, end) of committed positions, every row's: loaded once, all queries at once. low:
    (QB,) each query's first position in its window (WINDOW)."""
    for b in range(first, end, BLOCK):
        pos = b + tl.arange(0, BLOCK)
        valid = pos < hi  # all true: the same mask a row's own tile applies
        k, v = _kv_tiles(
            kd, ks, kh, skd, sks, skh, vd, vs, vh, svd, svs, svh, pos, valid, HD, BLOCK, BD, KIND_K, KIND_V
        )
        key_ok = valid[None, :]  # unused without KEY_MASK or WINDOW
        if KEY_MASK:
            key_ok = tl.load(key_ok_ptr + row[:, None] * stride_ok + pos[None, :]) != 0
        if WINDOW:
            key_ok = key_ok & (pos[None, :] >= low[:, None])
        m, denom, acc = _tile_update(
            q, k, v, key_ok, valid, real, m, denom, acc, scale, DOTS, KEY_MASK or WINDOW, False
        )
    return m, denom, acc


@triton.jit
def _row_tiles(
    q, m, denom, acc, kd, ks, kh, skd, sks, skh, vd, vs, vh, svd, svs, svh, key_ok_ptr, stride_ok,
    path_ptr, depth_ptr, group, start, block, n_rows, real, member, first, hi, split_end, window, scale,
    HD: tl.constexpr, BD: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr, DOTS: tl.constexpr,
    KEY_MASK: tl.constexpr, WINDOW: tl.constexpr, KIND_K: tl.constexpr, KIND_V: tl.constexpr,
):  # fmt: skip
    """Tiles [first, hi) that hold block positions of some rows: gathered row by row (each its own
    ancestors, block node j at slot block + j), each row's queries taking only their own tile's update."""
    for b in range(first, hi, BLOCK):
        pos = b + tl.arange(0, BLOCK)
        rel = pos - start  # >= 0: the block token at depth rel on the row's path
        for r in range(R):
            t = group * R + r
            n_pos = start + tl.load(depth_ptr + tl.minimum(t, n_rows - 1)) + 1
            reach = tl.minimum(split_end, n_pos)
            low = n_pos - window  # the row's window (WINDOW)
            take = (t < n_rows) & (b < reach)  # the tile holds a position of this row
            if WINDOW:
                take = take & (b + BLOCK > low)
            if take:
                ok = pos < reach
                node = tl.load(path_ptr + t * n_rows + rel, mask=ok & (rel >= 0), other=0)
                slot = tl.where(rel >= 0, block + node, pos)
                k, v = _kv_tiles(
                    kd, ks, kh, skd, sks, skh, vd, vs, vh, svd, svs, svh, slot, ok, HD, BLOCK, BD,
                    KIND_K, KIND_V,
                )  # fmt: skip
                key_ok = ok[None, :]  # unused without KEY_MASK or WINDOW
                if KEY_MASK:
                    row_ok = tl.load(key_ok_ptr + t * stride_ok + pos, mask=ok & (rel < 0), other=1)
                    key_ok = (row_ok != 0)[None, :]
                if WINDOW:
                    key_ok = key_ok & (pos >= low)[None, :]
                mine = real & (member == r)  # the row's queries
                m, denom, acc = _tile_update(
                    q, k, v, key_ok, ok, mine, m, denom, acc, scale, DOTS, KEY_MASK or WINDOW, True
                )
    return m, denom, acc


@triton.jit
def _split_kernel(
    q_ptr, kd, ks, kh, skd_h, skd, sks_h, sks, skh_h, skh, vd, vs, vh, svd_h, svd, svs_h, svs, svh_h, svh,
    path_ptr, depth_ptr, start_ptr, block_ptr, key_ok_ptr, m_ptr, l_ptr, acc_ptr, out_ptr, counter_ptr,
    n_rows, n_kv, n_heads, n_splits, stride_qt, stride_qh, stride_ok, scale, window, signs,
    G: tl.constexpr, R: tl.constexpr, QB: tl.constexpr, HD: tl.constexpr, BD: tl.constexpr,
    SPLIT_N: tl.constexpr, BLOCK: tl.constexpr, DOTS: tl.constexpr, KEY_MASK: tl.constexpr,
    WINDOW: tl.constexpr, KIND_K: tl.constexpr, KIND_V: tl.constexpr, ROT: tl.constexpr,
    RSCALE: tl.constexpr, IN_FLIGHT: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """Program (row group, kv head, split): the G query heads of R rows (query i: row i // G, head i % G)
    over the split's positions (committed position p at slot p, block node j at slot block + j): the
    tiles wholly below the block's first tile are every row's (`_shared_tiles`), the rest (at most a few
    past `start`) differ by row (`_row_tiles`). K and V are planes of any KV type (kd, ks, kh: K's data,
    scale and high fields; s*_h / s*: their head and slot strides). KEY_MASK: committed positions p with
    key_ok[t * stride_ok + p] false are left out of row t (stride_ok 0: one mask for every row); WINDOW:
    row t at position p reads positions p - window + 1 .. p only. Left-out keys score -1e30, not -inf: a
    split of such keys only then has a finite max and finite sums, which the combine weighs by
    exp(-1e30 - max) = 0, and a tile of them adds exact zeros, so tiles visited for other rows change
    no row's bits. A tq3_0 K's queries and a tq3_0 V's outputs are rotated in the program (`_queries`,
    `_finish`; groups of ROT, signs: quant/kv.py's rotation_signs)."""
    wait_for_inputs(GDC)
    group, kvh, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(start_ptr)
    i = tl.arange(0, QB)
    d = tl.arange(0, BD)
    member = i // G  # the query's row in the group
    row = group * R + member
    real = (i < R * G) & (row < n_rows)
    row = tl.minimum(row, n_rows - 1)  # padding queries read row n_rows - 1, never stored
    heads = kvh * G + i % G
    n_pos = start + tl.load(depth_ptr + row) + 1  # (QB,) positions each query's row sees
    head_dims = (d < HD)[None, :]
    q = _queries(q_ptr + row[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                 real[:, None] & head_dims, signs, QB, BD, ROT, RSCALE, DOTS, KIND_K)  # fmt: skip
    m = tl.full((QB,), float("-inf"), tl.float32)
    denom = tl.zeros((QB,), tl.float32)
    acc = tl.zeros((QB, BD), tl.float32)
    lo = s * SPLIT_N
    hi = tl.minimum(lo + SPLIT_N, tl.max(tl.where(real, n_pos, 0)))  # the group's reach in this split
    shared_end = tl.minimum(hi, start // BLOCK * BLOCK)  # tiles of committed positions only
    low = n_pos - window  # each query's window
    if WINDOW:  # from the tile of the group's first position in a window
        lo = tl.maximum(lo, tl.maximum(tl.min(tl.where(real, low, hi)), 0) // BLOCK * BLOCK)
    kd, ks, kh = kd + kvh * skd_h, ks + kvh * sks_h, kh + kvh * skh_h
    vd, vs, vh = vd + kvh * svd_h, vs + kvh * svs_h, vh + kvh * svh_h
    m, denom, acc = _shared_tiles(
        q, m, denom, acc, kd, ks, kh, skd, sks, skh, vd, vs, vh, svd, svs, svh, key_ok_ptr, stride_ok,
        row, real, low, lo, shared_end, hi, scale, HD, BD, BLOCK, DOTS, KEY_MASK, WINDOW, KIND_K,
        KIND_V,
    )  # fmt: skip
    m, denom, acc = _row_tiles(
        q, m, denom, acc, kd, ks, kh, skd, sks, skh, vd, vs, vh, svd, svs, svh, key_ok_ptr, stride_ok,
        path_ptr, depth_ptr, group, start, tl.load(block_ptr), n_rows, real, member,
        tl.maximum(lo, shared_end), hi, s * SPLIT_N + SPLIT_N, window, scale, HD, BD, R, BLOCK, DOTS,
        KEY_MASK, WINDOW, KIND_K, KIND_V,
    )  # fmt: skip
    _finish(m, denom, acc, row * n_heads + heads, real, head_dims, d, m_ptr, l_ptr, acc_ptr, out_ptr,
            counter_ptr + group * n_kv + kvh, s, n_splits, signs, QB, HD, BD, ROT, RSCALE,
            KIND_V, IN_FLIGHT)  # fmt: skip


@triton.jit
def _queries(
    at, ok, signs, QB: tl.constexpr, BD: tl.constexpr, ROT: tl.constexpr, RSCALE: tl.constexpr,
    DOTS: tl.constexpr, KIND_K: tl.constexpr,
):  # fmt: skip
    """The program's query tile as a dot operand; for a tq3_0 K rotated as the keys are (in fp32, then
    rounded to q's dtype, as quant/kv.py's `rotate(q).to(q.dtype)`)."""
    q = tl.load(at, mask=ok, other=0.0)
    if KIND_K == 3:
        q = rotate_rows(q.to(tl.float32), signs, QB, BD, ROT, RSCALE, False).to(at.dtype.element_ty)
    return _operand(q, DOTS)


@triton.jit
def _output(x, signs, QB: tl.constexpr, BD: tl.constexpr, ROT: tl.constexpr, RSCALE: tl.constexpr,
            KIND_V: tl.constexpr):  # fmt: skip
    """The output rows x (QB, BD) fp32, rotated back for a tq3_0 V (its values are rotated)."""
    if KIND_V == 3:
        x = rotate_rows(x, signs, QB, BD, ROT, RSCALE, True)
    return x


@triton.jit
def _finish(
    m, denom, acc, rows, real, head_dims, d, m_ptr, l_ptr, acc_ptr, out_ptr, tile, s, n_splits, signs,
    QB: tl.constexpr, HD: tl.constexpr, BD: tl.constexpr, ROT: tl.constexpr, RSCALE: tl.constexpr,
    KIND_V: tl.constexpr, IN_FLIGHT: tl.constexpr,
):  # fmt: skip
    """Store the split's running max m, sum l and unnormalized output acc (fp32) of heads `rows`
    (row, query head); the program of (row group, kv head) whose count at `tile` arrives last combines
    the splits into the output (`_combine`) and zeroes the count for the next call."""
    out_ok = real[:, None] & head_dims
    outs = out_ptr + rows[:, None] * HD + d[None, :]
    if n_splits == 1:  # the combine of one split: weight exp(0) = 1, the same bits
        out = _output(acc / denom[:, None], signs, QB, BD, ROT, RSCALE, KIND_V)
        tl.store(outs, out.to(out_ptr.dtype.element_ty), mask=out_ok)
    else:
        at = rows * n_splits + s  # (row, head, split)
        tl.store(m_ptr + at, m, mask=real)
        tl.store(l_ptr + at, denom, mask=real)
        tl.store(acc_ptr + at[:, None] * BD + d[None, :], acc, mask=real[:, None])
        tl.debug_barrier()  # every thread's partial is stored before the count (released by it)
        if tl.atomic_add(tile, 1, sem="acq_rel", scope="gpu") == n_splits - 1:
            combined = _combine(m_ptr, l_ptr, acc_ptr, rows, real, n_splits, BD, IN_FLIGHT)
            out = _output(combined, signs, QB, BD, ROT, RSCALE, KIND_V)
            tl.store(outs, out.to(out_ptr.dtype.element_ty), mask=out_ok)
            tl.atomic_xchg(tile, 0, sem="relaxed", scope="gpu")  # zero again for the next call


@triton.jit
def _combine(m_ptr, l_ptr, acc_ptr, rows, head_ok, n_splits, BD: tl.constexpr, IN_FLIGHT: tl.constexpr):
    """The output (before its cast) of heads `rows`: their splits combined in split order, the max,
    then the rescaled sums. The reads bypass L1: other SMs wrote them. They go in rounds whose loads are
    in flight together (COMBINE_ROUND splits' maxima, then IN_FLIGHT splits' sums and outputs,
    `_add_split_terms`): loaded one after another, each split would cost an L2 round trip."""
    first = rows * n_splits
    d = tl.arange(0, BD)
    r = tl.arange(0, COMBINE_ROUND)
    top = tl.full(rows.shape, float("-inf"), tl.float32)
    for s in range(0, n_splits, COMBINE_ROUND):  # the max: exact in any order
        ok = head_ok[:, None] & (s + r < n_splits)[None, :]
        maxima = tl.load(
            m_ptr + first[:, None] + s + r[None, :], mask=ok, other=float("-inf"), cache_modifier=".cg"
        )
        top = tl.maximum(top, tl.max(maxima, axis=1))
    top = tl.where(head_ok, top, 0.0)  # padding heads: their weights exp(0) = 1, their sums 0 / 1
    acc_at = acc_ptr + first[:, None] * BD + d[None, :]
    w, total, acc = _split_terms(m_ptr, l_ptr, acc_at, first, head_ok, 0, n_splits, top, BD)
    total, acc = w * total, w[:, None] * acc  # split 0 starts the sums
    total, acc = _add_split_terms(
        total, acc, m_ptr, l_ptr, acc_at, first, head_ok, 1, n_splits, top, BD, IN_FLIGHT - 1
    )  # fmt: skip
    for s in range(IN_FLIGHT, n_splits, IN_FLIGHT):  # an empty split: exp(-inf) = 0, exact zeros added
        total, acc = _add_split_terms(
            total, acc, m_ptr, l_ptr, acc_at, first, head_ok, s, n_splits, top, BD, IN_FLIGHT
        )  # fmt: skip
    return acc / total[:, None]


@triton.jit
def _add_split_terms(
    total, acc, m_ptr, l_ptr, acc_at, first, head_ok, s, n_splits, top, BD: tl.constexpr, N: tl.constexpr
):  # fmt: skip
    """(total, acc) plus splits s .. s + N - 1 (those < n_splits) in split order, each weighted by
    exp(m - top); unrolled, so their loads (which no sum waits on) are in flight together."""
    for j in tl.static_range(N):
        w, part_l, part_acc = _split_terms(m_ptr, l_ptr, acc_at, first, head_ok, s + j, n_splits, top, BD)
        total = tl.where(s + j < n_splits, total + w * part_l, total)
        acc = tl.where(s + j < n_splits, acc + w[:, None] * part_acc, acc)
    return total, acc


@triton.jit
def _split_terms(m_ptr, l_ptr, acc_at, first, head_ok, s, n_splits, top, BD: tl.constexpr):
    """Split s's weight exp(m_s - top), sum l_s and output acc_s (a split past the last reads the last
    again; the caller does not add it)."""
    s = tl.minimum(s, n_splits - 1)
    w = tl.exp(tl.load(m_ptr + first + s, mask=head_ok, other=0.0, cache_modifier=".cg") - top)
    part_l = tl.load(l_ptr + first + s, mask=head_ok, other=1.0, cache_modifier=".cg")
    return w, part_l, tl.load(acc_at + s * BD, mask=head_ok[:, None], other=0.0, cache_modifier=".cg")


def tree_attention(
    q: torch.Tensor,  # (T, n_heads, head_dim), unit stride along head_dim
    k_cache: torch.Tensor | KVPlane,  # (n_kv, slots, head_dim) or a plane of fields (n_kv, slots, ...)
    v_cache: torch.Tensor | KVPlane,
    start: torch.Tensor,  # 0-d long: committed tokens = the first block slot
    path: torch.Tensor,  # (T, T) int32: row t's ancestors and itself, root first (BlockLayout.paths)
    depths: torch.Tensor,  # (T,) int32
    n_keys: int,  # slots that may be read (start + T, or a CUDA graph's bucket): sizes the split grid
    scale: float,
    key_ok: torch.Tensor | None = None,  # (T, >= start) bool: the committed slots each row attends to
    # (None: all)
    block_at: torch.Tensor | None = None,  # 0-d long: the slot of block node 0 (None: start)
    split_for: int | None = None,  # the slot count the split size follows (None: the cache's)
    window: int = 0,  # 0: every position; else row at position p reads p - window + 1 .. p only
    tile: tuple[int, int] | None = None,  # (rows, queries) of a program (None: row_group's)
    dots: str | None = None,  # the dots' operands (None: dot_mode's): a test's or a sweep's launch
) -> torch.Tensor:
    """softmax(q K^T * scale) V of every row over its committed keys (those of `key_ok`) and its
    ancestors (itself included), (T, n_heads, head_dim) in q's dtype. key_ok may be a row broadcast
    (stride 0 between rows: one mask for every row, read as such). The block's K/V sit at slots
    start.. (the target's cache) or at block_at.. (the draft's ring keeps them past its slots). K and
    V may be of any KV type (quant/kv.py), read in the kernel; tq3_0's are rotated, so the kernel
    rotates q for a tq3_0 K and the output back for a tq3_0 V (each row alone, so a verify row still
    equals the AR step)."""
    k_cache, v_cache = as_plane(k_cache), as_plane(v_cache)
    t, n_heads, hd = q.shape
    n_kv = k_cache.data.shape[0]
    group = n_heads // n_kv
    bd = triton.next_power_of_2(hd)
    *k_args, kind_k = plane_args(k_cache)
    *v_args, kind_v = plane_args(v_cache)
    unpacks = k_cache.kind in UNPACKED_TYPES or v_cache.kind in UNPACKED_TYPES
    rows, queries = tile or row_group(group, t, n_keys, unpacks)
    split = split_positions(split_for or k_cache.data.shape[1])
    n_splits = triton.cdiv(n_keys, split)
    n_groups = triton.cdiv(t, rows)
    if key_ok is not None and key_ok.stride(-1) != 1:
        key_ok = key_ok.contiguous()
    m = torch.empty(t, n_heads, n_splits, dtype=torch.float32, device=q.device)
    lsum = torch.empty_like(m)
    acc = torch.empty(t, n_heads, n_splits, bd, dtype=torch.float32, device=q.device)
    out = torch.empty(t, n_heads, hd, dtype=q.dtype, device=q.device)
    rot = rotation_size(hd)
    _split_kernel[(n_groups, n_kv, n_splits)](
        q, *k_args, *v_args, path, depths, start, start if block_at is None else block_at,
        start if key_ok is None else key_ok.view(torch.uint8),
        m, lsum, acc, out, tile_counters(q.device, n_groups * n_kv), t, n_kv, n_heads, n_splits,
        q.stride(0), q.stride(1), 0 if key_ok is None else key_ok.stride(0), scale, window,
        rotation_signs(rot, q.device), G=group, R=rows, QB=queries, HD=hd, BD=bd, SPLIT_N=split,
        BLOCK=TILE_POSITIONS, DOTS=dots or dot_mode(q), KEY_MASK=key_ok is not None, WINDOW=window > 0,
        KIND_K=kind_k, KIND_V=kind_v, ROT=rot, RSCALE=rotation_scale(rot),
        IN_FLIGHT=combine_in_flight(queries),
        num_warps=NUM_WARPS if bd >= 256 else 4, num_stages=NUM_STAGES, enable_fp_fusion=False,
        **pdl_options(q),
    )  # fmt: skip
    return out


def block_attention(
    q: torch.Tensor,  # (B, n_heads, head_dim): a draft block's rows
    keys: torch.Tensor,  # (n_kv, slots, head_dim): S context keys at slots 0..S-1, the block's at block_at..
    values: torch.Tensor,
    key_ok: torch.Tensor,  # (B, S) bool: the context keys each row attends to (a row broadcast: all alike)
    scale: float,
    block_at: int,
) -> torch.Tensor:
    """A DFlash draft block's attention: every row over its context keys (the live ones; a sliding
    window's layer: those inside the row's window) and all B block keys (no causal order inside a
    block), (B, n_heads, head_dim). It is tree_attention with each row's "path"
    the whole block, its splits those of S + B slots. The block's K/V sit in the draft's ring past its
    context slots (written there with the rotary, one launch), not in a concatenation of the context
    and the block (two copies of the whole context a layer). Not SDPA: its fp32 kernel for a draft
    block's few rows was slow (bench/results/h200-dense-matmul-2026-12-04)."""
    b, s = q.shape[0], key_ok.shape[1]
    start, block, path, depths = _whole_block(b, s, block_at, q.device)
    return tree_attention(q, keys, values, start, path, depths, s + b, scale, key_ok, block, split_for=s + b)


_BLOCKS: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _whole_block(b: int, s: int, block_at: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(start = s, block_at, paths: every row sees block nodes 0..b-1, depths b-1) as device tensors,
    made once per shape (on a draft step's eager first run, before a CUDA graph captures the step)."""
    key = (b, s, block_at, device)
    if key not in _BLOCKS:
        path = torch.arange(b, dtype=torch.int32, device=device).expand(b, b).contiguous()
        depths = torch.full((b,), b - 1, dtype=torch.int32, device=device)
        start, block = (torch.full((), n, dtype=torch.long, device=device) for n in (s, block_at))
        _BLOCKS[key] = start, block, path, depths
    return _BLOCKS[key]
