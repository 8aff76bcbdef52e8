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
    close(got.reshape(6, 160), torch_path(layers.gated_rms_norm, o, w, 1e-6, z, DTYPES[out_dtype]))
    assert torch.equal(fused.rms_norm(o[:1], w, 1e-6, gate=z[:1], out_dtype=DTYPES[out_dtype]), got[:1])


@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
@pytest.mark.parametrize("rows", [1, 16])
def test_silu_mul(rows, dtype):
    gate_up = (torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows)) * 4).to(
        DTYPES[dtype]
    )
    gate, up = gate_up[:, :1536], gate_up[:, 1536:]
    got = fused.gate_mul(gate, up)
    close(got, F.silu(gate) * up)
    assert torch.equal(fused.gate_mul(gate[-1:], up[-1:]), got[-1:])


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


def same_activations(got, want) -> bool:
    return all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
@pytest.mark.parametrize("variant", ["plain", "residual", "gated heads"])
def test_a_norm_quantizes_its_one_token_output_as_the_matmul_would(variant, dtype):
    """quantize=True: the same output bits, carrying exactly quantize_activations' codes, scales and sums
    of the token's row (for the gated norm: its heads read as one row), in one launch."""
    from flashtree.kernels.qmatmul import int8_of, quantize_activations, reshape_int8

    shape = (1, 4, 64) if variant == "gated heads" else (1, 320)
    x, w, gen = inputs(shape, DTYPES[dtype] if variant != "gated heads" else torch.float32, 6)
    kwargs = {}
    if variant == "residual":
        kwargs["residual"] = torch.randn(shape, generator=gen).to(x.dtype)
    if variant == "gated heads":
        kwargs |= {"gate": torch.randn(1, 256, generator=gen).to(DTYPES[dtype]), "out_dtype": DTYPES[dtype]}
    plain = fused.rms_norm(x, w, 1e-6, **kwargs)
    quantized = fused.rms_norm(x, w, 1e-6, **kwargs, quantize=True)
    if variant == "residual":
        assert torch.equal(plain[0], quantized[0])
        plain, quantized = plain[1], quantized[1]
    assert torch.equal(plain, quantized)
    row = reshape_int8(quantized, 1, -1)  # what the matmul is handed
    assert int8_of(row) is not None
    assert same_activations(int8_of(row), quantize_activations(row))


@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
def test_silu_mul_quantizes_its_one_token_output_as_the_matmul_would(dtype):
    from flashtree.kernels.qmatmul import int8_of, quantize_activations

    gate_up = (torch.randn(1, 2 * 1568, generator=torch.Generator().manual_seed(7)) * 4).to(DTYPES[dtype])
    gate, up = gate_up[:, :1568], gate_up[:, 1568:]  # 49 blocks: two programs, the second one partly
    got = fused.gate_mul(gate, up, quantize=True)
    assert torch.equal(got, fused.gate_mul(gate, up))
    assert same_activations(int8_of(got), quantize_activations(got))


def test_quantize_is_for_rows_of_whole_blocks():
    with pytest.raises(ValueError, match="multiple of 32"):
        fused.rms_norm(torch.randn(1, 40), torch.ones(40), 1e-6, quantize=True)
    with pytest.raises(ValueError, match="one row"):
        fused.gate_mul(torch.randn(2, 64), torch.randn(2, 64), quantize=True)


def test_layers_quantize_only_one_token_for_int8_matrices(monkeypatch):
    """layers.* quantize where they make the input of packed int8 matrices (qlinear.takes_int8), for one
    token on the fused path, and nowhere else."""
    from flashtree.kernels.qlinear import QuantLinear
    from flashtree.kernels.qmatmul import int8_of
    from flashtree.models.layers import Linear, MergedLinear
    from flashtree.quant.formats import QT
    from flashtree.quant.pack import random_blocks

    raw = torch.from_numpy(random_blocks(int(QT.Q8_0), 8, 64, __import__("numpy").random.default_rng(0)))
    packed, dense = QuantLinear(raw, int(QT.Q8_0), (8, 64)), Linear(torch.randn(8, 64))
    packed.arithmetic = "int8"
    monkeypatch.setattr(kernels, "triton_kernels_for", lambda x: True)
    x, w = torch.randn(1, 64), torch.ones(64)
    with torch.no_grad():
        assert int8_of(layers.rms_norm(x, w, 1e-6, packed)) is not None
        assert int8_of(layers.rms_norm(x, w, 1e-6, dense)) is None
        assert int8_of(layers.rms_norm(x, w, 1e-6)) is None
        assert int8_of(layers.rms_norm(torch.randn(2, 64), w, 1e-6, packed)) is None  # two tokens
        merged = MergedLinear([packed, dense], [0, 1], [8, 8])
        assert int8_of(layers.rms_norm(x, w, 1e-6, merged)) is None  # not all packed
        assert int8_of(layers.silu_mul(x, x, packed)) is not None
        packed.arithmetic = "bf16"
        assert int8_of(layers.rms_norm(x, w, 1e-6, packed)) is None


@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
@pytest.mark.parametrize("rows", [1, 5])
def test_sigmoid_gate_of_a_strided_head_view(rows, dtype):
    """qwen3.5's attention output gate: x * sigmoid(gate), gate the (T, heads, head_dim) half of each
    head's [q | gate] rows, read in place; one token quantizes like the matmul would."""
    from flashtree.kernels.qmatmul import int8_of, quantize_activations

    gen = torch.Generator().manual_seed(rows)
    q_proj = (torch.randn(rows, 3 * 2 * 64, generator=gen) * 4).to(DTYPES[dtype])
    gate = q_proj.view(rows, 3, 128)[..., 64:]  # (rows, 3, 64), strides (384, 128, 1)
    x = (torch.randn(rows, 3 * 64, generator=gen) * 2).to(DTYPES[dtype])
    got = fused.gate_mul(gate, x, "sigmoid")
    close(got, torch_path(layers.sigmoid_gate, x, gate))
    assert torch.equal(fused.gate_mul(gate[-1:], x[-1:], "sigmoid"), got[-1:])
    if rows == 1:
        quantized = fused.gate_mul(gate, x, "sigmoid", quantize=True)
        assert torch.equal(quantized, got)
        assert same_activations(int8_of(quantized), quantize_activations(quantized))
