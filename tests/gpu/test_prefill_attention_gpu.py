"""The prefill attention kernel (kernels/prefill_attention.py) compiled for the GPU: a 2048-token chunk
after 3000 cached tokens, with the 27B's heads (24 query heads, 4 KV heads, 256 values) and SmolLM2's
(9, 3, 64), in the dtypes they run in, with and without a window, within rounding of SDPA's masked
softmax in fp32 over the same cache (slots past the chunk hold NaN: never read)."""

import pytest
import torch
import torch.nn.functional as F

from flashtree.kernels.prefill_attention import prefill_attention

pytestmark = pytest.mark.gpu

HEADS = {"27b": (24, 4, 256), "smollm2": (9, 3, 64)}
START, T, SLOTS = 3000, 2048, 6000
# fp32 dots are tf32x3 (~fp32); bf16: q, K, V and p as bf16 operands, the output rounded to bf16
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def reference(q, k, v, window):
    pos = START + torch.arange(T, device=q.device)[:, None]
    key = torch.arange(START + T, device=q.device)[None, :]
    mask = (key <= pos) & ((key > pos - window) if window else True)
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], k[None, :, : START + T].float(), v[None, :, : START + T].float(),
        attn_mask=mask, scale=q.shape[-1] ** -0.5, enable_gqa=True,
    )  # fmt: skip
    return out[0].transpose(0, 1)


# the models' own dtypes (the 27B in bf16, SmolLM2 in fp32 or bf16)
CASES = {"27b-bf16": ("27b", torch.bfloat16), "smollm2-f32": ("smollm2", torch.float32)}
CASES["smollm2-bf16"] = ("smollm2", torch.bfloat16)


@pytest.mark.parametrize("window", [0, 1000])
@pytest.mark.parametrize("case", CASES)
def test_prefill_attention_matches_sdpa(case, window):
    heads, dtype = CASES[case]
    n_heads, n_kv, hd = HEADS[heads]
    gen = torch.Generator(device="cuda").manual_seed(0)
    k, v = (torch.randn(n_kv, SLOTS, hd, generator=gen, device="cuda").to(dtype) for _ in range(2))
    k[:, START + T :], v[:, START + T :] = float("nan"), float("nan")
    q = torch.randn(T, n_heads, hd, generator=gen, device="cuda").to(dtype)
    got = prefill_attention(q, k, v, START, hd**-0.5, window)
    torch.testing.assert_close(got.float(), reference(q, k, v, window), rtol=TOL[dtype], atol=TOL[dtype])


def test_a_models_chunked_prefill_is_the_torch_paths(tiny_root, monkeypatch):
    """A tiny qwen35 on CUDA in fp32, the prompt in chunks of 48: the last token's logits with the prefill
    attention kernel within fp32 rounding of those with SDPA over the masked cache in its place."""
    from flashtree.models import attention
    from flashtree.models.loader import load_target
    from tests.spec_util import feed
    from tests.tiny import tiny_gguf

    target, _ = load_target(tiny_gguf("qwen35", 0, tiny_root), device="cuda", dtype=torch.float32)
    ids = torch.randint(0, target.config.vocab, (200,), generator=torch.Generator().manual_seed(0)).cuda()

    def prefill():
        state = target.new_state(256)
        for s in range(0, 200, 48):
            out = feed(target, ids[s : s + 48], state, logits="last")
        return out.logits

    ours = prefill()
    monkeypatch.setattr(attention, "prefill_attention", _sdpa_prefill)
    torch.testing.assert_close(ours, prefill(), rtol=1e-4, atol=1e-4)


def _sdpa_prefill(q, k, v, start, scale, window=0):
    """prefill_attention's result by SDPA over the float planes' slots 0 .. start + T - 1."""
    t = q.shape[0]
    pos = start + torch.arange(t, device=q.device)[:, None]
    mask = torch.arange(start + t, device=q.device)[None, :] <= pos
    keys, values = k.data[None, :, : start + t], v.data[None, :, : start + t]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("kind", [None, "tq3_0"])
def test_with_a_window_chain_and_tree_are_ar_on_the_gpu(kind, tiny_root):
    """--attn-window on CUDA (tree_attention's window, CUDA graphs): chain and tree greedy output equal
    AR's with the same window, and the window changes the output of a long enough decode."""
    from flashtree.config import SamplingParams, SpecConfig
    from flashtree.engine.generate import Engine
    from flashtree.models.loader import load_target
    from tests.spec_util import OracleDraft
    from tests.tiny import tiny_gguf

    target, _ = load_target(tiny_gguf("qwen35", 0, tiny_root, head_dim=32), device="cuda")
    target.set_kv_types(kind, kind)
    prompt = [5, 77, 190, 3, 41, 41, 9, 120, 33] * 4

    def generate(draft, window, **spec):
        engine = Engine(target, None, draft, SpecConfig(**spec), max_ctx=256, attn_window=window)
        return [t for step in engine.generate(prompt, 64, SamplingParams(), stop_ids=()) for t in step]

    ar = generate(None, 8, mode="ar")
    assert ar != generate(None, 0, mode="ar")
    for mode, spec in (("chain", dict(block_size=8)), ("tree", dict(block_size=8, budget=12))):
        oracle = OracleDraft(prompt + ar, target.config.vocab, 8, 0.25, seed=1)
        assert generate(oracle, 8, mode=mode, **spec) == ar, mode


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "tq3_0"])
def test_a_quantized_cache_through_slabs_matches_sdpa(kind):
    """The 27B's heads in bf16 over a quantized cache: the 3000 keys before the chunk read through slabs
    of 1000 (the default slab is larger than this cache), merged with the in-kernel pass over the rest,
    within bf16 rounding of SDPA over the dequantized values (tq3_0: q rotated, the output rotated back)."""
    from flashtree.quant.kv import dequantize, quantize, rotate, unrotate

    n_heads, n_kv, hd = HEADS["27b"]
    gen = torch.Generator(device="cuda").manual_seed(1)
    k, v = (torch.randn(n_kv, SLOTS, hd, generator=gen, device="cuda") for _ in range(2))
    q = torch.randn(T, n_heads, hd, generator=gen, device="cuda").to(torch.bfloat16)
    k_plane, v_plane = quantize(k, kind), quantize(v, kind)
    slab = 1000 * 2 * n_kv * hd * 2
    got = prefill_attention(q, k_plane, v_plane, START, hd**-0.5, slab_bytes=slab)
    rotated = kind == "tq3_0"
    keys, values = (dequantize(p).to(torch.bfloat16) for p in (k_plane, v_plane))
    want = reference(rotate(q).to(torch.bfloat16) if rotated else q, keys, values, 0)
    want = unrotate(want) if rotated else want
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
