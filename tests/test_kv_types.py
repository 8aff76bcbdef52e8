"""KV cache types (quant/kv.py, kernels/kv_tiles.py): quantize / dequantize error bounds on Gaussian
vectors, tq3_0's rotation (orthonormal, each row's bits alone), the kernels' tile loads equal to
dequantize bit for bit."""

import pytest
import torch

from flashtree.errors import FlashtreeError
from flashtree.kernels import tl, triton
from flashtree.kernels.kv_tiles import kv_tile, plane_args
from flashtree.quant.kv import (
    KV_TYPES,
    check_kv_type,
    dequantize,
    quantize,
    rotate,
    unrotate,
    vector_bytes,
)

# relative RMS error bounds on unit Gaussian vectors (measured: q8_0 0.53%, q4_0 8.6%, tq3_0 17.2% at
# head_dim 128; the 3-bit Lloyd-Max quantizer of a Gaussian alone is 18.6%)
ERROR_BOUNDS = {"f32": 0.0, "f16": 3e-4, "bf16": 2e-3, "q8_0": 0.006, "q4_0": 0.09, "tq3_0": 0.18}


def relative_error(kind: str, x: torch.Tensor) -> float:
    y = dequantize(quantize(x, kind))
    if kind == "tq3_0":
        y = unrotate(y)
    return float((y - x).pow(2).mean().sqrt() / x.pow(2).mean().sqrt())


@pytest.mark.parametrize("kind", KV_TYPES)
@pytest.mark.parametrize("hd", [64, 128, 256])
def test_quantize_error_bound(kind, hd):
    x = torch.randn(512, hd, generator=torch.Generator().manual_seed(hd))
    assert relative_error(kind, x) <= ERROR_BOUNDS[kind]


@pytest.mark.parametrize("kind", KV_TYPES)
def test_fields_take_vector_bytes(kind):
    plane = quantize(torch.randn(3, 5, 64), kind)
    assert sum(f.element_size() * f.numel() for f in plane.fields) == 15 * vector_bytes(kind, 64)


def test_quantize_is_exact_where_the_grid_is():
    """Values on a block's q8_0 / q4_0 grid come back exactly; a zero block is zeros."""
    q = torch.randint(-127, 128, (4, 32), generator=torch.Generator().manual_seed(0)).float()
    q[:, 0] = 127  # each block's amax: scale 0.25, an fp16
    assert torch.equal(dequantize(quantize(q * 0.25, "q8_0")), q * 0.25)
    n = torch.arange(32).remainder(16).float() - 8
    assert torch.equal(dequantize(quantize(n[None] * 0.25, "q4_0"))[0], n * 0.25)
    for kind in ("q8_0", "q4_0", "tq3_0"):
        assert torch.equal(dequantize(quantize(torch.zeros(2, 64), kind)), torch.zeros(2, 64))


@pytest.mark.parametrize("hd", [32, 64, 256])
def test_rotation_is_orthonormal_and_row_invariant(hd):
    x = torch.randn(40, hd, generator=torch.Generator().manual_seed(1))
    y = rotate(x)
    torch.testing.assert_close(unrotate(y), x, atol=2e-6, rtol=0)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), atol=0, rtol=2e-6)
    for i in (0, 17, 39):  # one row alone: the same bits as among 40
        assert torch.equal(rotate(x[i : i + 1]), y[i : i + 1])
        assert torch.equal(unrotate(y[i : i + 1]), unrotate(y)[i : i + 1])
    assert not torch.allclose(y, x)


def test_check_kv_type():
    assert check_kv_type("tq3_0", 256) == "tq3_0"
    for kind, hd in (("q9_0", 64), ("q8_0", 24), ("tq3_0", 96), ("tq3_0", 160)):
        with pytest.raises(FlashtreeError):
            check_kv_type(kind, hd)
    assert check_kv_type("bf16", 24) == "bf16"


@triton.jit
def _tiles_kernel(
    data, scale, high, out, sdh, sds, ssh, sss, shh, shs,
    N: tl.constexpr, HD: tl.constexpr, KIND: tl.constexpr, TRANS: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0)
    n, d = tl.arange(0, N), tl.arange(0, HD)
    fields = data + h * sdh, scale + h * ssh, high + h * shh
    if TRANS:  # K^T as the attention kernel loads it, every other slot
        v = kv_tile(*fields, 2 * n[None, :], d[:, None], (n < N)[None, :], sds, sss, shs, KIND)
        tl.store(out + h * N * HD + n[None, :] * HD + d[:, None], v.to(tl.float32))
    else:
        v = kv_tile(*fields, 2 * n[:, None], d[None, :], (n < N)[:, None], sds, sss, shs, KIND)
        tl.store(out + h * N * HD + n[:, None] * HD + d[None, :], v.to(tl.float32))


@pytest.mark.parametrize("kind", KV_TYPES)
@pytest.mark.parametrize("trans", [False, True])
def test_kv_tile_loads_dequantized_values(kind, trans):
    plane = quantize(torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(2)), kind)
    out = torch.empty(2, 16, 64)
    args = plane_args(plane)
    _tiles_kernel[(2,)](*args[:3], out, *args[3:9], N=16, HD=64, KIND=args[9], TRANS=trans)
    assert torch.equal(out, dequantize(plane)[:, ::2])
