"""GGML dequantizers and packers against gguf-py's numpy reference, and the q4_k_m recipe."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from gguf import quants as ref

from flashtree.errors import FlashtreeError
from flashtree.quant.dequant import dequantize, k_scales_mins
from flashtree.quant.formats import SUPPORTED_TYPES, row_bytes, type_name
from flashtree.quant.pack import PACKABLE_TYPES, pack_k_scales, quantize, random_blocks
from flashtree.quant.recipe import q4_k_m_types, recipe_types, use_more_bits

ALL_TYPES = sorted(QT(t) for t in SUPPORTED_TYPES)
PACKABLE = sorted(QT(t) for t in PACKABLE_TYPES)
LEGACY = [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1]
K_QUANTS = [QT.Q4_K, QT.Q5_K, QT.Q6_K]

# byte offsets of the fp16 scale fields in each block type (random bytes there could be NaN/Inf)
F16_FIELDS = {
    QT.Q8_0: (0,),
    QT.Q4_0: (0,),
    QT.Q5_0: (0,),
    QT.Q4_1: (0, 2),
    QT.Q5_1: (0, 2),
    QT.Q4_K: (0, 2),
    QT.Q5_K: (0, 2),
    QT.Q6_K: (208,),
}


def random_raw(qtype: QT, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random packed bytes (rows, row_bytes): all bits random except finite fp16 scales."""
    if qtype in (QT.F32, QT.F16):
        dtype = np.float32 if qtype == QT.F32 else np.float16
        return (rng.standard_normal((rows, cols)) * 3).astype(dtype).view(np.uint8)
    if qtype == QT.BF16:  # any bf16 bit pattern with a finite exponent
        bits = rng.integers(0, 1 << 16, (rows, cols), dtype=np.uint16)
        bits[(bits & 0x7F80) == 0x7F80] &= 0xBFFF
        return bits.view(np.uint8)
    block_values, n_bytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block_values, n_bytes), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        scales = (rng.standard_normal(len(blocks)) * 0.05).astype(np.float16)
        blocks[:, at : at + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=type_name)
def test_dequantize_is_bit_exact_against_gguf_py(qtype):
    """Tolerance 0: every value equals gguf-py's numpy dequantizer bit for bit."""
    raw = random_raw(qtype, 6, 512, np.random.default_rng(int(qtype)))
    expected = ref.dequantize(raw, qtype).reshape(2, 3, 512)
    got = dequantize(torch.from_numpy(raw), qtype, (2, 3, 512))
    assert got.dtype == torch.float32 and got.shape == (2, 3, 512)
    np.testing.assert_array_equal(got.numpy(), expected)


def test_dequantize_to_other_dtypes_rounds_the_float32_result():
    raw = random_raw(QT.Q4_K, 2, 256, np.random.default_rng(0))
    full = dequantize(torch.from_numpy(raw), QT.Q4_K, (2, 256))
    for dtype in (torch.float16, torch.bfloat16):
        assert torch.equal(dequantize(torch.from_numpy(raw), QT.Q4_K, (2, 256), dtype), full.to(dtype))


def test_dequantize_rejects_unsupported_types_and_wrong_sizes():
    raw = torch.zeros(2, 110, dtype=torch.uint8)
    with pytest.raises(FlashtreeError, match="unsupported tensor type Q2_K"):
        dequantize(raw, QT.Q2_K, (2, 256))
    with pytest.raises(FlashtreeError, match="does not fit shape"):
        dequantize(torch.zeros(2, 144, dtype=torch.uint8), QT.Q4_K, (2, 512))


def test_k_scale_packing_round_trips_every_6_bit_pair():
    grid = torch.arange(64)
    sc, mn = torch.meshgrid(grid, grid, indexing="ij")  # all 4096 (scale, min) pairs
    sc, mn = sc.reshape(-1, 8), mn.reshape(-1, 8)
    got_sc, got_mn = k_scales_mins(pack_k_scales(sc, mn))
    assert torch.equal(got_sc.long(), sc) and torch.equal(got_mn.long(), mn)


@pytest.mark.parametrize("qtype", [*LEGACY, QT.F16, QT.BF16], ids=type_name)
def test_legacy_packers_produce_gguf_py_bytes(qtype):
    x = np.random.default_rng(1).standard_normal((16, 256)).astype(np.float32)
    x[0, :32] = 0  # an all-zero block takes the d == 0 path
    expected = ref.quantize(x, qtype).view(np.uint8).reshape(16, -1)
    np.testing.assert_array_equal(quantize(x, qtype), expected)


def _step_and_error(x: np.ndarray, qtype: QT) -> tuple[np.ndarray, np.ndarray]:
    """Per sub-block: the format's natural quantization step for x, and the max round-trip error."""
    err = np.abs(ref.dequantize(quantize(torch.from_numpy(x), qtype), qtype) - x)
    if qtype == QT.Q6_K:  # 16 values, symmetric codes [-32, 31] over max |x|
        sub = x.reshape(-1, 16)
        return np.abs(sub).max(1) / 32, err.reshape(-1, 16).max(1)
    sub = x.reshape(-1, 32)  # Q4_K/Q5_K sub-blocks and all legacy blocks have 32 values
    if qtype in (QT.Q4_0, QT.Q5_0, QT.Q8_0):  # symmetric codes over max |x|
        half_levels = {QT.Q4_0: 8, QT.Q5_0: 16, QT.Q8_0: 127}[qtype]
        return np.abs(sub).max(1) / half_levels, err.reshape(-1, 32).max(1)
    levels = {QT.Q4_1: 15, QT.Q5_1: 31, QT.Q4_K: 15, QT.Q5_K: 31}[qtype]
    low = sub.min(1) if qtype in (QT.Q4_1, QT.Q5_1) else np.minimum(sub.min(1), 0)  # k-quant mins are <= 0
    return (sub.max(1) - low) / levels, err.reshape(-1, 32).max(1)


# Max round-trip error in units of the step above. Legacy: half a step, or a whole one on the side of
# Q4_0/Q5_0's asymmetric code range, plus fp16 rounding of the scales. K-quants: the sub-block scales are
# stored with 6 (Q4_K/Q5_K) or 8 (Q6_K) bits relative to the largest one, so their range can fall short
# of the data by that rounding; 1.5 steps bounds it on Gaussian data.
STEP_BOUND = {QT.Q8_0: 0.6, QT.Q4_0: 1.01, QT.Q5_0: 1.01, QT.Q4_1: 0.51, QT.Q5_1: 0.52}
STEP_BOUND |= {QT.Q4_K: 1.5, QT.Q5_K: 1.5, QT.Q6_K: 1.5}


@pytest.mark.parametrize("qtype", LEGACY + K_QUANTS, ids=type_name)
def test_quantize_round_trip_stays_within_the_step(qtype):
    x = np.random.default_rng(2).standard_normal((64, 1024)).astype(np.float32)
    step, err = _step_and_error(x, qtype)
    assert (err <= STEP_BOUND[qtype] * step).all(), (err / step).max()
    # the k-quant scale search must beat a plain uniform quantizer of the same step (RMS step/sqrt(12))
    if qtype in K_QUANTS:
        rms = np.sqrt(np.mean((ref.dequantize(quantize(x, qtype), qtype) - x) ** 2))
        assert rms < np.sqrt(np.mean(step**2) / 12)


@pytest.mark.parametrize(("qtype", "rel"), [(QT.F32, 0.0), (QT.F16, 2**-11), (QT.BF16, 2**-8)], ids=str)
def test_float_types_round_trip_within_their_precision(qtype, rel):
    x = torch.randn(8, 64, dtype=torch.float64).float()
    back = dequantize(torch.from_numpy(quantize(x, qtype)), qtype, (8, 64))
    assert ((back - x).abs() <= rel * x.abs()).all()


def test_quantize_accepts_torch_and_numpy_and_keeps_leading_dims():
    x = torch.randn(2, 3, 256, dtype=torch.bfloat16)
    packed = quantize(x, QT.Q6_K)
    assert packed.dtype == np.uint8 and packed.shape == (2, 3, row_bytes(QT.Q6_K, 256))
    np.testing.assert_array_equal(packed, quantize(x.float().numpy(), QT.Q6_K))


def test_quantize_rejects_bad_inputs():
    with pytest.raises(FlashtreeError, match="multiple of 256"):
        quantize(np.zeros((2, 100), np.float32), QT.Q4_K)
    with pytest.raises(FlashtreeError, match="cannot quantize to Q3_K"):
        quantize(np.zeros((2, 256), np.float32), QT.Q3_K)
    with pytest.raises(FlashtreeError, match="float values"):
        quantize(np.zeros((2, 256), np.int32), QT.Q8_0)
    with pytest.raises(FlashtreeError, match="non-finite"):
        quantize(np.full((2, 256), np.inf, np.float32), QT.F16)


@pytest.mark.parametrize("qtype", PACKABLE, ids=type_name)
def test_random_blocks_decode_to_finite_centred_values_of_the_requested_scale(qtype):
    blocks = random_blocks(qtype, 64, 1024, np.random.default_rng(3), scale=0.02)
    assert blocks.dtype == np.uint8 and blocks.shape == (64, row_bytes(qtype, 1024))
    values = dequantize(torch.from_numpy(blocks), qtype, (64, 1024))
    assert torch.isfinite(values).all()
    assert abs(values.mean()) < 0.15 * 0.02  # Q4_0/Q5_0/Q6_K codes are centred to half a step
    assert 0.8 * 0.02 < values.std() < 1.2 * 0.02
    again = random_blocks(qtype, 64, 1024, np.random.default_rng(3), scale=0.02)
    np.testing.assert_array_equal(blocks, again)


# --- q4_k_m recipe ----------------------------------------------------------------------------------

QWEN35_27B_DELTANET = {
    "attn_qkv.weight": (10240, 5120),
    "attn_gate.weight": (6144, 5120),
    "ssm_beta.weight": (48, 5120),
    "ssm_alpha.weight": (48, 5120),
    "ssm_conv1d.weight": (10240, 4),
    "ssm_dt.bias": (48,),
    "ssm_a": (48,),
    "ssm_norm.weight": (128,),
    "ssm_out.weight": (5120, 6144),
}
QWEN35_27B_ATTENTION = {
    "attn_q.weight": (12288, 5120),
    "attn_k.weight": (1024, 5120),
    "attn_v.weight": (1024, 5120),
    "attn_output.weight": (5120, 6144),
    "attn_q_norm.weight": (256,),
    "attn_k_norm.weight": (256,),
}
QWEN35_27B_COMMON = {
    "attn_norm.weight": (5120,),
    "post_attention_norm.weight": (5120,),
    "ffn_gate.weight": (17408, 5120),
    "ffn_up.weight": (17408, 5120),
    "ffn_down.weight": (5120, 17408),
}


def qwen35_27b_tensors() -> list[tuple[str, tuple[int, ...]]]:
    """The qwen35 27B GGUF tensor list (qwen35-gguf.md §1.4), in torch-order shapes."""
    tensors = [("token_embd.weight", (248320, 5120))]
    for i in range(64):
        mixer = QWEN35_27B_ATTENTION if (i + 1) % 4 == 0 else QWEN35_27B_DELTANET
        tensors += [(f"blk.{i}.{base}", shape) for base, shape in {**QWEN35_27B_COMMON, **mixer}.items()]
    return [*tensors, ("output_norm.weight", (5120,)), ("output.weight", (248320, 5120))]


def more_bits_layers(n: int) -> set[int]:
    """Layers that llama.cpp's use_more_bits picks, written out from its definition for n = 64 / 32."""
    first, last = n // 8, 7 * n // 8
    return set(range(first)) | set(range(last, n)) | {i for i in range(first, last) if (i - first) % 3 == 2}


def test_use_more_bits_matches_its_definition():
    assert {i for i in range(64) if use_more_bits(i, 64)} == more_bits_layers(64)
    assert sorted(more_bits_layers(32))[:8] == [0, 1, 2, 3, 6, 9, 12, 15]


def test_q4_k_m_on_qwen35_27b_follows_llama_cpp():
    tensors = qwen35_27b_tensors()
    types = q4_k_m_types(tensors, 64)
    assert list(types) == [name for name, _ in tensors]
    assert types["output.weight"] == QT.Q6_K and types["token_embd.weight"] == QT.Q4_K
    more = more_bits_layers(64)
    assert len(more) == 32
    for i in range(64):
        bumped = QT.Q6_K if i in more else QT.Q4_K
        # one attn_v-like tensor per layer (attn_qkv or attn_v), so the running count is the layer index
        v_name = f"blk.{i}.attn_v.weight" if (i + 1) % 4 == 0 else f"blk.{i}.attn_qkv.weight"
        assert types[v_name] == bumped, v_name
        assert types[f"blk.{i}.ffn_down.weight"] == bumped
    for name, shape in tensors:
        base = name.split(".", 2)[-1] if name.startswith("blk.") else name
        if len(shape) == 1 or base == "ssm_conv1d.weight":
            assert types[name] == QT.F32, name
        elif base in (
            "attn_q.weight",
            "attn_k.weight",
            "attn_output.weight",
            "attn_gate.weight",
            "ssm_out.weight",
            "ssm_alpha.weight",
            "ssm_beta.weight",
            "ffn_gate.weight",
            "ffn_up.weight",
        ):
            assert types[name] == QT.Q4_K, name
    n_q6 = sum(t == QT.Q6_K for t in types.values())
    assert n_q6 == 1 + 32 + 32  # output + attn_v-like + ffn_down


def llama_tensors(n_layers: int, hidden: int, ffn: int, vocab: int, tied: bool):
    tensors = [("token_embd.weight", (vocab, hidden))]
    for i in range(n_layers):
        tensors += [
            (f"blk.{i}.attn_norm.weight", (hidden,)),
            (f"blk.{i}.attn_q.weight", (hidden, hidden)),
            (f"blk.{i}.attn_k.weight", (hidden // 4, hidden)),
            (f"blk.{i}.attn_v.weight", (hidden // 4, hidden)),
            (f"blk.{i}.attn_output.weight", (hidden, hidden)),
            (f"blk.{i}.ffn_norm.weight", (hidden,)),
            (f"blk.{i}.ffn_gate.weight", (ffn, hidden)),
            (f"blk.{i}.ffn_up.weight", (ffn, hidden)),
            (f"blk.{i}.ffn_down.weight", (hidden, ffn)),
        ]
    tensors.append(("output_norm.weight", (hidden,)))
    return tensors if tied else [*tensors, ("output.weight", (vocab, hidden))]


def test_q4_k_m_on_llama_counts_in_llama_cpp_weight_order():
    # file order interleaves layers 0, 1, 10, 11, ... (as a lexicographic safetensors order would);
    # llama.cpp still counts attn_v/ffn_down by layer number
    tensors = sorted(llama_tensors(32, 4096, 14336, 32000, tied=False))
    types = q4_k_m_types(tensors, 32)
    more = more_bits_layers(32)
    for i in range(32):
        expected = QT.Q6_K if i in more else QT.Q4_K
        assert types[f"blk.{i}.attn_v.weight"] == expected
        assert types[f"blk.{i}.ffn_down.weight"] == expected
        assert types[f"blk.{i}.attn_q.weight"] == QT.Q4_K
        assert types[f"blk.{i}.ffn_norm.weight"] == QT.F32
    assert types["output.weight"] == QT.Q6_K and types["token_embd.weight"] == QT.Q4_K


def test_q4_k_m_tied_embeddings_and_rows_not_divisible_by_256():
    # SmolLM2-135M-like: hidden 576 = 2.25 x 256, tied embeddings, ffn 1536 = 6 x 256
    types = q4_k_m_types(llama_tensors(30, 576, 1536, 49152, tied=True), 30)
    assert types["token_embd.weight"] == QT.Q8_0  # the LM head: Q6_K, but 576 is not whole blocks -> Q8_0
    assert types["blk.0.attn_q.weight"] == QT.Q5_0  # Q4_K falls back to Q5_0
    assert types["blk.0.attn_v.weight"] == QT.Q8_0  # Q6_K (use_more_bits) falls back to Q8_0
    assert types["blk.4.attn_v.weight"] == QT.Q5_0
    assert types["blk.0.ffn_down.weight"] == QT.Q6_K  # rows of 1536 are whole k-blocks
    assert types["blk.4.ffn_down.weight"] == QT.Q4_K
    assert q4_k_m_types([("blk.0.attn_q.weight", (64, 40))], 1)["blk.0.attn_q.weight"] == QT.F16


def test_plain_recipes_keep_1d_norm_and_conv_tensors_f32():
    tensors = [*qwen35_27b_tensors()[:15], ("blk.0.odd.weight", (8, 40))]
    for recipe, qtype in (("f32", QT.F32), ("f16", QT.F16), ("bf16", QT.BF16), ("q8_0", QT.Q8_0)):
        types = recipe_types(recipe, tensors, 64)
        assert (
            types["blk.0.ssm_conv1d.weight"]
            == types["blk.0.ssm_a"]
            == types["blk.0.attn_norm.weight"]
            == QT.F32
        )
        assert types["blk.0.attn_qkv.weight"] == types["token_embd.weight"] == qtype
        assert types["blk.0.odd.weight"] == (QT.F16 if qtype == QT.Q8_0 else qtype)  # 40 is not 32-blocks
    assert recipe_types("q4_k_m", tensors, 64) == q4_k_m_types(tensors, 64)
    with pytest.raises(FlashtreeError, match="unknown type 'q3_k'"):
        recipe_types("q3_k", tensors, 64)
