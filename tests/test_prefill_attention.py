"""kernels/prefill_attention.py on CPU through Triton's interpreter: a prefill chunk's causal attention
over the cache (its own K/V already written) equals the masked softmax of the torch path, with and
without a window, for GQA groups of 1, 3 and 6 query heads, head sizes that are and are not powers of
two, chunks that start at 0 and past several key tiles, and tiles smaller than the chunk (many row
blocks, shared tiles and causal-edge tiles)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are compiled: run them on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flashtree.kernels import prefill_attention as pa  # noqa: E402

# (kv heads, query heads, head_dim, chunk start, chunk tokens, cache slots)
SHAPES = {
    "first-chunk": (2, 6, 32, 0, 45, 64),
    "later-chunk": (1, 6, 16, 150, 37, 200),
    "mha-odd-head": (3, 3, 24, 70, 30, 128),
    "smollm2-group": (1, 3, 64, 20, 50, 80),
}
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
# fp32: rounding order only (and exp2 for exp); bf16: q, K, V, p as bf16 operands and the output's cast
TOL = {"f32": 1e-5, "bf16": 2e-2}


def case(shape, dtype, seed=0):
    n_kv, n_heads, hd, start, t, slots = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(n_kv, slots, hd, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(t, n_heads, hd, generator=gen).to(dtype)
    return q, k, v, start


def reference(q, k, v, start, window=0):
    """The torch path's masked SDPA in fp32: row t sees keys 0 .. start + t (within the window)."""
    t, hd = q.shape[0], q.shape[-1]
    pos = start + torch.arange(t)[:, None]
    key = torch.arange(start + t)[None, :]
    mask = key <= pos
    if window:
        mask &= key > pos - window
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], k[None, :, : start + t].float(), v[None, :, : start + t].float(),
        attn_mask=mask, scale=hd**-0.5, enable_gqa=True,
    )  # fmt: skip
    return out[0].transpose(0, 1)


@pytest.fixture(params=["default", "small"])
def tile(request):
    """The default tiles (None), or 16-query, 16-key tiles: many row blocks and key tiles in one chunk."""
    return (16, 16, 4) if request.param == "small" else None


@pytest.mark.parametrize("window", [0, 1, 7, 40], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_prefill_attention_is_the_causal_masked_softmax(shape, dtype, window, tile):
    q, k, v, start = case(shape, DTYPES[dtype])
    got = pa.prefill_attention(q, k, v, start, q.shape[-1] ** -0.5, window, tile)
    assert got.dtype == q.dtype and got.shape == q.shape
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), reference(q, k, v, start, window), rtol=tol, atol=tol)


def test_keys_past_the_chunk_are_never_read():
    """Slots past start + T hold NaN (unused capacity): no output row sees them."""
    q, k, v, start = case("later-chunk", torch.float32)
    t = q.shape[0]
    k[:, start + t :], v[:, start + t :] = float("nan"), float("nan")
    got = pa.prefill_attention(q, k, v, start, q.shape[-1] ** -0.5)
    torch.testing.assert_close(got, reference(q, k, v, start), rtol=1e-5, atol=1e-5)


def test_a_window_wider_than_the_context_is_full_attention():
    q, k, v, start = case("later-chunk", torch.float32)
    scale = q.shape[-1] ** -0.5
    full = pa.prefill_attention(q, k, v, start, scale)
    torch.testing.assert_close(pa.prefill_attention(q, k, v, start, scale, window=10_000), full)


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "tq3_0"])
@pytest.mark.parametrize("shape", ["first-chunk", "smollm2-group"])
def test_a_quantized_cache_is_read_as_its_dequantized_values(shape, kind):
    """K and V quantized (quant/kv.py): the kernel reads them in-kernel and computes the attention of
    their dequantized values (tq3_0's rotated: q rotated to read K, the output rotated back), in fp32."""
    from flashtree.quant.kv import dequantize, quantize, rotate, unrotate

    q, k, v, start = case(shape, torch.float32, seed=3)
    k_plane, v_plane = quantize(k, kind), quantize(v, kind)
    got = pa.prefill_attention(q, k_plane, v_plane, start, q.shape[-1] ** -0.5, window=9)
    rotated = kind == "tq3_0"
    want = reference(rotate(q) if rotated else q, dequantize(k_plane), dequantize(v_plane), start, 9)
    torch.testing.assert_close(got, unrotate(want) if rotated else want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("start", [0, 150])
@pytest.mark.parametrize("kinds", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("tq3_0", "tq3_0"), ("f32", "q8_0")])
def test_a_quantized_cache_is_read_through_slabs(kinds, start):
    """Without a window, a quantized cache's keys are unpacked into values: the chunk's own (from the
    16-key tile edge below its start) read causally, the earlier ones through slabs (here of 32 keys: 5
    below start 150), merged by log-sum-exp: still the attention of the dequantized cache."""
    from flashtree.quant.kv import dequantize, quantize, rotate, unrotate

    gen = torch.Generator().manual_seed(11)
    n_kv, n_heads, hd, t = 2, 6, 64, 37
    k, v = (torch.randn(n_kv, 200, hd, generator=gen) for _ in range(2))
    q = torch.randn(t, n_heads, hd, generator=gen)
    k_plane, v_plane = quantize(k, kinds[0]), quantize(v, kinds[1])
    slab = 32 * 2 * n_kv * hd * 4  # bytes of 32 keys' K and V values in fp32
    got = pa.prefill_attention(q, k_plane, v_plane, start, hd**-0.5, tile=(16, 16, 4), slab_bytes=slab)
    rot_k, rot_v = kinds[0] == "tq3_0", kinds[1] == "tq3_0"
    want = reference(rotate(q) if rot_k else q, dequantize(k_plane), dequantize(v_plane), start)
    torch.testing.assert_close(got, unrotate(want) if rot_v else want, rtol=1e-5, atol=1e-5)
