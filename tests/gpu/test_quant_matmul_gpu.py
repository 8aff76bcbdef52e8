"""The quantized-matmul kernels (kernels/qmatmul.py) on the GPU, every type, in this process's arithmetic
(FLASHTREE_QMM_ARITH: int8 by default; run again with bf16 for the other):

- at M in {1, 5, 16, 23, 33, 64, 100} (dp4a; the m16, m32, m64 tensor-core buckets; dequantize + cuBLAS),
  relative errors against
  - the kernels' own math in fp64 (qmatmul.reference_matmul), x and y in fp32: rounding only (< 1e-5;
    bf16 arithmetic: x_bf16 @ W^T within 1e-2, the weights' bf16 decoding);
  - the plain product x @ W^T, x and y in bf16: the int8 activation error (~5e-3; < 1e-2);
  and batch invariance: every M's rows equal the 64-row call's, fp32 and bf16 (M <= 64);
- single rows (the dp4a path) equal their rows of the 64-row call;
- the kernels' dequantizer equal to the reference dequantizer;
- the inline PTX equal to its integer emulation (qmatmul.EMULATE_PTX) at M = 1, 23 and in the dequantizer.
The timings of these kernels are benchmarks/gpu_kernels.py.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from benchmarks import knobs
from flashtree.kernels.qmatmul import (
    MAX_FUSED_M,
    dequantize_packed,
    reference_matmul,
    repack,
)
from flashtree.quant.dequant import dequantize
from flashtree.quant.formats import QT
from flashtree.quant.pack import random_blocks

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
CHECK_M = (1, 5, 16, 23, 33, 64, 100)  # dp4a, m16 (5, 16), m32 (23), m64 (33, 64), dequantize + cuBLAS
SINGLE_ROWS = (0, 7, 22, 63)  # rows also computed alone (dp4a) for the invariance check
EXACT_TOL, INT8_TOL = 1e-5, 1e-2
BF16_TOL = 1e-2  # FLASHTREE_QMM_ARITH=bf16 vs x_bf16 @ W^T: the weights' bf16 decoding
CHECK_SHAPES = {  # (rows, cols): rows not a multiple of any tile; legacy widths of 18 and 48 blocks
    QT.Q4_K: (1000, 4096), QT.Q5_K: (1000, 4096), QT.Q6_K: (1000, 4096),
    QT.Q8_0: (1000, 576), QT.Q4_0: (1000, 576), QT.Q4_1: (1000, 1536),
}  # fmt: skip


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


@pytest.fixture(scope="module", params=list(CHECK_SHAPES), ids=lambda qtype: qtype.name)
def packed(request):
    """A random `qtype` matrix packed for the kernels, its reference decoding, 100 rows of x (fp32 and
    bf16), the products the kernels approximate, and the kernels' 64-row products."""
    qtype = request.param
    n, k = CHECK_SHAPES[qtype]
    raw = torch.from_numpy(random_blocks(qtype, n, k, np.random.default_rng(int(qtype)))).to(DEVICE)
    fields = repack(raw, qtype, k)
    w = dequantize(raw, qtype, (n, k))  # (n, k) fp32, the reference decoder
    x = torch.randn(max(CHECK_M), k, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    xb = x.bfloat16()
    plain = xb.double() @ w.double().t()  # (100, n): the product the kernels approximate
    bf16 = knobs.qmm_arithmetic() == "bf16"  # the kernels' own math: x_bf16 @ W^T up to the weights' decoding
    exact, exact_tol = (plain, BF16_TOL) if bf16 else (reference_matmul(x, raw, qtype, n, k), EXACT_TOL)

    def mm(a):
        return knobs.qmm(a, fields, qtype, n, k)

    return SimpleNamespace(
        qtype=qtype, n=n, k=k, fields=fields, w=w, x=x, xb=xb, plain=plain, exact=exact,
        exact_tol=exact_tol, mm=mm, full=mm(x[:64]), full_b=mm(xb[:64]),
    )  # fmt: skip


@pytest.mark.parametrize("m", CHECK_M)
def test_rows_within_tolerance_and_batch_invariant(packed, m):
    p = packed
    y, yb = p.mm(p.x[:m]), p.mm(p.xb[:m])
    fused = m <= MAX_FUSED_M
    own = rel_err(y, p.exact[:m]) if fused else rel_err(y, p.x[:m].double() @ p.w.double().t())
    bf16 = rel_err(yb, p.plain[:m])
    assert torch.isfinite(y).all() and torch.isfinite(yb).all()
    assert own < p.exact_tol, f"{p.qtype.name} M={m}: {own:.2e} from its own math"
    assert bf16 < max(INT8_TOL, BF16_TOL), f"{p.qtype.name} M={m}: {bf16:.2e} from x @ W^T (bf16)"
    if fused:
        assert torch.equal(y, p.full[:m]), f"{p.qtype.name} M={m}: fp32 rows differ from the 64-row call's"
        assert torch.equal(yb, p.full_b[:m]), f"{p.qtype.name} M={m}: bf16 rows differ from the 64-row call's"


def test_single_rows_equal_rows_of_64(packed):
    p = packed
    for i in SINGLE_ROWS:
        assert torch.equal(p.mm(p.x[i : i + 1])[0], p.full[i]), f"{p.qtype.name} fp32 row {i}"
        assert torch.equal(p.mm(p.xb[i : i + 1])[0], p.full_b[i]), f"{p.qtype.name} bf16 row {i}"


def test_dequantizer_equals_reference(packed):
    p = packed
    assert torch.equal(dequantize_packed(p.fields, p.qtype, p.n, p.k, torch.float32), p.w)


def test_inline_ptx_equals_emulation(packed):
    """Bit for bit; in the bf16 arithmetic the emulation's dots run in fp32 (the interpreter's bf16 dots
    are wrong), so its products agree to fp32 accumulation rounding (1e-5) and its dequantizer exactly."""
    p = packed

    def outputs():
        return [knobs.qmm(p.x[:m], p.fields, p.qtype, p.n, p.k) for m in (1, 23)] + [
            dequantize_packed(p.fields, p.qtype, p.n, p.k, torch.float32)
        ]

    with_ptx = outputs()
    with knobs.emulated_ptx():
        emulated = outputs()
    if knobs.qmm_arithmetic() == "bf16":
        for m, a, b in zip((1, 23), with_ptx[:2], emulated[:2], strict=True):
            assert rel_err(a, b.double()) < EXACT_TOL, f"{p.qtype.name} M={m}"
        assert torch.equal(with_ptx[2], emulated[2]), f"{p.qtype.name} dequantizer"
    else:
        for name, a, b in zip(("M=1", "M=23", "dequantizer"), with_ptx, emulated, strict=True):
            assert torch.equal(a, b), f"{p.qtype.name} {name}"
