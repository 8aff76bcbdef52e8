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
