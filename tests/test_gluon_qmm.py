"""The Gluon Q4_K kernel's load-time layout (kernels/gluon_qmm.py): a lossless byte permutation whose
bit-op decoding gives exactly the codes of qmatmul's layout, and the kernel's compile for sm_90 on a CPU."""

import numpy as np
import pytest
import torch

from flashtree.kernels import gluon_qmm, qmatmul
from flashtree.quant.dequant import dequantize
from flashtree.quant.formats import QT
from flashtree.quant.pack import random_blocks

N, K = 24, 512  # two super-blocks a row


@pytest.fixture(scope="module")
def raw():
    return torch.from_numpy(random_blocks(QT.Q4_K, N, K, np.random.default_rng(3)))


def gguf_codes(raw: torch.Tensor) -> torch.Tensor:
    """Q4_K codes (rows, K) from GGUF rows: per group pair, 32 bytes after 16 header bytes, low nibble
    value l, high nibble value 32 + l."""
    q = raw.view(N, -1, 144)[:, :, 16:].reshape(N, -1, 4, 32).long()
    return torch.stack([q & 15, q >> 4], dim=3).reshape(N, K)


def test_fragment_layout_is_a_permutation_unpack_inverts(raw):
    fields = qmatmul.repack(raw, QT.Q4_K, K)
    frag = gluon_qmm.fragment_fields(fields)
    assert frag[1] is fields[1]  # the header is shared
    assert not torch.equal(frag[0], fields[0])
    assert torch.equal(gluon_qmm.unpack(frag, K), raw)
    assert torch.equal(gluon_qmm.unpack(frag, K, slice(5, 9)), raw[5:9])
    assert sorted(gluon_qmm.POSITIONS.tolist()) == list(range(32))


def test_fragment_decoding_gives_the_same_codes_and_values(raw):
    frag = gluon_qmm.fragment_fields(qmatmul.repack(raw, QT.Q4_K, K))
    codes = gluon_qmm.fragment_codes(frag[0])
    assert torch.equal(codes, gguf_codes(raw))
    # the same values as the reference decoder, with the scales of the (shared) header
    ref = dequantize(raw, QT.Q4_K, (N, K))
    assert torch.equal(dequantize(gluon_qmm.unpack(frag, K), QT.Q4_K, (N, K)), ref)


def test_the_kernel_compiles_for_sm90_with_its_layouts_checked(raw):
    """The verify's product (M = 23, the b32 tile) compiled for sm_90 here: every assert_trivial
    conversion holds (a mismatch is a compile error), and its unit loop decodes with bit ops and bf16x2
    FMAs only: no byte shuffles (PRMT) and no ldmatrix (the weights never pass through shared memory)."""
    pytest.importorskip("triton.experimental.gluon")
    from flashtree.kernels.sm90 import compile_for_sm90, launch_record

    frag = gluon_qmm.fragment_fields(qmatmul.repack(raw, QT.Q4_K, K))
    x = torch.randn(23, K).bfloat16()
    _, args, kwargs, *_ = gluon_qmm.launch_args(x, frag, N, K, qmatmul.DEFAULT_KERNELS)
    kernel = gluon_qmm._q4k_bf16_kernel
    record = launch_record(kernel.fn, args, kwargs, tuple(kernel.do_not_specialize))
    assert record["constexprs"]["BM"] == 32
    (facts,) = compile_for_sm90([record], also="sass")
    assert facts["failure"] is None, facts["failure"]
    loop = facts["opcodes"]["loop"]
    assert loop.get("HGMMA", 0) > 0 and loop.get("HFMA2", 0) > 0
    assert not [op for op in loop if op.startswith(("PRMT", "LDSM"))], loop
