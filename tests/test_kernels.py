"""Quantized-matmul kernels on CPU, through Triton's interpreter (inline PTX by its integer emulation).

References: gguf-py-exact dequantization (flashtree.quant.dequant, itself tested against gguf-py) and
plain-torch int8 activation quantization (qmatmul.quantize_activations_reference). The kernels' math
redone in fp64 from those (qmatmul.reference_matmul: the int8-quantized x times the exactly dequantized
weights) must match to fp32 rounding; against the plain fp64 x @ W^T they differ by the int8 activation
error. The same checks, in bf16 and with the PTX, run on the GPU in bench/gpu_kernels.py.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton.jit runs: the kernels then execute on CPU tensors

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from spec_util import feed

from flashtree.errors import FlashtreeError
from flashtree.kernels import qmatmul
from flashtree.kernels.qlinear import QuantLinear
from flashtree.kernels.qmatmul import (
    dequantize_packed,
    k_splits,
    layout,
    quant_matmul,
    quantize_activations,
    quantize_activations_reference,
    reference_matmul,
    repack,
    unpack,
)
from flashtree.kernels.tiles import DEFAULT_TILES, KernelConfig, TileConfig
from flashtree.quant.dequant import dequantize
from flashtree.quant.formats import QT
from flashtree.quant.pack import quantize, random_blocks

TYPES = [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0, QT.Q4_0, QT.Q4_1]
# (rows, cols), rows not a multiple of any tile. k-quants: 2 super-blocks = 2 K-splits. Legacy widths:
# units of 8, 2 and 1 blocks, in 1, 9 and 3 K-splits.
LEGACY_SHAPES = [(37, 256), (21, 576), (19, 96)]
MATMUL_SHAPES = {
    QT.Q4_K: (37, 512), QT.Q5_K: (37, 512), QT.Q6_K: (37, 512),
    QT.Q4_0: (37, 256), QT.Q8_0: (21, 576), QT.Q4_1: (19, 96),
}  # fmt: skip
M_VALUES = (1, 5, 16, 23, 33, 64)  # dp4a; tensor cores: m16 (5, 16), m32 (23), m64 (33, 64)
EXACT_TOL = 1e-6  # the kernels vs their own math in fp64: fp32 rounding only
INT8_TOL = 1e-2  # vs the plain fp64 x @ W^T: the int8 activations' rounding, ~5e-3 of y for Gaussian x
BF16_TOL = 1e-2  # the bf16 arithmetic vs x_bf16 @ W^T: the weights' bf16 decoding, measured <= 6.4e-3


def shapes(qtype):
    return [MATMUL_SHAPES[qtype]] if qtype.name.endswith("_K") else LEGACY_SHAPES


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
        assert qmatmul.packed_bytes(fields) == raw.numel()  # not a byte more
        assert torch.equal(unpack(fields, qtype, cols), raw)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kernel_dequantizer_matches_reference(qtype):
    for rows, cols in shapes(qtype):
        raw, ref = case(qtype, rows, cols)
        got = dequantize_packed(repack(raw, qtype, cols), qtype, rows, cols, torch.float32)
        assert torch.equal(got.double(), ref)  # the reference's float ops, bit for bit


def test_activation_quantizer_matches_torch():
    scales = torch.tensor([[1.0], [1e-3], [40.0]])
    x = torch.randn(3, 160, generator=torch.Generator().manual_seed(0)) * scales  # (3, 5 blocks of 32)
    x[1, 32:64] = 0  # an all-zero block: codes 0, dx 0
    x[2, 64:96] *= 1e-40  # a subnormal block: 127 / amax floored, so codes 0 rather than overflows
    for dtype in (torch.float32, torch.bfloat16):
        codes, dx = quantize_activations_reference(x.to(dtype))
        act = quantize_activations(x.to(dtype), rows=4)  # a zero row of padding
        got_codes = act.codes.view(torch.int8).view(4, 5, 32).float()  # (rows, blocks, 32)
        assert torch.equal(got_codes[:3], codes) and not got_codes[3].any()
        assert torch.equal(act.scales.t()[:3], dx) and not act.scales[:, 3].any()
        half_sums = codes.view(3, 5, 2, 16).sum(-1).int()  # (rows, blocks, 2)
        assert torch.equal(act.code_sums.transpose(0, 1)[:3], half_sums) and not act.code_sums[:, 3].any()
    assert codes.abs().max() == 127 and dx[1, 1] == 0 and not codes[2, 2].any()


@triton.jit
def _dp4a_kernel(a_ptr, b_ptr, c_ptr, out_ptr, A_SIGNED: tl.constexpr):
    i = tl.arange(0, 256)
    out = qmatmul._dp4a(tl.load(a_ptr + i), tl.load(b_ptr + i), tl.load(c_ptr + i), A_SIGNED, False)
    tl.store(out_ptr + i, out)


@pytest.mark.parametrize("signed", [False, True], ids=["u8xs8", "s8xs8"])
def test_dp4a_emulation_matches_numpy(signed):
    rng = np.random.default_rng(int(signed))
    a, b = (rng.integers(-(2**31), 2**31, 256, dtype=np.int64).astype(np.int32) for _ in range(2))
    c = rng.integers(-(2**20), 2**20, 256).astype(np.int32)
    out = torch.empty(256, dtype=torch.int32)
    _dp4a_kernel[(1,)](*(torch.from_numpy(v) for v in (a, b, c)), out, A_SIGNED=signed)
    a_bytes = a.view(np.int8 if signed else np.uint8).reshape(256, 4).astype(np.int64)
    expected = c + (a_bytes * b.view(np.int8).reshape(256, 4)).sum(1)
    assert np.array_equal(out.numpy(), expected)


@pytest.fixture(scope="module", params=TYPES, ids=lambda t: t.name)
def matmul_case(request):
    """One weight per type, x (64, cols), and quant_matmul of x[:M] for every M in M_VALUES plus of
    three more single rows (the M = 1 path on rows the tensor-core calls also produce)."""
    qtype = request.param
    rows, cols = MATMUL_SHAPES[qtype]
    raw, w = case(qtype, rows, cols)
    fields = repack(raw, qtype, cols)
    x = torch.randn(64, cols, generator=torch.Generator().manual_seed(1))
    prefix = {m: quant_matmul(x[:m], fields, qtype, rows, cols) for m in M_VALUES}
    single = {i: quant_matmul(x[i : i + 1], fields, qtype, rows, cols) for i in (4, 32, 63)}
    return qtype, raw, w, x, prefix, single | {0: prefix[1]}


def test_quant_matmul_matches_its_math_and_the_plain_product(matmul_case):
    qtype, raw, w, x, prefix, _ = matmul_case
    rows, cols = w.shape
    exact = reference_matmul(x, raw, qtype, rows, cols)
    for m, y in prefix.items():
        assert y.shape == (m, rows) and y.dtype == torch.float32
        assert rel_err(y, exact[:m]) < EXACT_TOL, (qtype.name, m)
        assert rel_err(y, x[:m].double() @ w.t()) < INT8_TOL, (qtype.name, m)


def test_quant_matmul_is_batch_invariant(matmul_case):
    """Row i of an M-row call equals, bit for bit, a call on that row alone or any other prefix of rows."""
    _, _, _, _, prefix, single = matmul_case
    for m, y in prefix.items():
        assert torch.equal(y, prefix[64][:m]), m
    for i, y in single.items():
        assert torch.equal(y[0], prefix[64][i]), i


def test_bf16_batch_invariance_and_error():
    rows, cols = 37, 512
    raw, w = case(QT.Q4_K, rows, cols)
    fields = repack(raw, QT.Q4_K, cols)
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(2)).bfloat16()
    y = quant_matmul(x, fields, QT.Q4_K, rows, cols)
    assert y.dtype == torch.bfloat16
    assert torch.equal(quant_matmul(x[3:4], fields, QT.Q4_K, rows, cols)[0], y[3])
    assert rel_err(y, x.double() @ w.t()) < INT8_TOL


@pytest.fixture(scope="module", params=TYPES, ids=lambda t: t.name)
def bf16_case(request):
    """matmul_case in the bf16 arithmetic (weights decoded to bf16, bf16 tensor-core dots)."""
    qtype = request.param
    rows, cols = MATMUL_SHAPES[qtype]
    raw, w = case(qtype, rows, cols)
    fields = repack(raw, qtype, cols)
    x = torch.randn(64, cols, generator=torch.Generator().manual_seed(1))
    prefix = {m: quant_matmul(x[:m], fields, qtype, rows, cols, "bf16") for m in M_VALUES}
    single = {i: quant_matmul(x[i : i + 1], fields, qtype, rows, cols, "bf16") for i in (4, 32, 63)}
    return qtype, w, x, prefix, single | {0: prefix[1]}


def test_bf16_arithmetic_matches_the_plain_product(bf16_case):
    """Against x (rounded to bf16, as the kernel reads it) @ W^T in fp64: the weights' bf16 decoding
    (scale and shift rounded to bf16, then each weight) is the only error, ~2-7e-3 of y here."""
    qtype, w, x, prefix, _ = bf16_case
    for m, y in prefix.items():
        assert y.shape == (m, w.shape[0]) and y.dtype == torch.float32
        assert rel_err(y, x[:m].bfloat16().double() @ w.t()) < BF16_TOL, (qtype.name, m)


def test_bf16_arithmetic_is_batch_invariant(bf16_case):
    """One kernel for every M, M = 1 included: each row equals its row of the 64-row call bit for bit."""
    _, _, _, prefix, single = bf16_case
    for m, y in prefix.items():
        assert torch.equal(y, prefix[64][:m]), m
    for i, y in single.items():
        assert torch.equal(y[0], prefix[64][i]), i


def test_choose_arithmetic():
    """bf16 for speculative decoding, int8 for plain decoding, unless the settings say."""
    assert KernelConfig().arithmetic_for(speculative=True) == "bf16"
    assert KernelConfig().arithmetic_for(speculative=False) == "int8"
    assert KernelConfig(arithmetic="int8").arithmetic_for(speculative=True) == "int8"
    assert KernelConfig(arithmetic="bf16").arithmetic_for(speculative=False) == "bf16"
    with pytest.raises(FlashtreeError, match="arithmetic 'fp8'"):
        KernelConfig(arithmetic="fp8")


def test_engine_load_sets_the_arithmetic_on_the_packed_weights(monkeypatch, tmp_path):
    """Engine.load runs the target's packed matrices (and so the draft's shared LM head) in bf16 when it
    decodes speculatively, int8 when it does not, unless its settings name one."""
    from spec_util import random_draft_dir

    from flashtree.convert.synth import synth_model
    from flashtree.engine.generate import Engine
    from flashtree.kernels.qlinear import arithmetic_of, use_arithmetic
    from flashtree.models import loader
    from flashtree.settings import Settings

    monkeypatch.setattr(loader, "default_quantized", lambda device, gguf: True)  # packed on CPU too
    target = tmp_path / "tiny.gguf"
    synth_model("tiny-qwen35", "q4_k_m", target, seed=3)
    draft = random_draft_dir(target, tmp_path)
    engine = Engine.load(target, draft, max_ctx=64, device="cpu", settings=Settings())
    assert arithmetic_of(engine.target) == "bf16"
    assert arithmetic_of(Engine.load(target, draft, mode="ar", max_ctx=64, device="cpu").target) == "int8"
    assert arithmetic_of(Engine.load(target, "none", max_ctx=64, device="cpu").target) == "int8"
    forced = Settings(kernels=KernelConfig(arithmetic="bf16"))
    plain = Engine.load(target, "none", max_ctx=64, device="cpu", settings=forced)
    assert arithmetic_of(plain.target) == "bf16"
    assert use_arithmetic(engine.target, "int8") >= 4 * engine.target.config.n_layers
    with pytest.raises(FlashtreeError, match="unknown arithmetic 'fp8'"):
        use_arithmetic(engine.target, "fp8")


@pytest.mark.parametrize(
    "units,splits,per_split,fused_sum",
    [(9, 2, 5, 1), (9, 2, 5, 0), (9, 3, 3, 1), (9, 9, 1, 1), (9, 9, 1, 0), (20, 20, 1, 1), (20, 20, 1, 0),
     (35, 18, 2, 0)],
)  # fmt: skip
def test_uneven_k_splits_and_unrolled_units(units, splits, per_split, fused_sum):
    """Splits of unequal length (2: 5 and 4 units), walked 3 units per step and the rest one by one, give
    the same math, bit for bit the same across M, whether the K-splits are added by the last program of
    each row tile (split 0, then 8 at a time: 2, 3, 9, 18 and 20 splits leave 1, 2, 0, 1 and 3 for a last
    round; its counter back at zero for the next call) or by a second kernel."""
    rows, cols = 21, 64 * units  # Q8_0: units of 2 blocks
    assert k_splits(rows, units, splits * rows) == (splits, per_split)
    tile = TileConfig(32, 1, 1, 3, fused_sum)
    split_target = {qmatmul.split_key("int8", QT.Q8_0, rows, cols): splits * rows}
    kernels = KernelConfig(tiles={**DEFAULT_TILES, "m1": tile, "m16": tile}, splits=split_target)
    raw, _ = case(QT.Q8_0, rows, cols)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(3))
    fields = repack(raw, QT.Q8_0, cols)
    y = quant_matmul(x, fields, QT.Q8_0, rows, cols, kernels=kernels)
    assert rel_err(y, reference_matmul(x, raw, QT.Q8_0, rows, cols)) < EXACT_TOL
    assert torch.equal(quant_matmul(x[1:2], fields, QT.Q8_0, rows, cols, kernels=kernels)[0], y[1])
    assert not qmatmul.tile_counters(x.device, 1).any()


@pytest.mark.parametrize("block,warps", [(128, 2), (1024, 4), (256, 8)])
def test_the_summing_launch_adds_splits_in_order_whatever_its_block(block, warps):
    """sum_splits: y = split 0 + split 1 + ... in fp32, in that order (as the last program of a tile adds
    them), for any block and warps the launch takes (bench/gpu_sum_splits.py sweeps them): 20 splits
    (rounds of 8, a ragged last one) over 3 x 300 sums, a last block only partly inside."""
    parts = torch.randn(20, 3, 300, generator=torch.Generator().manual_seed(5))
    want = parts[0].clone()
    for split in parts[1:]:
        want += split
    y = torch.empty(3, 300)
    qmatmul.sum_splits(y, parts, block, warps)
    assert torch.equal(y, want)


def test_a_matrix_may_have_its_own_split_target(monkeypatch):
    """A per-matrix target (FLASHTREE_QMM_SPLITS) sets that matrix's split count, the same for every M:
    the math and batch invariance hold, and other matrices keep SPLIT_TARGET."""
    rows, cols = 21, 576  # Q8_0: 9 units of 2 blocks; SPLIT_TARGET alone gives 9 splits
    raw, _ = case(QT.Q8_0, rows, cols)
    fields = repack(raw, QT.Q8_0, cols)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(4))
    launched = []
    real_k_splits = qmatmul.k_splits
    monkeypatch.setattr(qmatmul, "k_splits", lambda *a: launched.append(real_k_splits(*a)) or launched[-1])
    kernels = KernelConfig(splits={qmatmul.split_key("int8", QT.Q8_0, rows, cols): 2 * rows})
    y = quant_matmul(x, fields, QT.Q8_0, rows, cols, "int8", kernels=kernels)
    one = quant_matmul(x[1:2], fields, QT.Q8_0, rows, cols, "int8", kernels=kernels)
    assert launched == [(2, 5), (2, 5)]
    assert rel_err(y, reference_matmul(x, raw, QT.Q8_0, rows, cols)) < EXACT_TOL
    assert torch.equal(one[0], y[1])
    quant_matmul(x[:1], fields, QT.Q8_0, rows, cols, "bf16", kernels=kernels)  # another arithmetic: default
    assert launched[-1] == (9, 1)


def test_k_splits_depend_on_the_shape_only():
    assert k_splits(248320, 20) == (1, 20)  # the 27B output matrix: enough rows
    assert k_splits(5120, 68) == (23, 3)  # its ffn_down: 25 splits wanted, 3 units each
    assert k_splits(1024, 20) == (20, 1)  # never more splits than units


def test_every_row_and_column_counts():
    """A weight that is zero except one element finds exactly that element's row and column."""
    rows, cols = 37, 512
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(0))
    codes, dx = quantize_activations_reference(x)
    x_int8 = (codes * dx[..., None]).view(5, cols)  # what the kernels multiply
    for qtype in (QT.Q8_0, QT.Q4_0):  # types that can encode an isolated value (symmetric codes)
        w = torch.zeros(rows, cols)
        w[29, 301] = 1.0
        raw = torch.from_numpy(quantize(w, qtype))
        stored = dequantize(raw, qtype, (rows, cols))[29, 301]  # 1 within fp16 rounding of the scale
        for m in (1, 5):
            y = quant_matmul(x[:m], repack(raw, qtype, cols), qtype, rows, cols)
            expected = torch.zeros(m, rows)
            expected[:, 29] = x_int8[:m, 301] * stored
            torch.testing.assert_close(y, expected, rtol=1e-6, atol=0)


def test_large_m_dequantizes_then_matmuls():
    rows, cols, m = 37, 512, qmatmul.MAX_FUSED_M + 3
    raw, w = case(QT.Q4_K, rows, cols)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(1))
    y = quant_matmul(x, repack(raw, QT.Q4_K, cols), QT.Q4_K, rows, cols)
    assert rel_err(y, x.double() @ w.t()) < 1e-5  # exact weights, fp32 matmul


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


def test_layout_units_and_fields():
    assert layout(QT.Q4_0, 256).group == 8
    assert layout(QT.Q4_0, 576).group == 2  # 18 blocks: SmolLM2's width
    assert layout(QT.Q8_0, 96).group == 1
    assert layout(QT.Q4_K, 512).values == 256
    assert [f.name for f in layout(QT.Q6_K, 256).fields] == ["q", "qh", "hdr", "d"]
    with pytest.raises(FlashtreeError, match="Q5_0"):
        layout(QT.Q5_0, 256)


def test_a_type_may_have_its_own_tile_in_a_bucket(monkeypatch):
    """A "BUCKET:TYPE" tile is launched for that type's products in that bucket only; the values are those
    of the default tiles, bit for bit, and rows stay batch-invariant across buckets."""
    rows, cols = 37, 512
    raw, _ = case(QT.Q6_K, rows, cols)
    fields = repack(raw, QT.Q6_K, cols)
    x = torch.randn(23, cols, generator=torch.Generator().manual_seed(5))
    before = quant_matmul(x, fields, QT.Q6_K, rows, cols, "bf16")
    own = TileConfig(16, 4, 1, 1, 0)
    kernels = KernelConfig(tiles={**DEFAULT_TILES, "b32:Q6_K": own})
    assert qmatmul.tile_for(23, "bf16", QT.Q6_K, kernels) == own
    assert qmatmul.tile_for(23, "bf16", QT.Q4_K, kernels) == DEFAULT_TILES["b32"]
    assert qmatmul.tile_for(16, "bf16", QT.Q6_K, kernels) == DEFAULT_TILES["b16"]
    after = quant_matmul(x, fields, QT.Q6_K, rows, cols, "bf16", kernels=kernels)
    assert torch.equal(after, before)
    one = quant_matmul(x[7:8], fields, QT.Q6_K, rows, cols, "bf16", kernels=kernels)
    assert torch.equal(one[0], after[7])


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
    # per layer at least: the merged input projections, the output projection, gate+up, down
    assert sum(isinstance(m, QuantLinear) for m in packed.modules()) >= 4 * dense.config.n_layers
    ids = torch.randint(0, dense.config.vocab, (12,), generator=torch.Generator().manual_seed(0))
    expected = dense(ids, dense.new_state(16)).logits
    torch.testing.assert_close(packed(ids, packed.new_state(16)).logits, expected, rtol=0, atol=0)


def test_a_producers_quantization_replaces_the_matmuls_own(monkeypatch, kernels_path):
    """quant_matmul(act=...) for one row gives the bits of quantizing x itself; a QuantLinear handed a
    MatmulInput uses its int8 form (no quantization of its own) and gives the same bits; a plain tensor
    comes without one."""
    from flashtree.kernels.qmatmul import MatmulInput

    rows, cols = 40, 256
    raw, _ = case(QT.Q4_K, rows, cols)
    fields = repack(raw, QT.Q4_K, cols)
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(5))
    act = quantize_activations(x)
    y = quant_matmul(x, fields, QT.Q4_K, rows, cols, "int8", act)
    assert torch.equal(y, quant_matmul(x, fields, QT.Q4_K, rows, cols, "int8"))
    assert MatmulInput.of(x) == (x, None) and MatmulInput.of(MatmulInput(x, act)).int8 is act
    layer = QuantLinear(raw, QT.Q4_K, (rows, cols))
    assert layer.takes_int8
    kernels_path("triton")
    quantized = []
    real = qmatmul.quantize_activations
    monkeypatch.setattr(qmatmul, "quantize_activations", lambda *a: quantized.append(1) or real(*a))
    assert torch.equal(layer(MatmulInput(x, act)), y) and not quantized
    assert torch.equal(layer(x), y) and len(quantized) == 1


def test_the_norms_quantization_inside_a_packed_model(monkeypatch, kernels_path, tmp_path):
    """Every kernel inside a packed tiny qwen35 (DeltaNet and gated attention layers), int8: an AR step gives
    the same logits bit for bit whether the norms, SwiGLU's activation and the attention output gate
    quantize the matmuls' one-token inputs (asked by each matmul's takes_int8) or the matmuls do, and with
    them no matmul of an AR step quantizes its input itself."""
    from flashtree.convert.synth import synth_model
    from flashtree.models.loader import load_target

    path = tmp_path / "tiny.gguf"
    synth_model("tiny-qwen35", "q4_k_m", path, seed=3)
    model, _ = load_target(path, device="cpu", quantized=True)
    kernels_path("triton")
    ids = torch.randint(0, model.config.vocab, (4,), generator=torch.Generator().manual_seed(1))
    quantized = []
    real = qmatmul.quantize_activations
    monkeypatch.setattr(qmatmul, "quantize_activations", lambda *a: quantized.append(1) or real(*a))

    def ar_logits() -> torch.Tensor:  # one AR step after a prefill (the interpreter's steps are slow)
        state = model.new_state(16)
        with torch.no_grad():
            feed(model, ids[:3], state, logits="none")
            quantized.clear()
            return feed(model, ids[3:], state).logits

    fused = ar_logits()
    fused_count = len(quantized)
    monkeypatch.setattr(QuantLinear, "takes_int8", False)  # no producer is asked for the int8 form
    assert torch.equal(ar_logits(), fused)
    assert any(not hasattr(layer.mixer, "in_proj") for layer in model.layers)  # gated attention too
    assert fused_count == 0 < len(quantized)
