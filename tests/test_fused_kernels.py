"""kernels/fused.py (RMSNorm with its residual add or SiLU gate, SiLU-and-multiply) vs the torch paths of
models/layers.py, on CPU through Triton's interpreter. The kernels reduce in another order than torch,
so results agree to fp32 rounding (fp32: 2e-6 relative; bf16: one unit in the last place); a row alone
gives its row of a batch bit for bit (the AR step vs a verify row)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are compiled: run them on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

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
        mp.setenv("FLASHTREE_KERNELS", "torch")
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
    close(normed, want_normed.x)
    h1, normed1 = fused.rms_norm(x[4:5], w, 1e-6, residual=residual[4:5])
    assert torch.equal(h1, h[4:5]) and torch.equal(normed1, normed[4:5])


@pytest.mark.parametrize("out_dtype", DTYPES, ids=list(DTYPES))
def test_gated_rms_norm(out_dtype):
    """The DeltaNet output: fp32 heads (T, heads, v_dim), the gate a column slice (T, heads * v_dim)."""
    o, w, gen = inputs((6, 4, 40), torch.float32, 5)
    z = (torch.randn(6, 3 * 160, generator=gen) * 4).to(torch.bfloat16)[:, 160:320]
    got = fused.rms_norm(o, w, 1e-6, gate=z, out_dtype=DTYPES[out_dtype])
    close(got.reshape(6, 160), torch_path(layers.gated_rms_norm, o, w, 1e-6, z, DTYPES[out_dtype]).x)
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


def test_layers_take_the_kernels_only_outside_autograd(monkeypatch, kernels_path):
    calls = []
    kernels_path("triton")
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
    """int8 buffers: the same output bits, and they receive exactly quantize_activations' codes, scales
    and sums of the token's row (for the gated norm: its heads read as one row), in one launch."""
    from flashtree.kernels.qmatmul import new_activations, quantize_activations

    shape = (1, 4, 64) if variant == "gated heads" else (1, 320)
    x, w, gen = inputs(shape, DTYPES[dtype] if variant != "gated heads" else torch.float32, 6)
    kwargs = {}
    if variant == "residual":
        kwargs["residual"] = torch.randn(shape, generator=gen).to(x.dtype)
    if variant == "gated heads":
        kwargs |= {"gate": torch.randn(1, 256, generator=gen).to(DTYPES[dtype]), "out_dtype": DTYPES[dtype]}
    plain = fused.rms_norm(x, w, 1e-6, **kwargs)
    int8 = new_activations(256 if variant == "gated heads" else 320, 1, x.device)
    quantized = fused.rms_norm(x, w, 1e-6, **kwargs, int8=int8)
    if variant == "residual":
        assert torch.equal(plain[0], quantized[0])
        plain, quantized = plain[1], quantized[1]
    assert torch.equal(plain, quantized)
    assert same_activations(int8, quantize_activations(quantized.reshape(1, -1)))  # the matmul's row


@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
def test_silu_mul_quantizes_its_one_token_output_as_the_matmul_would(dtype):
    from flashtree.kernels.qmatmul import new_activations, quantize_activations

    gate_up = (torch.randn(1, 2 * 1568, generator=torch.Generator().manual_seed(7)) * 4).to(DTYPES[dtype])
    gate, up = gate_up[:, :1568], gate_up[:, 1568:]  # 49 blocks: two programs, the second one partly
    int8 = new_activations(1568, 1, gate.device)
    got = fused.gate_mul(gate, up, int8=int8)
    assert torch.equal(got, fused.gate_mul(gate, up))
    assert same_activations(int8, quantize_activations(got))


def test_quantize_is_for_rows_of_whole_blocks():
    from flashtree.kernels.qmatmul import new_activations

    with pytest.raises(ValueError, match="multiple of 32"):
        fused.rms_norm(torch.randn(1, 40), torch.ones(40), 1e-6, int8=new_activations(40, 1, "cpu"))
    with pytest.raises(ValueError, match="one row"):
        fused.gate_mul(torch.randn(2, 64), torch.randn(2, 64), int8=new_activations(128, 1, "cpu"))
    with pytest.raises(ValueError, match="one row of 64 values"):  # buffers of another size
        fused.rms_norm(torch.randn(1, 64), torch.ones(64), 1e-6, int8=new_activations(96, 1, "cpu"))


def test_layers_quantize_only_one_token_for_int8_matrices(kernels_path):
    """Packed int8 matrices take the int8 form of their input (takes_int8), others not; layers.* make it
    when asked (int8=True) for one token on the fused path, and nowhere else."""
    from flashtree.kernels.qlinear import QuantLinear
    from flashtree.kernels.qmatmul import MatmulInput
    from flashtree.models.layers import Fp8Linear, Linear, MergedLinear, RMSNorm, SwiGLU
    from flashtree.quant.formats import QT
    from flashtree.quant.pack import random_blocks

    raw = torch.from_numpy(random_blocks(int(QT.Q8_0), 8, 64, __import__("numpy").random.default_rng(0)))
    packed, dense = QuantLinear(raw, int(QT.Q8_0), (8, 64)), Linear(torch.randn(8, 64))
    packed.arithmetic = "int8"
    merged, all_packed = MergedLinear([packed, dense], [0, 1], [8, 8]), MergedLinear([packed], [0, 0], [4, 4])
    assert packed.takes_int8 and all_packed.takes_int8 and SwiGLU(all_packed, dense).takes_int8
    assert not dense.takes_int8 and not Fp8Linear(torch.randn(8, 64)).takes_int8
    assert not merged.takes_int8 and not SwiGLU(merged, packed).takes_int8  # not all packed
    kernels_path("triton")
    x, w = torch.randn(1, 64), torch.ones(64)
    norm = RMSNorm(w, 1e-6)
    with torch.no_grad():
        assert norm.matmul_input(x, True).int8 is not None
        assert norm.matmul_input(x, False).int8 is None and norm.matmul_input(x).int8 is None
        assert norm.matmul_input(torch.randn(2, 64), True).int8 is None  # two tokens
        assert layers.add_rms_norm(x, x, w, 1e-6, True)[1].int8 is not None
        assert layers.add_rms_norm(x, x, w, 1e-6)[1].int8 is None
        assert layers.silu_mul(x, x, True).int8 is not None and layers.silu_mul(x, x).int8 is None
        assert layers.sigmoid_gate(x, x.view(1, 2, 32), True).int8 is not None
        assert layers.gated_rms_norm(x.view(1, 2, 32), w[:32], 1e-6, x, x.dtype, True).int8 is not None
        assert isinstance(norm.matmul_input(x, True), MatmulInput) and isinstance(norm(x), torch.Tensor)
        packed.arithmetic = "bf16"
        assert not packed.takes_int8 and not all_packed.takes_int8
    assert norm.matmul_input(x, True).int8 is None  # autograd on: the torch ops


@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
@pytest.mark.parametrize("rows", [1, 5])
def test_sigmoid_gate_of_a_strided_head_view(rows, dtype):
    """qwen3.5's attention output gate: x * sigmoid(gate), gate the (T, heads, head_dim) half of each
    head's [q | gate] rows, read in place; one token quantizes like the matmul would."""
    from flashtree.kernels.qmatmul import new_activations, quantize_activations

    gen = torch.Generator().manual_seed(rows)
    q_proj = (torch.randn(rows, 3 * 2 * 64, generator=gen) * 4).to(DTYPES[dtype])
    gate = q_proj.view(rows, 3, 128)[..., 64:]  # (rows, 3, 64), strides (384, 128, 1)
    x = (torch.randn(rows, 3 * 64, generator=gen) * 2).to(DTYPES[dtype])
    got = fused.gate_mul(gate, x, "sigmoid")
    close(got, torch_path(layers.sigmoid_gate, x, gate).x)
    assert torch.equal(fused.gate_mul(gate[-1:], x[-1:], "sigmoid"), got[-1:])
    if rows == 1:
        int8 = new_activations(3 * 64, 1, x.device)
        assert torch.equal(fused.gate_mul(gate, x, "sigmoid", int8), got)
        assert same_activations(int8, quantize_activations(got))
