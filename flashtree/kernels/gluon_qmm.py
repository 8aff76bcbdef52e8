"""The bf16 Q4_K and Q6_K matmul for sm_90 in Gluon (explicit layouts), opt-in: FLASHTREE_QMM_KERNEL=gluon
(issue #40).

Triton's `tl` kernel (qmatmul.py) spends ~1.3 of its 4.8 SASS instructions a weight moving the codes into
the wgmma A-operand layout (bench/results/cpu-sm90-qmm-sass-2026-12-07). Here the codes are loaded straight
into that layout and decoded in registers:

- Layout (`fragment_fields`, once at load; `unpack` inverts it): inside each row's 32-byte code run (Q4_K:
  a group pair, low nibbles group 2p, high 2p + 1; Q6_K: a ql run, the same with groups 4h + i and
  4h + 2 + i, and a qh run, the 2-bit highs of groups 4h..4h + 3 at bits 2r), byte k (value k of each of
  its groups) moves to byte 8c + 4j + 2t + h for k = 16j + 8h + 2c + t. Thread c of a quad (the fragment's
  k columns 2c, 2c + 1, 2c + 8, 2c + 9, + 16) then reads its row's 8 bytes of a run with one 8-byte load,
  and in each word k, k + 1 sit in bytes 0 and 2, k + 8, k + 9 in bytes 1 and 3. Q4_K: `(w >> s) &
  0x000F000F | 0x43004300`, s = 0, 8, 4, 12, is a bf16x2 magic pair in register order; Q6_K: one lop3
  first merges a group's nibbles and (shifted) qh bits into 6-bit codes, byte for byte (`_decode_asm`).
- Numerics: the same as the `tl` kernel's bf16 path, op for op: Q4_K scale = bf16(d * sc), shift =
  bf16(-dmin * mn); Q6_K scale = bf16(d * int8 scale) per 16 values, shift +0; per weight fma(fma(128 +
  code, 1, -(128 + offset)), scale, shift) in bf16x2 (offset 0, Q6_K 32), one wgmma m64nBMk16 pair per
  32-value group into the fp32 accumulator in k order (A from registers, B = x from shared memory), the
  same K-splits and the same split sums (qmatmul.sum_splits). So its outputs equal the `tl` kernel's bit
  for bit (tests/gpu/test_gluon_qmm_gpu.py checks that on the device) and are batch-invariant alike.
"""

from __future__ import annotations

import torch

from flashtree.kernels import qmatmul
from flashtree.quant.formats import QT

# --- layout (torch, any device) -----------------------------------------------------------------------

RUN = 32  # bytes of one row's run: 32 values' codes of two groups (Q4_K, Q6_K's ql) or four (Q6_K's qh)
CODE_FIELDS = {QT.Q4_K: 1, QT.Q6_K: 2}  # qmatmul.repack's first fields hold the codes: q (Q4_K); q, qh


def _fragment_positions() -> torch.Tensor:
    """New byte position of run byte k (value k of each of the run's groups)."""
    k = torch.arange(RUN)
    j, h, c, t = k // 16, k // 8 % 2, k // 2 % 4, k % 2
    return 8 * c + 4 * j + 2 * t + h


POSITIONS = _fragment_positions()
ORDER = torch.argsort(POSITIONS)  # new byte p holds old byte ORDER[p]


def _permute_runs(q: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """q (n_blocks, chunks, n_rows, 4) int32 (a qmatmul.repack code field: run i is chunks 2i, 2i + 1)
    with every run's bytes reordered: new byte b = old byte index[b]."""
    n_blocks, chunks, n_rows, _ = q.shape
    runs = q.view(torch.uint8).view(n_blocks, chunks // 2, 2, n_rows, 16).permute(0, 1, 3, 2, 4)
    runs = runs.reshape(n_blocks, chunks // 2, n_rows, RUN)[..., index.to(q.device)]
    out = runs.view(n_blocks, chunks // 2, n_rows, 2, 16).permute(0, 1, 3, 2, 4).contiguous()
    return out.view(n_blocks, chunks, n_rows, 16).view(torch.int32).view(q.shape)


def _reorder(fields: list[torch.Tensor], qtype: int, index: torch.Tensor) -> list[torch.Tensor]:
    n = CODE_FIELDS[QT(qtype)]
    return [_permute_runs(f, index) for f in fields[:n]] + fields[n:]


def fragment_fields(fields: list[torch.Tensor], qtype: int) -> list[torch.Tensor]:
    """qmatmul.repack's Q4_K or Q6_K fields with the code fields' runs in fragment order (the module doc);
    the header (and Q6_K's d) shared."""
    return _reorder(fields, qtype, ORDER)


def standard_fields(fields: list[torch.Tensor], qtype: int) -> list[torch.Tensor]:
    """Inverse of `fragment_fields`."""
    return _reorder(fields, qtype, POSITIONS)


def unpack(fields: list[torch.Tensor], qtype: int, n_cols: int, rows: slice = slice(None)) -> torch.Tensor:
    """The GGUF rows (n_rows, row_bytes) uint8 of fragment-ordered fields, bit for bit."""
    return qmatmul.unpack(standard_fields(fields, qtype), qtype, n_cols, rows)


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
BF16_ONE = 0x3F803F80  # bf16x2 (1, 1)
MINUS = {QT.Q4_K: 0xC300C300, QT.Q6_K: 0xC320C320}  # bf16x2 -(128 + offset): -128, -160 (Q6_K's 32)


def _pair_lines(src: str, mask: int, out: int, scale: str, shift: str) -> list[str]:
    """One bf16x2 pair ($out, $out + 1) from the code bits `src & mask` (halves' bits 0-5): lop3 to the 0x43
    magic (128 + code), one exact fma subtracting 128 + offset, one rounding fma with scale and shift (as
    qmatmul's `_bf16_fma_asm`)."""
    return [
        f"lop3.b32 p, {src}, 0x{mask:08X}, 0x43004300, 0xEA;",  # 0xEA: (a & b) | c
        "fma.rn.bf16x2 p, p, one, off;",
        f"fma.rn.bf16x2 p, p, {scale}, {shift};",
        f"mov.b32 {{${out}, ${out + 1}}}, p;",
    ]


def _decode_asm(qtype: int, high: bool = False) -> str:
    """PTX for one thread's words of rows r and r + 8 -> 16 bf16 ($0-$15: row r then r + 8; group 2p then
    2p + 1; values k, k + 1, k + 8, k + 9), group after group, then `}`.

    Q4_K: words $16, $17 (rows r, r + 8); $18-$21 row r's bf16x2 scale, shift of group 2p, then 2p + 1;
    $22-$25 row r + 8's. `(w >> s) & 0x000F000F` (s = 0, 8: group 2p; 4, 12: 2p + 1) is a pair's codes.
    Q6_K (half `high`: groups 2p, 2p + 1 are the ql runs' high nibbles, qh bits 4-7): $16-$18 row r's ql
    words of runs 2h, 2h + 1 (group 2p, 2p + 1) and its qh word, $19-$21 row r + 8's; $22-$25 the scales
    (row r group 2p, 2p + 1, then row r + 8's); shift +0 (the `tl` kernel's zeros). Per group one lop3
    puts the two qh bits of value i above its nibble in byte i (t), then t and t >> 8 are the pairs."""
    regs = "s, p, one, off" if qtype == QT.Q4_K else "s, p, t, one, off, zero"
    lines = [
        f"{{ .reg .b32 {regs};",
        f"mov.b32 one, 0x{BF16_ONE:08X}; mov.b32 off, 0x{MINUS[QT(qtype)]:08X};",
    ]
    if qtype == QT.Q6_K:
        lines.append("mov.b32 zero, 0;")
    for row in range(2):
        for g in range(2):
            out = 8 * row + 4 * g
            if qtype == QT.Q4_K:
                scale = 18 + 4 * row + 2 * g
                for h in range(2):
                    shift, src = 8 * h + 4 * g, f"${16 + row}"
                    if shift:
                        lines.append(f"shr.b32 s, {src}, {shift};")
                        src = "s"
                    lines += _pair_lines(src, 0x000F000F, out + 2 * h, f"${scale}", f"${scale + 1}")
                continue
            ql, qh, scale = f"${16 + 3 * row + g}", f"${18 + 3 * row}", f"${22 + 2 * row + g}"
            if high:  # the high nibbles down to bits 0-3
                lines.append(f"shr.b32 s, {ql}, 4;")
                ql = "s"
            shift = 2 * (2 * high + g) - 4  # qh's 2-bit field of this group (bits 2r) to bits 4-5
            if shift:
                lines.append(f"{'shr' if shift > 0 else 'shl'}.b32 t, {qh}, {abs(shift)};")
                qh = "t"
            lines.append(f"lop3.b32 t, {ql}, {qh}, 0x30303030, 0xD8;")  # 0xD8: (a & ~c) | (b & c)
            lines += _pair_lines("t", 0x003F003F, out, scale, "zero")
            lines.append("shr.b32 s, t, 8;")
            lines += _pair_lines("s", 0x003F003F, out + 2, scale, "zero")
    return "\n".join([*lines, "}"])


DECODE_ASM = {
    (QT.Q4_K, False): _decode_asm(QT.Q4_K),
    (QT.Q6_K, False): _decode_asm(QT.Q6_K, False),
    (QT.Q6_K, True): _decode_asm(QT.Q6_K, True),
}
DECODE_CONSTRAINTS = ",".join(["=h"] * 16 + ["r"] * 10)  # both types: 16 bf16 out, 10 words in

if gluon is not None:
    _Q4K_ASM, _Q6K_LOW_ASM, _Q6K_HIGH_ASM = (gl.constexpr(a) for a in DECODE_ASM.values())  # for the jit
    _DECODE_CONSTRAINTS = gl.constexpr(DECODE_CONSTRAINTS)
    _Q4_K, _Q6_K = gl.constexpr(int(QT.Q4_K)), gl.constexpr(int(QT.Q6_K))
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
    def _to_rows(v, BN: gl.constexpr):
        """A (BN / 2,) row value in the words' row layout (expanded, the decode's asm broadcasts it)."""
        rows: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, _words_layout(BN)))
        return gl.convert_layout(v, rows, assert_trivial=True)

    @gluon.jit
    def _signed_byte(word, i: gl.constexpr):
        return (word << (24 - 8 * i)) >> 24

    @gluon.jit
    def _group_scales(QTYPE: gl.constexpr, d, neg_dmin, w0, w1, w2, w3, g: gl.constexpr):
        """Group g's two bf16x2 values, a row a thread, joined: Q4_K its scale and shift, bf16(d * sc) and
        bf16(-(dmin * mn)) (qmatmul._k_scale_min, _group_scales); Q6_K the scales of its two 16-value
        halves, bf16(d * int8 scale) (bytes 2g, 2g + 1 of the 16: word g // 2)."""
        if QTYPE == _Q6_K:
            if g // 2 == 0:
                word = w0
            elif g // 2 == 1:
                word = w1
            elif g // 2 == 2:
                word = w2
            else:
                word = w3
            first = d * _signed_byte(word, 2 * (g % 2)).to(gl.float32)
            second = d * _signed_byte(word, 2 * (g % 2) + 1).to(gl.float32)
        else:
            if g < 4:
                sc = (w1 >> (8 * g)) & 63
                mn = (w2 >> (8 * g)) & 63
            else:
                packed = w3 >> (8 * (g - 4))
                sc = (packed & 15) | (((w1 >> (8 * (g - 4) + 6)) & 3) << 4)
                mn = ((packed >> 4) & 15) | (((w2 >> (8 * (g - 4) + 6)) & 3) << 4)
            first = d * sc.to(gl.float32)
            second = neg_dmin * mn.to(gl.float32)
        return gl.join(_bf16_pair(first), _bf16_pair(second))

    @gluon.jit
    def _pair_scales(QTYPE: gl.constexpr, d, neg_dmin, w0, w1, w2, w3, p: gl.constexpr, BN: gl.constexpr):
        """Group pair p's values (`_group_scales`) of rows r and r + 8 in the words' row layout: computed a
        row a thread, moved to the fragment's rows in one conversion, split into (group 2p: first_r,
        second_r, then group 2p + 1's; then row r + 8's)."""
        both = gl.join(
            _group_scales(QTYPE, d, neg_dmin, w0, w1, w2, w3, 2 * p),
            _group_scales(QTYPE, d, neg_dmin, w0, w1, w2, w3, 2 * p + 1),
        )
        even, odd = gl.split(gl.convert_layout(both, _pairs_layout(BN)))
        e_first, e_second = gl.split(even)
        o_first, o_second = gl.split(odd)
        e_first_r, e_first_r8 = gl.split(e_first)
        e_second_r, e_second_r8 = gl.split(e_second)
        o_first_r, o_first_r8 = gl.split(o_first)
        o_second_r, o_second_r8 = gl.split(o_second)
        return (
            _to_rows(e_first_r, BN), _to_rows(e_second_r, BN), _to_rows(o_first_r, BN),
            _to_rows(o_second_r, BN), _to_rows(e_first_r8, BN), _to_rows(e_second_r8, BN),
            _to_rows(o_first_r8, BN), _to_rows(o_second_r8, BN),
        )  # fmt: skip

    @gluon.jit
    def _run_words(ptr, CHUNKS: gl.constexpr, unit, run: gl.constexpr, N, row_r, word_at, ok_r, ok_r8):
        """Rows r and r + 8's words of run `run` (chunks 2 run, 2 run + 1) of a code field with CHUNKS
        16-byte chunks a unit, in the words' layout: one 8-byte load a row."""
        words = ptr + ((unit.to(gl.int64) * CHUNKS + 2 * run) * N + row_r) * 4 + word_at
        return gl.load(words, mask=ok_r), gl.load(words + 32, mask=ok_r8)  # row r + 8: 8 rows of 4 words on

    @gluon.jit
    def _halves(word, BN: gl.constexpr):
        """Words (BN / 2, 4, 2) [n', c, j] as their j = 0 and j = 1 halves, (BN / 2, 4) each."""
        lo, hi = gl.split(word)
        halves: gl.constexpr = gl.SliceLayout(2, _words_layout(BN))
        lo = gl.convert_layout(lo, halves, assert_trivial=True)
        return lo, gl.convert_layout(hi, halves, assert_trivial=True)

    @gluon.jit
    def _join4(a, b, i: gl.constexpr):
        """Outputs i to i + 3 of the asm's j = 0 (a) and j = 1 (b) calls, each joined to (BN / 2, 4, 2)."""
        return (
            gl.join(a[i], b[i]), gl.join(a[i + 1], b[i + 1]), gl.join(a[i + 2], b[i + 2]),
            gl.join(a[i + 3], b[i + 3]),
        )  # fmt: skip

    @gluon.jit
    def _q6k_asm(qa_r, qb_r, qh_r, qa_r8, qb_r8, qh_r8, e_r, o_r, e_r8, o_r8, HIGH: gl.constexpr):
        """The Q6_K decode asm (`_decode_asm`) on one word j of each, with its half's scales."""
        args = [qa_r, qb_r, qh_r, qa_r8, qb_r8, qh_r8, e_r[:, None], o_r[:, None], e_r8[:, None],
                o_r8[:, None]]  # fmt: skip
        if HIGH:
            v = gl.inline_asm_elementwise(
                _Q6K_HIGH_ASM, _DECODE_CONSTRAINTS, args, [gl.bfloat16] * 16, True, 1
            )
        else:
            v = gl.inline_asm_elementwise(
                _Q6K_LOW_ASM, _DECODE_CONSTRAINTS, args, [gl.bfloat16] * 16, True, 1
            )
        return v

    @gluon.jit
    def _q6k_weights(ql_a, ql_b, qh, s, HIGH: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr):
        """Q6_K group pair p's A operands (group 2p, 2p + 1) from its half's words (ql runs 2h, 2h + 1 and
        qh run h, rows r and r + 8 each) and the pair's scales (`_pair_scales`): the asm once a word j, as
        the k < 16 and k >= 16 halves take the first and the second half scale."""
        qa_r0, qa_r1 = _halves(ql_a[0], BN)
        qb_r0, qb_r1 = _halves(ql_b[0], BN)
        qh_r0, qh_r1 = _halves(qh[0], BN)
        qa_r80, qa_r81 = _halves(ql_a[1], BN)
        qb_r80, qb_r81 = _halves(ql_b[1], BN)
        qh_r80, qh_r81 = _halves(qh[1], BN)
        v0 = _q6k_asm(qa_r0, qb_r0, qh_r0, qa_r80, qb_r80, qh_r80, s[0], s[2], s[4], s[6], HIGH)
        v1 = _q6k_asm(qa_r1, qb_r1, qh_r1, qa_r81, qb_r81, qh_r81, s[1], s[3], s[5], s[7], HIGH)
        a_even = _weights(_join4(v0, v1, 0), _join4(v0, v1, 8), BN, BM)
        a_odd = _weights(_join4(v0, v1, 4), _join4(v0, v1, 12), BN, BM)
        return a_even, a_odd

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
    def _bf16_kernel(
        y_ptr, part_ptr, x_ptr, q_ptr, qh_ptr, hdr_ptr, d_ptr, M, N, K, n_units, units_per_split, n_splits,
        QTYPE: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, ASYNC: gl.constexpr,
    ):  # fmt: skip
        """M <= BM rows of bf16 x (M, K) times a Q4_K or Q6_K matrix (QTYPE; Q4_K: qh_ptr and d_ptr unused):
        program (i, s) adds split s of rows [i * BN, i * BN + BN) for all M, unit after unit (256 values: 4
        group pairs), as qmatmul._matmul_kernel with BF16. ASYNC: each pair's wgmmas run while the next
        pair decodes (more registers: Q4_K 160 against 116 at b32)."""
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
        # words of run i's chunk 2i + c // 2 of unit u: ((u * chunks + chunk) * N + row) * 4 + 2 (c % 2) + j
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
            if QTYPE == _Q6_K:  # the header is the 16 int8 scales; d its own fp16 field
                d = gl.load(d_ptr + unit.to(gl.int64) * N + hrow, mask=hok).to(gl.float32)
                neg_dmin = d  # unused
            else:
                d = _f16(w0)
                neg_dmin = -_f16(w0 >> 16)

            for p in gl.static_range(4):
                # (the order of the loads and the scales: each type's fewest instructions and registers)
                if QTYPE == _Q6_K:  # pairs 2h, 2h + 1 (low, then high nibbles) read half h's runs
                    s = _pair_scales(QTYPE, d, neg_dmin, w0, w1, w2, w3, p, BN)
                    if p % 2 == 0:
                        ql_a = _run_words(q_ptr, 8, unit, p, N, row_r, word_at, ok_r, ok_r8)
                        ql_b = _run_words(q_ptr, 8, unit, p + 1, N, row_r, word_at, ok_r, ok_r8)
                        qh = _run_words(qh_ptr, 4, unit, p // 2, N, row_r, word_at, ok_r, ok_r8)
                    a_even, a_odd = _q6k_weights(ql_a, ql_b, qh, s, p % 2 == 1, BN, BM)  # noqa: F821
                else:
                    w_r, w_r8 = _run_words(q_ptr, 8, unit, p, N, row_r, word_at, ok_r, ok_r8)
                    s = _pair_scales(QTYPE, d, neg_dmin, w0, w1, w2, w3, p, BN)
                    v = gl.inline_asm_elementwise(
                        _Q4K_ASM, _DECODE_CONSTRAINTS,
                        [w_r, w_r8, s[0][:, None, None], s[1][:, None, None], s[2][:, None, None],
                         s[3][:, None, None], s[4][:, None, None], s[5][:, None, None], s[6][:, None, None],
                         s[7][:, None, None]], [gl.bfloat16] * 16, True, 1,
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
    """Whether the Gluon kernel computes this product: bf16 arithmetic's Q4_K or Q6_K, x (M <= 32, n_cols)
    on an sm_90 GPU (wgmma), with Gluon importable."""
    return (
        gluon is not None and x.is_cuda and int(qtype) in CODE_FIELDS and 1 <= x.shape[0] <= MAX_M
        and n_cols % 256 == 0 and torch.cuda.get_device_capability(x.device)[0] == 9
    )  # fmt: skip


def launch_args(
    x: torch.Tensor,
    fields: list[torch.Tensor],
    qtype: int,
    n_rows: int,
    n_cols: int,
    kernels,
    async_mma: bool = ASYNC_MMA,
) -> tuple:
    """(grid, args, kwargs, y, parts, n_splits) of the kernel's launch for x (M, n_cols) bf16 and fragment
    fields: the tile's rows and the K-splits those of qmatmul.quant_matmul's bf16 product."""
    m = x.shape[0]
    bm = max(16, 1 << (m - 1).bit_length())
    rows = qmatmul.tile_for(m, "bf16", qtype, kernels).rows
    bn = rows if rows in (64, 128) else 128
    n_units = n_cols // 256
    target = kernels.splits.get(qmatmul.split_key("bf16", qtype, n_rows, n_cols)) if kernels.splits else None
    n_splits, per_split = qmatmul.k_splits(n_rows, n_units, target)
    y = torch.empty(m, n_rows, dtype=x.dtype, device=x.device)
    parts = y if n_splits == 1 else torch.empty(n_splits, m, n_rows, dtype=torch.float32, device=x.device)
    grid = (-(-n_rows // bn), n_splits)
    q, qh, hdr, d = fields if int(qtype) == QT.Q6_K else (fields[0], fields[0], fields[1], fields[1])
    args = (y, parts, x, q, qh, hdr, d, m, n_rows, n_cols, n_units, per_split, n_splits)
    kwargs = {"QTYPE": int(qtype), "BN": bn, "BM": bm, "ASYNC": async_mma, "num_warps": WARPS}
    return grid, args, kwargs | {"enable_fp_fusion": False}, y, parts, n_splits


def matmul(
    x: torch.Tensor, fields: list[torch.Tensor], qtype: int, n_rows: int, n_cols: int,
    kernels=qmatmul.DEFAULT_KERNELS, async_mma: bool = ASYNC_MMA,
) -> torch.Tensor:  # fmt: skip
    """x (M, n_cols) @ W^T for fragment-ordered Q4_K or Q6_K fields (`fragment_fields`) -> (M, n_rows) in
    x's dtype: qmatmul.quant_matmul(..., "bf16") bit for bit (see the module doc); `supports` says where
    it runs."""
    grid, args, kwargs, y, parts, n_splits = launch_args(
        x.to(torch.bfloat16).contiguous(), fields, qtype, n_rows, n_cols, kernels, async_mma
    )
    _bf16_kernel[grid](*args, **kwargs)
    if n_splits > 1:
        qmatmul.sum_splits(y, parts)
    return y
