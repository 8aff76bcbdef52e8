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


def test_the_swiglu_input_on_the_gpu():
    """SwiGLU's activation made as the down projection loads its input (the pair's 576 x 1536): rows
    batch-invariant bit for bit, within fp32 rounding of fused.gate_mul's launch then the product."""
    from flashtree.kernels.fused import gate_mul

    gen = torch.Generator().manual_seed(7)
    w = (torch.randn(576, 1536, generator=gen) / 1536**0.5).to(DEVICE)
    failures = []
    for m in (1, 16, 23, 64):
        merged = torch.randn(m, 2 * 1536, generator=gen).to(DEVICE)
        gate, up = merged[:, :1536], merged[:, 1536:]
        got = dense_linear(gate, w, up=up)
        two = dense_linear(gate_mul(gate, up), w)
        alone = torch.cat([dense_linear(gate[i : i + 1], w, up=up[i : i + 1]) for i in range(m)])
        err = ((got - two).abs().max() / two.abs().max()).item()
        if not err < TOL:
            failures.append(f"M={m}: {err:.2e} from the two launches")
        if not torch.equal(alone, got):
            failures.append(f"M={m}: rows differ from the 1-row calls")
    assert not failures, "; ".join(failures)


@pytest.mark.parametrize("n", [960, 3072], ids=["qkv", "gate_up"])
def test_the_norm_made_as_the_tile_loads_on_the_gpu(n):
    """RMSNorm(x + residual) made by the product as it loads x (the pair's q/k/v and gate/up, K = 576): the
    sum stored bit for bit as fused.rms_norm stores it, the product within 2e-6 of its launch then the
    product, and every row the same bits alone as in the batch."""
    from flashtree.kernels.dense_matmul import Norm
    from flashtree.kernels.fused import rms_norm

    gen = torch.Generator().manual_seed(n)
    w = (torch.randn(n, 576, generator=gen) / 576**0.5).to(DEVICE)
    g = torch.randn(576, generator=gen).to(DEVICE)
    failures = []
    for m in (1, 16, 23, 64):
        x, res = torch.randn(2, m, 576, generator=gen).to(DEVICE)
        total = torch.empty_like(x)
        got = dense_linear(x, w, norm=Norm(g, 1e-5, res, total))
        want_total, normed = rms_norm(x, g, 1e-5, residual=res)
        two = dense_linear(normed, w)
        alone = torch.cat(
            [
                dense_linear(x[i : i + 1], w, norm=Norm(g, 1e-5, res[i : i + 1], total[i : i + 1].clone()))
                for i in range(m)
            ]
        )
        err = ((got - two).abs().max() / two.abs().max()).item()
        if not torch.equal(total, want_total):
            failures.append(f"M={m}: the stored sum differs")
        if not err < TOL:
            failures.append(f"M={m}: {err:.2e} from the two launches")
        if not torch.equal(alone, got):
            failures.append(f"M={m}: rows differ from the 1-row calls")
    assert not failures, "; ".join(failures)
