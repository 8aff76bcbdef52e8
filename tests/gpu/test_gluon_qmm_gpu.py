"""The Gluon bf16 kernel (kernels/gluon_qmm.py, FLASHTREE_QMM_KERNEL=gluon) on an sm_90 GPU, Q4_K and Q6_K:

- bit for bit the `tl` kernel's bf16 product (qmatmul.quant_matmul(..., "bf16")) at M = 1, 8, 23, 32
  and at a 1000-row test shape and the 27B's shapes (K = 5120 and 17408), K-splits included;
- within BF16_TOL (tests/gpu/test_quant_matmul_gpu.py's: the weights' bf16 decoding) of x_bf16 @ W^T;
- batch-invariant: every M's rows equal the 32-row call's;
- QuantLinear takes it with the setting, and gives the same bits as without;
each with its wgmmas async (the default, gluon_qmm.ASYNC_MMA) and sync. `test_timing` prints one line per
shape and M, the tl kernel's and both Gluon variants' times (run with -s to see it).
"""

import numpy as np
import pytest
import torch

from flashtree.kernels import gluon_qmm, qmatmul
from flashtree.kernels.qlinear import QuantLinear
from flashtree.quant.dequant import dequantize
from flashtree.quant.formats import QT
from flashtree.quant.pack import random_blocks
from flashtree.settings import Settings

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
CHECK_M = (1, 8, 23, 32)
BF16_TOL = 1e-2
# (rows, cols): a ragged tile; the 27B's matrices: DeltaNet z / qkv, FFN gate and up, FFN down
SHAPES = [(1000, 4096), (6144, 5120), (10240, 5120), (17408, 5120), (5120, 17408)]


@pytest.fixture(scope="module", autouse=True)
def sm90():
    if torch.cuda.get_device_capability()[0] != 9 or gluon_qmm.gluon is None:
        pytest.skip("the Gluon kernel is for sm_90 (wgmma), with Triton's Gluon")


@pytest.fixture(
    scope="module",
    params=[(t, s) for t in (QT.Q4_K, QT.Q6_K) for s in SHAPES],
    ids=lambda p: f"{p[0].name}-{p[1][0]}x{p[1][1]}",
)
def packed(request):
    qtype, (n, k) = request.param
    raw = torch.from_numpy(random_blocks(qtype, n, k, np.random.default_rng(n + k))).to(DEVICE)
    fields = qmatmul.repack(raw, qtype, k)
    x = torch.randn(max(CHECK_M), k, generator=torch.Generator().manual_seed(0)).to(DEVICE).bfloat16()
    return qtype, n, k, raw, fields, gluon_qmm.fragment_fields(fields, qtype), x


@pytest.mark.parametrize("async_mma", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("m", CHECK_M)
def test_bit_identical_to_the_triton_kernel_and_batch_invariant(packed, m, async_mma):
    qtype, n, k, raw, fields, frag, x = packed
    assert gluon_qmm.supports(x[:m], qtype, k)
    y = gluon_qmm.matmul(x[:m], frag, qtype, n, k, async_mma=async_mma)
    ref = qmatmul.quant_matmul(x[:m], fields, qtype, n, k, "bf16")
    assert y.dtype == ref.dtype and torch.equal(y, ref), (y - ref).abs().max().item()
    whole = gluon_qmm.matmul(x, frag, qtype, n, k, async_mma=async_mma)
    assert torch.equal(y, whole[:m])  # the 32-row call's rows
    plain = x[:m].double() @ dequantize(raw, qtype, (n, k)).double().t()
    assert ((y.double() - plain).norm() / plain.norm()).item() < BF16_TOL


def test_quant_linear_takes_it_with_the_setting(packed):
    qtype, n, k, raw, _, _, x = packed
    layer = QuantLinear(raw, qtype, (n, k))
    layer.arithmetic = "bf16"
    default = layer(x[:23])
    layer.kernels = Settings.from_env({"FLASHTREE_QMM_KERNEL": "gluon"}).kernels  # as use_kernels gives it
    assert torch.equal(layer(x[:23]), default) and layer._fragment is not None


def test_timing(packed):
    from triton.testing import do_bench

    qtype, n, k, _, fields, frag, x = packed
    for m in (1, 16, 23):
        tl_us = do_bench(lambda: qmatmul.quant_matmul(x[:m], fields, qtype, n, k, "bf16")) * 1e3  # noqa: B023
        gl_us = [
            do_bench(lambda: gluon_qmm.matmul(x[:m], frag, qtype, n, k, async_mma=a)) * 1e3  # noqa: B023
            for a in (True, False)
        ]
        times = f"tl {tl_us:.1f} us, gluon async {gl_us[0]:.1f} us, sync {gl_us[1]:.1f} us"
        print(f"\n{qtype.name} {n}x{k} M={m}: {times}")
