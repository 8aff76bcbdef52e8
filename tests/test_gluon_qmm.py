"""The Gluon kernel's load-time layouts (kernels/gluon_qmm.py, Q4_K and Q6_K): lossless byte permutations
whose decoding by the kernel's own asm (its PTX run op by op here) gives exactly the GGUF codes, and the
kernel's compile for sm_90 on a CPU."""

import numpy as np
import pytest
import torch

from flashtree.kernels import gluon_qmm, qmatmul
from flashtree.quant.dequant import dequantize
from flashtree.quant.formats import QT, row_bytes
from flashtree.quant.pack import random_blocks

N, K = 24, 512  # two super-blocks a row
TYPES = [QT.Q4_K, QT.Q6_K]
OFFSET = {QT.Q4_K: 0, QT.Q6_K: 32}  # subtracted by the decode's first fma


@pytest.fixture(scope="module", params=TYPES, ids=lambda t: t.name)
def qtype(request):
    return request.param


@pytest.fixture(scope="module")
def raw(qtype):
    return torch.from_numpy(random_blocks(qtype, N, K, np.random.default_rng(3)))


def gguf_codes(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """The codes (rows, K) of GGUF rows. Q4_K: per group pair 32 bytes after 16 header bytes, low nibble
    value l, high nibble 32 + l. Q6_K: value 128h + 32r + l is ql byte 64h + 32 (r % 2) + l's nibble r // 2
    and qh byte 32h + l's bits 2r, 2r + 1 above it."""
    blocks = raw.view(N, -1, row_bytes(qtype, 256)).long()
    if qtype == QT.Q4_K:
        q = blocks[:, :, 16:].reshape(N, -1, 4, 32)
        return torch.stack([q & 15, q >> 4], dim=3).reshape(N, K)
    ql = blocks[:, :, :128].reshape(N, -1, 2, 1, 2, 32)  # (.., h, nibble, r % 2, l)
    qh = blocks[:, :, 128:192].reshape(N, -1, 2, 1, 1, 32)
    r = torch.arange(4).view(2, 2, 1)  # (nibble, r % 2)
    return ((ql >> (4 * (r // 2))) & 15 | ((qh >> (2 * r)) & 3) << 4).reshape(N, K)


def _bf16(bits: torch.Tensor) -> torch.Tensor:
    """16-bit patterns (int64) as float64 values."""
    signed = (bits << 16) - ((bits >> 15) & 1) * (1 << 32)
    return signed.to(torch.int32).view(torch.float32).double()


def _fma_bf16x2(a, b, c):
    """fma.rn.bf16x2: per half a * b + c rounded once to bf16 (float64 then float32 are exact for the
    operands here: small integers times 1)."""
    out = 0
    for half in (0, 16):
        x, y, z = (_bf16((v >> half) & 0xFFFF) for v in (a, b, c))
        value = (x * y + z).float().bfloat16().view(torch.int16).long() & 0xFFFF
        out = out | value << half
    return out


def _lop3(a, b, c, lut: int):
    """lop3.b32: bit i of the result is lut's bit (a_i << 2 | b_i << 1 | c_i)."""
    out = torch.zeros_like(a)
    for i in range(8):
        if lut >> i & 1:
            terms = [v if i >> s & 1 else ~v for v, s in ((a, 2), (b, 1), (c, 0))]
            out |= terms[0] & terms[1] & terms[2]
    return out & 0xFFFFFFFF


def run_ptx(asm: str, operands: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """The decode asm's instructions, one by one, on int64 tensors of 32-bit words ($i: operands[i]):
    the 16-bit outputs ($0-$15) as patterns."""
    regs = {f"${i}": v for i, v in operands.items()}
    outs = {}

    def val(a):
        return regs[a] if a in regs else torch.tensor(int(a, 0))

    body = asm.strip().removeprefix("{").removesuffix("}")
    for ins in filter(None, (i.strip() for i in body.split(";"))):
        op, rest = ins.split(None, 1)
        if op == ".reg":
            continue
        if rest.startswith("{"):  # mov.b32 {$lo, $hi}, p
            pair, src = rest[1:].split("}")
            lo, hi = (int(x.strip()[1:]) for x in pair.split(","))
            outs[lo], outs[hi] = val(src.strip(" ,")) & 0xFFFF, val(src.strip(" ,")) >> 16
            continue
        dst, *args = (a.strip() for a in rest.split(","))
        if op == "mov.b32":
            regs[dst] = val(args[0])
        elif op == "shr.b32":
            regs[dst] = val(args[0]) >> int(args[1])
        elif op == "shl.b32":
            regs[dst] = (val(args[0]) << int(args[1])) & 0xFFFFFFFF
        elif op == "lop3.b32":
            regs[dst] = _lop3(*(val(a) for a in args[:3]), int(args[3], 0))
        elif op == "fma.rn.bf16x2":
            regs[dst] = _fma_bf16x2(*(val(a) for a in args))
        else:
            raise AssertionError(f"unexpected instruction {ins!r}")
    return outs


def _thread_words(field: torch.Tensor, run: int) -> torch.Tensor:
    """Run `run`'s words as thread c of a quad loads them (chunk 2 run + c // 2, words 2 (c % 2) + j):
    (rows, n_blocks, c, j) int64."""
    words = field[:, 2 * run : 2 * run + 2].long() & 0xFFFFFFFF  # (n_blocks, 2, rows, 4)
    return words.view(-1, 2, N, 2, 2).permute(2, 0, 1, 3, 4).reshape(N, -1, 4, 2)


def kernel_codes(frag: list[torch.Tensor], qtype: int) -> torch.Tensor:
    """The codes (rows, K) that the kernel's decode asm makes of fragment-ordered fields, each group pair
    p's words fed as the kernel feeds them (rows r and r + 8 both given row r's words), bf16 scales 1 and
    shifts 0: output 4g + i of row r is value k = 16j + 2c + (0, 1, 8, 9)[i] of group 2p + g, minus OFFSET."""
    one = torch.tensor(gluon_qmm.BF16_ONE)
    codes = torch.empty(N, K // 256, 4, 2, 2, 2, 4, 2, dtype=torch.long)  # (row, blk, p, g, j, h, c, t)
    for p in range(4):
        if qtype == QT.Q4_K:
            w = _thread_words(frag[0], p)
            ops = {16: w, 17: w} | {i: one if i % 2 == 0 else torch.tensor(0) for i in range(18, 26)}
            asm = gluon_qmm.DECODE_ASM[(QT.Q4_K, False)]
        else:
            half = p // 2
            a, b = _thread_words(frag[0], 2 * half), _thread_words(frag[0], 2 * half + 1)
            h = _thread_words(frag[1], half)
            ops = {16: a, 17: b, 18: h, 19: a, 20: b, 21: h} | {i: one for i in range(22, 26)}
            asm = gluon_qmm.DECODE_ASM[(QT.Q6_K, p % 2 == 1)]
        out = run_ptx(asm, ops)
        for g in range(2):
            for i in range(4):
                codes[:, :, p, g, :, i // 2, :, i % 2] = _bf16(out[4 * g + i]).long().permute(0, 1, 3, 2)
                assert torch.equal(out[8 + 4 * g + i], out[4 * g + i])  # row r + 8: the same words
    # value 64p + 32g + 16j + 8h + 2c + t
    return codes.reshape(N, K) + OFFSET[qtype]


def test_fragment_layout_is_a_permutation_unpack_inverts(raw, qtype):
    fields = qmatmul.repack(raw, qtype, K)
    frag = gluon_qmm.fragment_fields(fields, qtype)
    n = gluon_qmm.CODE_FIELDS[qtype]
    assert all(f is g for f, g in zip(frag[n:], fields[n:], strict=True))  # header (and d) shared
    assert all(not torch.equal(f, g) for f, g in zip(frag[:n], fields[:n], strict=True))
    assert torch.equal(gluon_qmm.unpack(frag, qtype, K), raw)
    assert torch.equal(gluon_qmm.unpack(frag, qtype, K, slice(5, 9)), raw[5:9])
    assert sorted(gluon_qmm.POSITIONS.tolist()) == list(range(32))


def test_the_decode_asm_gives_the_gguf_codes(raw, qtype):
    frag = gluon_qmm.fragment_fields(qmatmul.repack(raw, qtype, K), qtype)
    assert torch.equal(kernel_codes(frag, qtype), gguf_codes(raw, qtype))
    # the same values as the reference decoder, with the scales of the (shared) header
    ref = dequantize(raw, qtype, (N, K))
    assert torch.equal(dequantize(gluon_qmm.unpack(frag, qtype, K), qtype, (N, K)), ref)


def test_a_wrong_layout_gives_other_codes(raw, qtype):
    """The check above can fail: the GGUF order itself, read as fragment order, decodes to other codes."""
    fields = qmatmul.repack(raw, qtype, K)
    assert not torch.equal(kernel_codes(fields, qtype), gguf_codes(raw, qtype))


@pytest.mark.parametrize("m", [23, 8])
def test_the_kernel_compiles_for_sm90_with_its_layouts_checked(raw, qtype, m):
    """The verify's product (M = 23, the b32 tile) and M = 8 (b16) compiled for sm_90 here: every
    assert_trivial conversion holds (a mismatch is a compile error), and its unit loop decodes with bit
    ops and bf16x2 FMAs: no byte shuffles (PRMT) of the codes and no ldmatrix (the weights never pass
    through shared memory)."""
    pytest.importorskip("triton.experimental.gluon")
    from flashtree.kernels.sm90 import compile_for_sm90, launch_record

    frag = gluon_qmm.fragment_fields(qmatmul.repack(raw, qtype, K), qtype)
    x = torch.randn(m, K).bfloat16()
    _, args, kwargs, *_ = gluon_qmm.launch_args(x, frag, qtype, N, K, qmatmul.DEFAULT_KERNELS)
    kernel = gluon_qmm._bf16_kernel
    record = launch_record(kernel.fn, args, kwargs, tuple(kernel.do_not_specialize))
    assert record["constexprs"]["BM"] == (32 if m == 23 else 16)
    (facts,) = compile_for_sm90([record], also="sass")
    assert facts["failure"] is None, facts["failure"]
    loop = facts["opcodes"]["loop"]
    assert loop.get("HGMMA", 0) > 0 and loop.get("HFMA2", 0) > 0
    assert not [op for op in loop if op.startswith("LDSM")], loop
    # no byte shuffles of codes: Q6_K's loop has one 16-bit merge (PRMT 0x7610) a unit, 1/256 a weight
    assert sum(n for op, n in loop.items() if op.startswith("PRMT")) <= (qtype == QT.Q6_K), loop
