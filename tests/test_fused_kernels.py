"""kernels/fused.py (RMSNorm with its residual add or SiLU gate, SiLU-and-multiply) vs the torch paths of
models/layers.py, on CPU through Triton's interpreter. The kernels reduce in another order than torch,
so results agree to fp32 rounding (fp32: 2e-6 relative; bf16: one unit in the last place); a row alone
gives its row of a batch bit for bit (the AR step vs a verify row)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are compiled: run them on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flashtree import kernels  # noqa: E402
from flashtree.kernels import fused  # noqa: E402
from flashtree.models import layers  # noqa: E402

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: rounding-order differences only; bf16: at most one unit in the last place."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.bfloat16:
        ulp = 2.0 ** (torch.frexp(want.float())[1] - 8).float()
        assert ((got.float() - want.float()).abs() <= ulp).all()
    else:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)


def torch_path(fn, *args, **kwargs):
    """layers.fn with the kernels off: the reference."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "triton_kernels_for", lambda x: False)
        return fn(*args, **kwargs)


def inputs(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=gen).to(dtype)
    return x, w, gen


@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
@pytest.mark.parametrize("rows,d", [(1, 64), (23, 576), (5, 1000)])
def test_rms_norm(rows, d, dtype):
    x, w, _ = inputs((rows, d), DTYPES[dtype], rows + d)
    got = fused.rms_norm(x, w, 1e-6)
    close(got, torch_path(layers.rms_norm, x, w, 1e-6))
    assert torch.equal(fused.rms_norm(x[-1:], w, 1e-6), got[-1:])


@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
def test_rms_norm_of_heads_in_a_strided_view(dtype):
    """q/k norms: (T, heads, head_dim) views of a wider projection output, each head normed alone."""
    packed, w, _ = inputs((7, 3 * 48), DTYPES[dtype], 3)
    q = packed[:, 16 : 16 + 2 * 32].view(7, 2, 32)  # row stride 144, not 64: no flat view exists
    got = fused.rms_norm(q, w[:32], 1e-5)
    assert got.is_contiguous()
    close(got, torch_path(layers.rms_norm, q, w[:32], 1e-5))
    assert torch.equal(fused.rms_norm(q[2:3], w[:32], 1e-5), got[2:3])


@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
def test_add_rms_norm_returns_the_sum_and_its_norm(dtype):
    x, w, gen = inputs((9, 320), DTYPES[dtype], 4)
    residual = torch.randn(9, 2 * 320, generator=gen).to(x.dtype)[:, 320:]  # a column slice
    h, normed = fused.rms_norm(x, w, 1e-6, residual=residual)
    want_h, want_normed = torch_path(layers.add_rms_norm, x, residual, w, 1e-6)
    assert torch.equal(h, want_h)  # one rounding of the exact sum, as torch's add
    close(normed, want_normed)
    h1, normed1 = fused.rms_norm(x[4:5], w, 1e-6, residual=residual[4:5])
    assert torch.equal(h1, h[4:5]) and torch.equal(normed1, normed[4:5])


@pytest.mark.parametrize("out_dtype", DTYPES, ids=list(DTYPES))
def test_gated_rms_norm(out_dtype):
    """The DeltaNet output: fp32 heads (T, heads, v_dim), the gate a column slice (T, heads * v_dim)."""
    o, w, gen = inputs((6, 4, 40), torch.float32, 5)
    z = (torch.randn(6, 3 * 160, generator=gen) * 4).to(torch.bfloat16)[:, 160:320]
    got = fused.rms_norm(o, w, 1e-6, gate=z, out_dtype=DTYPES[out_dtype])
    close(got, torch_path(layers.gated_rms_norm, o, w, 1e-6, z, DTYPES[out_dtype]))
    assert torch.equal(fused.rms_norm(o[:1], w, 1e-6, gate=z[:1], out_dtype=DTYPES[out_dtype]), got[:1])


@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
@pytest.mark.parametrize("rows", [1, 16])
def test_silu_mul(rows, dtype):
    gate_up = (torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows)) * 4).to(
        DTYPES[dtype]
    )
    gate, up = gate_up[:, :1536], gate_up[:, 1536:]
    got = fused.silu_mul(gate, up)
    close(got, F.silu(gate) * up)
    assert torch.equal(fused.silu_mul(gate[-1:], up[-1:]), got[-1:])


def test_layers_take_the_kernels_only_outside_autograd(monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "triton_kernels_for", lambda x: True)
    monkeypatch.setattr(fused, "rms_norm", lambda *a, **k: calls.append(a) or a[0])
    x, w = torch.randn(2, 8), torch.ones(8)
    with torch.no_grad():
        layers.rms_norm(x, w, 1e-6)
    assert len(calls) == 1
    layers.rms_norm(x.requires_grad_(), w, 1e-6)  # training: autograd needs the torch ops
    assert len(calls) == 1
