"""Quantized-matmul kernels vs dequantize-then-matmul, on CPU through Triton's interpreter.

The reference is gguf-py-exact dequantization (flashtree.quant.dequant, itself tested against gguf-py)
followed by an fp64 matmul. Inputs are fp32 here, where the interpreter computes the kernels' exact
arithmetic in fp32 (its bf16 dot is wrong, so the tensor-core tile is kept fp32 on CPU): errors are
rounding only, ~1e-7 relative. The same checks run on the GPU, in bf16, in bench/gpu_kernels.py.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton.jit runs: the kernels then execute on CPU tensors

import numpy as np
import pytest
import torch

from flashtree.kernels import qmatmul
from flashtree.kernels.qlinear import QuantLinear
from flashtree.kernels.qmatmul import dequantize_packed, layout, quant_matmul, repack, unpack
from flashtree.quant.dequant import dequantize
from flashtree.quant.formats import QT
from flashtree.quant.pack import quantize, random_blocks

TYPES = [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0, QT.Q4_0, QT.Q4_1]
# (rows, cols): rows not a multiple of any tile; legacy widths giving 8, 2 and 1 blocks per super-block
SHAPES = {QT.Q4_K: (37, 512), QT.Q5_K: (37, 512), QT.Q6_K: (37, 512)}
LEGACY_SHAPES = [(37, 256), (21, 576), (19, 96)]
M_VALUES = (1, 5, 16, 33)
REL_TOL = 1e-5


def shapes(qtype):
    return [SHAPES[qtype]] if qtype in SHAPES else LEGACY_SHAPES


def case(qtype, rows, cols, seed=0):
    raw = torch.from_numpy(random_blocks(qtype, rows, cols, np.random.default_rng([int(qtype), rows, seed])))
    return raw, dequantize(raw, qtype, (rows, cols)).double()  # (rows, row_bytes) uint8, (rows, cols)


def rel_err(y, ref):
    return ((y.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_repack_is_lossless(qtype):
    for rows, cols in shapes(qtype):
        raw, _ = case(qtype, rows, cols)
        fields = repack(raw, qtype, cols)
        assert sum(f.numel() * f.element_size() for f in fields) == raw.numel()  # not a byte more
        assert torch.equal(unpack(fields, qtype, cols), raw)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kernel_dequantizer_matches_reference(qtype):
    for rows, cols in shapes(qtype):
        raw, ref = case(qtype, rows, cols)
        got = dequantize_packed(repack(raw, qtype, cols), qtype, rows, cols, torch.float32)
        torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_quant_matmul_matches_dequantize_then_matmul(qtype):
    for rows, cols in shapes(qtype):
        raw, w = case(qtype, rows, cols)
        fields = repack(raw, qtype, cols)
        for m in M_VALUES:
            x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
            y = quant_matmul(x, fields, qtype, rows, cols)
            assert y.shape == (m, rows) and y.dtype == torch.float32
            assert rel_err(y, x.double() @ w.t()) < REL_TOL, (qtype.name, rows, cols, m)


def test_every_row_and_column_counts():
    """A weight that is zero except one element finds exactly that element's row and column."""
    rows, cols = 37, 512
    for qtype in (QT.Q8_0, QT.Q4_0):  # types that can encode an isolated value (symmetric codes)
        w = torch.zeros(rows, cols)
        w[29, 301] = 1.0
        raw = torch.from_numpy(quantize(w, qtype))
        x = torch.randn(5, cols, generator=torch.Generator().manual_seed(0))
        y = quant_matmul(x, repack(raw, qtype, cols), qtype, rows, cols)
        expected = torch.zeros(5, rows)
        expected[:, 29] = x[:, 301]
        torch.testing.assert_close(y, expected, rtol=1e-2, atol=1e-6)


def test_large_m_dequantizes_then_matmuls():
    rows, cols, m = 37, 512, qmatmul.MAX_FUSED_M + 3
    raw, w = case(QT.Q4_K, rows, cols)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(1))
    y = quant_matmul(x, repack(raw, QT.Q4_K, cols), QT.Q4_K, rows, cols)
    assert rel_err(y, x.double() @ w.t()) < REL_TOL


def test_quant_linear_cpu_fallback_is_the_reference():
    """On a plain CPU tensor QuantLinear is dequantize + F.linear, for any leading shape."""
    rows, cols = 37, 512
    raw, w = case(QT.Q6_K, rows, cols)
    layer = QuantLinear(raw, QT.Q6_K, (rows, cols))
    assert layer.out_features == rows and layer.in_features == cols
    x = torch.randn(2, 3, cols, generator=torch.Generator().manual_seed(2))
    y = layer(x)
    assert y.shape == (2, 3, rows)
    torch.testing.assert_close(y.double(), x.double() @ w.t(), rtol=1e-5, atol=1e-6)


def test_layout_groups_legacy_blocks_by_row_width():
    assert layout(QT.Q4_0, 256).group == 8
    assert layout(QT.Q4_0, 576).group == 2  # 18 blocks: SmolLM2's width
    assert layout(QT.Q8_0, 96).group == 1
    assert layout(QT.Q4_K, 512).values == 256


def test_loader_switch_builds_quant_linears_with_the_same_logits(tmp_path):
    """quantized=True keeps every quantized matrix packed (QuantLinear); on CPU it must give the dense
    model's logits exactly, since both decode the same bytes with the same reference dequantizer."""
    from flashtree.convert.synth import synth_model
    from flashtree.models.loader import load_target

    path = tmp_path / "tiny.gguf"
    synth_model("tiny-qwen35", "q4_k_m", path, seed=3)
    dense, _ = load_target(path, device="cpu", quantized=False)
    packed, _ = load_target(path, device="cpu", quantized=True)
    assert not any(isinstance(m, QuantLinear) for m in dense.modules())
    assert sum(isinstance(m, QuantLinear) for m in packed.modules()) >= 6 * dense.config.n_layers
    ids = torch.randint(0, dense.config.vocab, (12,), generator=torch.Generator().manual_seed(0))
    expected = dense(ids, dense.new_state(16)).logits
    torch.testing.assert_close(packed(ids, packed.new_state(16)).logits, expected, rtol=0, atol=0)
