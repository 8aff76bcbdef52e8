"""The bf16 Q4_K matmul for sm_90 in Gluon (explicit layouts), opt-in: FLASHTREE_QMM_KERNEL=gluon (issue #40).

Triton's `tl` kernel (qmatmul.py) spends ~1.3 of its 4.8 SASS instructions a weight moving the codes into
the wgmma A-operand layout (bench/results/cpu-sm90-qmm-sass-2026-12-07). Here the codes are loaded straight
into that layout and decoded in registers:

- Layout (`fragment_fields`, once at load; `unpack` inverts it): inside each row's 32-byte run of a Q4_K
  group pair (low nibbles: group 2p, high: group 2p + 1), value k = 16j + 8h + 2c + t moves to byte
  8c + 4j + 2t + h. Thread c of a quad (the fragment's k columns 2c, 2c + 1, 2c + 8, 2c + 9, + 16) then
  reads its row's 8 bytes with one 8-byte load, and in each word k, k + 1 sit in bytes 0 and 2:
  `(w >> s) & 0x000F000F | 0x43004300`, s = 0, 8, 4, 12, is a bf16x2 magic pair in register order.
- Numerics: the same as the `tl` kernel's bf16 path, op for op: scale = bf16(d * sc), shift = bf16(-dmin
  * mn), per weight fma(fma(128 + code, 1, -128), scale, shift) in bf16x2, one wgmma m64nBMk16 pair per
  32-value group into the fp32 accumulator in k order (A from registers, B = x from shared memory), the
  same K-splits and the same split sums (qmatmul.sum_splits). So its outputs equal the `tl` kernel's bit
  for bit (tests/gpu/test_gluon_qmm_gpu.py checks that on the device) and are batch-invariant alike.
"""

from __future__ import annotations

import torch

from flashtree.kernels import qmatmul
from flashtree.quant.formats import QT

# --- layout (torch, any device) -----------------------------------------------------------------------

RUN = 32  # bytes of one row's group pair: 64 values, two per byte


def _fragment_positions() -> torch.Tensor:
    """New byte position of value k (0-63 of a group pair, byte k % 32 of the GGUF run)."""
    k = torch.arange(RUN)
    j, h, c, t = k // 16, k // 8 % 2, k // 2 % 4, k % 2
    return 8 * c + 4 * j + 2 * t + h


POSITIONS = _fragment_positions()
ORDER = torch.argsort(POSITIONS)  # new byte p holds old byte ORDER[p]


def _permute_runs(q: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """q (n_blocks, 8, n_rows, 4) int32 (qmatmul.repack's Q4_K codes: chunk 2p + i holds bytes 16i..16i+15
    of group pair p's run) with every run's bytes reordered: new byte b = old byte index[b]."""
    n_blocks, _, n_rows, _ = q.shape
    runs = q.view(torch.uint8).view(n_blocks, 4, 2, n_rows, 16).permute(0, 1, 3, 2, 4)
    runs = runs.reshape(n_blocks, 4, n_rows, RUN)[..., index.to(q.device)]
    out = runs.view(n_blocks, 4, n_rows, 2, 16).permute(0, 1, 3, 2, 4).contiguous()
    return out.view(n_blocks, 8, n_rows, 16).view(torch.int32).view(q.shape)


def fragment_fields(fields: list[torch.Tensor]) -> list[torch.Tensor]:
    """qmatmul.repack's Q4_K fields (q, hdr) with q's runs in fragment order (the module doc); hdr shared."""
    q, hdr = fields
    return [_permute_runs(q, ORDER), hdr]


def standard_fields(fields: list[torch.Tensor]) -> list[torch.Tensor]:
    """Inverse of `fragment_fields`."""
    q, hdr = fields
    return [_permute_runs(q, POSITIONS), hdr]


def unpack(fields: list[torch.Tensor], n_cols: int, rows: slice = slice(None)) -> torch.Tensor:
    """The GGUF rows (n_rows, row_bytes) uint8 of fragment-ordered Q4_K fields, bit for bit."""
    return qmatmul.unpack(standard_fields(fields), QT.Q4_K, n_cols, rows)


def fragment_codes(q: torch.Tensor) -> torch.Tensor:
    """The codes (n_rows, n_blocks * 256) as the kernel's bit ops read fragment-ordered q: thread c's word j
    of a run, shifted by 0, 8 (values k, k + 1 and k + 8, k + 9 of the low group) and 4, 12 (the high
    group), masked to the nibbles in bits 0-3 and 16-19 (the bf16x2 pair's low and high value)."""
    n_blocks, _, n_rows, _ = q.shape
    runs = q.view(torch.uint8).view(n_blocks, 4, 2, n_rows, 16).permute(3, 0, 1, 2, 4)
    words = runs.reshape(n_rows, n_blocks, 4, 4, 2, 4).to(torch.int64)  # (row, blk, p, c, j, byte)
    words = (words << (8 * torch.arange(4))).sum(-1)  # little-endian int32 words, as int64
    out = torch.empty(n_rows, n_blocks, 4, 2, 4, 2, 2, 2, dtype=torch.int64)  # (.., p, g, c, j, h, t)
    for g in range(2):
        for h in range(2):
            pair = (words >> (8 * h + 4 * g)) & 0x000F000F
            out[:, :, :, g, :, :, h, 0] = pair & 0xFFFF
            out[:, :, :, g, :, :, h, 1] = pair >> 16
    # value 64p + 32g + 16j + 8h + 2c + t
    return out.permute(0, 1, 2, 3, 5, 6, 4, 7).reshape(n_rows, n_blocks * 256)


# --- the kernel (sm_90) -------------------------------------------------------------------------------

try:  # Gluon ships inside Triton (3.6 and later); without it the setting falls back to the tl kernel
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
except ImportError:  # no Triton, or one without Gluon
    gluon = None

WARPS = 4  # one warpgroup: wgmma's unit
BF16_ONE, BF16_MINUS_128 = 0x3F803F80, 0xC300C300  # bf16x2 (1, 1) and (-128, -128)


def _decode_asm() -> str:
    """PTX for one thread's words of rows r and r + 8 ($16, $17) -> 16 bf16 ($0-$15: row r then r + 8;
    group 2p then 2p + 1; values k, k + 1, k + 8, k + 9), with each row's and group's bf16x2 scale and
    shift ($18-$21: row r, group 2p scale, shift, group 2p + 1 scale, shift; $22-$25 row r + 8): per pair
    lop3 to the 0x43 magic (128 + code), one exact fma subtracting 128, one rounding fma (as qmatmul's
    `_bf16_fma_asm` with offset 0)."""
    lines = [
        "{ .reg .b32 s, p, one, off;",
        f"mov.b32 one, 0x{BF16_ONE:08X}; mov.b32 off, 0x{BF16_MINUS_128:08X};",
    ]
    for row in range(2):
        for g in range(2):
            for h in range(2):
                shift = 8 * h + 4 * g
                out = 8 * row + 4 * g + 2 * h
                scale = 18 + 4 * row + 2 * g
                src = f"${16 + row}"
                if shift:
                    lines.append(f"shr.b32 s, {src}, {shift};")
                    src = "s"
                lines += [
                    f"lop3.b32 p, {src}, 0x000F000F, 0x43004300, 0xEA;",  # 0xEA: (a & b) | c
                    "fma.rn.bf16x2 p, p, one, off;",
                    f"fma.rn.bf16x2 p, p, ${scale}, ${scale + 1};",
                    f"mov.b32 {{${out}, ${out + 1}}}, p;",
                ]
    return "\n".join([*lines, "}"])


DECODE_ASM = _decode_asm()
DECODE_CONSTRAINTS = ",".join(["=h"] * 16 + ["r"] * 10)

if gluon is not None:
    _DECODE_ASM, _DECODE_CONSTRAINTS = (
        gl.constexpr(DECODE_ASM),
        gl.constexpr(DECODE_CONSTRAINTS),
    )  # for the jit
    _barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier  # 3.9 / 3.6 name

    @gluon.constexpr_function
    def _words_layout(BN):
        """(BN / 2, 4, 2) int32 [n', c, j]: the words of rows n = n' + (n' & ~7) (row r of the fragment;
        r + 8 is the other half), quad lane c, word j: the wgmma A fragment's lanes and warps, registers j
        (then the second 64-row tile)."""
        regs = [[0, 0, 1]] + ([[32, 0, 0]] if BN == 128 else [])
        lanes = [[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
        return gl.DistributedLinearLayout(regs, lanes, [[8, 0, 0], [16, 0, 0]], [], [BN // 2, 4, 2])

    @gluon.constexpr_function
    def _rows_layout(BN):
        """(BN / 2, 2) [n', m8]: row n' + (n' & ~7) + 8 m8, one a thread (two for BN = 64), each warp the
        rows its fragment holds: a conversion to `_pairs_layout` stays inside the warp (Triton lowers it
        through shared memory at BN = 128, with shuffles at BN = 64)."""
        lanes = [[1, 0], [2, 0], [4, 0], [0, 1], [32, 0] if BN == 128 else [0, 0]]
        return gl.DistributedLinearLayout([], lanes, [[8, 0], [16, 0]], [], [BN // 2, 2])

    @gluon.constexpr_function
    def _pairs_layout(BN):
        """(BN / 2, 2, 2, 2) [n', m8, kind, group] (kind: scale, shift; group: 2p, 2p + 1) as the fragment
        holds rows: the values a row needs in registers (each split by gl.split in turn), the quad's lanes
        replicated."""
        regs = [[0, 0, 0, 1], [0, 0, 1, 0], [0, 1, 0, 0]] + ([[32, 0, 0, 0]] if BN == 128 else [])
        lanes = [[0, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]]
        return gl.DistributedLinearLayout(regs, lanes, [[8, 0, 0, 0], [16, 0, 0, 0]], [], [BN // 2, 2, 2, 2])

    @gluon.constexpr_function
    def _mma_layout(BM):
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BM, 16])

    @gluon.constexpr_function
    def _a_layout(BM):
        return gl.DotOperandLayout(operand_index=0, parent=_mma_layout(BM), k_width=2)

    @gluon.constexpr_function
    def _x_layout(BM):
        """(32, BM) bf16 x tile, k fastest: 8 values (16 bytes) a thread."""
        return gl.BlockedLayout([8, 1], [4, 8], [1, WARPS], [0, 1])

    @gluon.constexpr_function
    def _x_shared(BM):
        return gl.NVMMASharedLayout.get_default_for([32, BM], gl.bfloat16, transposed=True)

    @gluon.jit
    def _f16(bits):
        """The fp16 whose bit pattern is the low 16 bits of int32 `bits`, as fp32 (qmatmul._f16)."""
        return (bits & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)

    @gluon.jit
    def _bf16_pair(v):
        """bf16x2 (v, v) of fp32 v, rounded to nearest even (as v.to(bf16)), one cvt."""
        return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $1, $1;", "=r,f", [v], gl.int32, True, 1)

    @gluon.jit
    def _to_words(v, BN: gl.constexpr):
        """A (BN / 2,) row value as (BN / 2, 1, 1) in the words' layout (the decode's asm broadcasts it)."""
        rows: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, _words_layout(BN)))
        return gl.convert_layout(v, rows, assert_trivial=True)[:, None, None]

    @gluon.jit
    def _scale_shift(d, neg_dmin, w1, w2, w3, g: gl.constexpr):
        """Group g's bf16x2 scale and shift, a row a thread: bf16(d * sc), bf16(-(dmin * mn)), as
        qmatmul._k_scale_min and _group_scales compute them."""
        if g < 4:
            sc = (w1 >> (8 * g)) & 63
            mn = (w2 >> (8 * g)) & 63
        else:
            packed = w3 >> (8 * (g - 4))
            sc = (packed & 15) | (((w1 >> (8 * (g - 4) + 6)) & 3) << 4)
            mn = ((packed >> 4) & 15) | (((w2 >> (8 * (g - 4) + 6)) & 3) << 4)
        return gl.join(_bf16_pair(d * sc.to(gl.float32)), _bf16_pair(neg_dmin * mn.to(gl.float32)))

    @gluon.jit
    def _pair_scales(d, neg_dmin, w1, w2, w3, p: gl.constexpr, BN: gl.constexpr):
        """Group pair p's scales and shifts of rows r and r + 8 in the words' layout: computed a row a
        thread, moved to the fragment's rows in one conversion, split into (group 2p: scale_r, shift_r,
        scale_r8, shift_r8; then group 2p + 1's)."""
        both = gl.join(
            _scale_shift(d, neg_dmin, w1, w2, w3, 2 * p), _scale_shift(d, neg_dmin, w1, w2, w3, 2 * p + 1)
        )
        even, odd = gl.split(gl.convert_layout(both, _pairs_layout(BN)))
        e_scale, e_shift = gl.split(even)
        o_scale, o_shift = gl.split(odd)
        e_scale_r, e_scale_r8 = gl.split(e_scale)
        e_shift_r, e_shift_r8 = gl.split(e_shift)
        o_scale_r, o_scale_r8 = gl.split(o_scale)
        o_shift_r, o_shift_r8 = gl.split(o_shift)
        return (
            _to_words(e_scale_r, BN), _to_words(e_shift_r, BN), _to_words(o_scale_r, BN),
            _to_words(o_shift_r, BN), _to_words(e_scale_r8, BN), _to_words(e_shift_r8, BN),
            _to_words(o_scale_r8, BN), _to_words(o_shift_r8, BN),
        )  # fmt: skip

    @gluon.jit
    def _weights(r_vals, r8_vals, BN: gl.constexpr, BM: gl.constexpr):
        """(BN, 32) bf16 in the wgmma A layout from the decoded values of rows r and r + 8, 4 each
        (k, k + 1, k + 8, k + 9; (BN / 2, 4, 2) [n', c, j]): joined and reshaped so that the layout follows
        (a register basis per join: k + 1, then r + 8, then k + 8), checked trivial."""
        lo = gl.join(gl.join(r_vals[0], r_vals[1]), gl.join(r8_vals[0], r8_vals[1]))  # [.., t, m8]
        hi = gl.join(gl.join(r_vals[2], r_vals[3]), gl.join(r8_vals[2], r8_vals[3]))
        w = gl.join(lo, hi)  # (BN / 2, 4, 2, 2, 2, 2) [n', c, j, t, m8, h]
        w = gl.reshape(w, [BN // 16, 8, 4, 2, 2, 2, 2])  # [n' // 8, n' % 8, c, j, t, m8, h]
        w = gl.permute(w, [0, 5, 1, 3, 6, 2, 4])  # row 16 (n' // 8) + 8 m8 + n' % 8, k = 16j + 8h + 2c + t
        return gl.convert_layout(gl.reshape(w, [BN, 32]), _a_layout(BM), assert_trivial=True)

    @gluon.jit(do_not_specialize=["M", "N", "n_units", "units_per_split", "n_splits"])
    def _q4k_bf16_kernel(
        y_ptr, part_ptr, x_ptr, q_ptr, hdr_ptr, M, N, K, n_units, units_per_split, n_splits,
        BN: gl.constexpr, BM: gl.constexpr, ASYNC: gl.constexpr,
    ):  # fmt: skip
        """M <= BM rows of bf16 x (M, K): program (i, s) adds split s of rows [i * BN, i * BN + BN) for all
        M, unit after unit (256 values: 4 group pairs), as qmatmul._matmul_kernel with BF16. ASYNC: each
        pair's wgmmas run while the next pair decodes (more registers: 160 against 116 at b32)."""
        split = gl.program_id(1)
        first = split * units_per_split
        last = gl.minimum(first + units_per_split, n_units)
        base = gl.program_id(0) * BN

        wl: gl.constexpr = _words_layout(BN)
        n_ = gl.arange(0, BN // 2, gl.SliceLayout(1, gl.SliceLayout(2, wl)))[:, None, None]
        c_ = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(2, wl)))[None, :, None]
        j_ = gl.arange(0, 2, gl.SliceLayout(0, gl.SliceLayout(1, wl)))[None, None, :]
        row_r = base + n_ + (n_ & ~7)  # (BN / 2, 1, 1): the fragment's row r; r + 8 is row_r + 8
        # rows past N: not loaded (no `other`: their registers are left as they are) and not stored
        ok_r, ok_r8 = row_r < N, row_r + 8 < N
        # int32 words of chunk 2p + c // 2 of unit u: ((u * 8 + chunk) * N + row) * 4 + 2 (c % 2) + j
        word_at = (c_ // 2) * N * 4 + (c_ % 2) * 2 + j_  # (1, 4, 2)

        rl: gl.constexpr = _rows_layout(BN)
        hn = gl.arange(0, BN // 2, gl.SliceLayout(1, rl))[:, None]
        hm = gl.arange(0, 2, gl.SliceLayout(0, rl))[None, :]
        hrow = base + hn + (hn & ~7) + 8 * hm  # (BN / 2, 2)
        hok = hrow < N

        xl: gl.constexpr = _x_layout(BM)
        xk = gl.arange(0, 32, gl.SliceLayout(1, xl))[:, None]
        xm = gl.arange(0, BM, gl.SliceLayout(0, xl))[None, :]
        x_ok = xm < M
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [8, 32, BM], _x_shared(BM))

        acc = gl.zeros([BN, BM], gl.float32, _mma_layout(BM))
        for unit in range(first, last):
            _barrier()  # the previous unit's wgmmas have read x_smem
            for g in gl.static_range(8):
                xt = gl.load(x_ptr + xm * K + unit * 256 + 32 * g + xk, mask=x_ok, other=0.0)
                x_smem.index(g).store(xt)
            fence_async_shared()
            _barrier()

            hdr = hdr_ptr + (unit.to(gl.int64) * N + hrow) * 4  # one 16-byte header a row a unit
            w0 = gl.load(hdr, mask=hok)
            w1 = gl.load(hdr + 1, mask=hok)
            w2 = gl.load(hdr + 2, mask=hok)
            w3 = gl.load(hdr + 3, mask=hok)
            d = _f16(w0)
            neg_dmin = -_f16(w0 >> 16)

            for p in gl.static_range(4):
                words = q_ptr + ((unit.to(gl.int64) * 8 + 2 * p) * N + row_r) * 4 + word_at
                w_r = gl.load(words, mask=ok_r)
                w_r8 = gl.load(words + 32, mask=ok_r8)  # row r + 8: 8 rows of 4 words on
                s = _pair_scales(d, neg_dmin, w1, w2, w3, p, BN)
                v = gl.inline_asm_elementwise(
                    _DECODE_ASM, _DECODE_CONSTRAINTS,
                    [w_r, w_r8, s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]], [gl.bfloat16] * 16, True, 1,
                )  # fmt: skip
                a_even = _weights(v[0:4], v[8:12], BN, BM)
                a_odd = _weights(v[4:8], v[12:16], BN, BM)
                if ASYNC:  # pair p's decode above ran while pair p - 1's wgmmas were in flight; their A
                    # registers stay live (the wait's deps) until the wait that retires them
                    acc = warpgroup_mma(a_even, x_smem.index(2 * p), acc, is_async=True)
                    acc = warpgroup_mma(a_odd, x_smem.index(2 * p + 1), acc, is_async=True)
                    if p > 0:  # prev_*: set by the unrolled iteration p - 1
                        acc, prev_even, prev_odd = warpgroup_mma_wait(2, deps=[acc, prev_even, prev_odd])  # noqa: F821
                    prev_even, prev_odd = a_even, a_odd
                else:
                    acc = warpgroup_mma(a_even, x_smem.index(2 * p), acc)
                    acc = warpgroup_mma(a_odd, x_smem.index(2 * p + 1), acc)
            if ASYNC:  # x_smem is rewritten next unit
                acc, prev_even, prev_odd = warpgroup_mma_wait(0, deps=[acc, prev_even, prev_odd])

        ml: gl.constexpr = _mma_layout(BM)
        rows = base + gl.arange(0, BN, gl.SliceLayout(1, ml))[:, None]
        ms = gl.arange(0, BM, gl.SliceLayout(0, ml))[None, :]
        at, ok = ms * N + rows, (rows < N) & (ms < M)
        if n_splits == 1:
            gl.store(y_ptr + at, acc.to(y_ptr.dtype.element_ty), mask=ok)
        else:
            gl.store(part_ptr + split * (M * N) + at, acc, mask=ok)


# --- launcher -----------------------------------------------------------------------------------------

MAX_M = 32  # the verify's tile (b32) and below
ASYNC_MMA = True  # the kernel's ASYNC (tests/gpu/test_gluon_qmm_gpu.py times both)


def supports(x: torch.Tensor, qtype: int, n_cols: int) -> bool:
    """Whether the Gluon kernel computes this product: bf16 arithmetic's Q4_K, x (M <= 32, n_cols) on an
    sm_90 GPU (wgmma), with Gluon importable."""
    return (
        gluon is not None and x.is_cuda and int(qtype) == QT.Q4_K and 1 <= x.shape[0] <= MAX_M
        and n_cols % 256 == 0 and torch.cuda.get_device_capability(x.device)[0] == 9
    )  # fmt: skip


def launch_args(
    x: torch.Tensor,
    fields: list[torch.Tensor],
    n_rows: int,
    n_cols: int,
    kernels,
    async_mma: bool = ASYNC_MMA,
) -> tuple:
    """(grid, args, kwargs, y, parts, n_splits) of the kernel's launch for x (M, n_cols) bf16 and fragment
    fields: the tile's rows and the K-splits those of qmatmul.quant_matmul's bf16 product."""
    m = x.shape[0]
    bm = max(16, 1 << (m - 1).bit_length())
    rows = qmatmul.tile_for(m, "bf16", QT.Q4_K, kernels).rows
    bn = rows if rows in (64, 128) else 128
    n_units = n_cols // 256
    target = (
        kernels.splits.get(qmatmul.split_key("bf16", QT.Q4_K, n_rows, n_cols)) if kernels.splits else None
    )
    n_splits, per_split = qmatmul.k_splits(n_rows, n_units, target)
    y = torch.empty(m, n_rows, dtype=x.dtype, device=x.device)
    parts = y if n_splits == 1 else torch.empty(n_splits, m, n_rows, dtype=torch.float32, device=x.device)
    grid = (-(-n_rows // bn), n_splits)
    args = (y, parts, x, *fields, m, n_rows, n_cols, n_units, per_split, n_splits)
    kwargs = {"BN": bn, "BM": bm, "ASYNC": async_mma, "num_warps": WARPS, "enable_fp_fusion": False}
    return grid, args, kwargs, y, parts, n_splits


def matmul(
    x: torch.Tensor, fields: list[torch.Tensor], n_rows: int, n_cols: int, kernels=qmatmul.DEFAULT_KERNELS,
    async_mma: bool = ASYNC_MMA,
) -> torch.Tensor:  # fmt: skip
    """x (M, n_cols) @ W^T for fragment-ordered Q4_K fields (`fragment_fields`) -> (M, n_rows) in x's dtype:
    qmatmul.quant_matmul(..., "bf16") bit for bit (see the module doc); `supports` says where it runs."""
    grid, args, kwargs, y, parts, n_splits = launch_args(
        x.to(torch.bfloat16).contiguous(), fields, n_rows, n_cols, kernels, async_mma
    )
    _q4k_bf16_kernel[grid](*args, **kwargs)
    if n_splits > 1:
        qmatmul.sum_splits(y, parts)
    return y
