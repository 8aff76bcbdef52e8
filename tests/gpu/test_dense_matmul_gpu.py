"""The fp32 decode kernel (kernels/dense_matmul.py) on the GPU at the default pair's matrix shapes (SmolLM2
and its draft: benchmarks/gpu_dense_matmul.SHAPES, which times them) and M = 1, 15, 16, 23, 64, at its
default tiles: within 2e-6 (relative to the largest output) of the fp64 product, and every row of an
M-row call equal to the 1-row call on that row bit for bit (batch invariance: a verify row equals the AR
step; cuBLAS's own fp32 rows need not)."""

import pytest
import torch

from benchmarks.gpu_dense_matmul import SHAPES
from flashtree.kernels.dense_matmul import dense_linear

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
TOL = 2e-6


@pytest.mark.parametrize("name,n,k", [shape[:3] for shape in SHAPES], ids=[shape[0] for shape in SHAPES])
def test_dense_rows_exact_and_batch_invariant(name, n, k):
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen).to(DEVICE) / k**0.5
    failures = []
    for m in (1, 15, 16, 23, 64):
        x = torch.randn(m, k, generator=gen).to(DEVICE)
        got = dense_linear(x, w)
        want = x.double() @ w.double().t()
        alone = torch.cat([dense_linear(x[i : i + 1], w) for i in range(m)])
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        if not err < TOL:
            failures.append(f"M={m}: {err:.2e} from the fp64 product")
        if not torch.equal(alone, got):
            failures.append(f"M={m}: rows differ from the 1-row calls")
    assert not failures, f"{name} {n}x{k}: " + "; ".join(failures)
