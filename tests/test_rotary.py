"""The Triton rotary kernel vs layers.apply_rotary's torch path, on CPU through Triton's interpreter:
bit for bit, so that the GPU's kernel changes no output."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is compiled: run it on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402

from flashtree.kernels.rotary import rotary, rotary_store  # noqa: E402
from flashtree.models.layers import Rotary, apply_rotary  # noqa: E402
from flashtree.models.state import KVCache  # noqa: E402


def torch_rotary(x, cos, sin):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLASHTREE_KERNELS", "torch")
        return apply_rotary(x, cos, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "heads,head_dim,rot", [(4, 64, 64), (3, 256, 64), (2, 24, 16)], ids=["full", "partial", "ragged"]
)
@pytest.mark.parametrize("tokens", [1, 5, 23])
def test_rotary_kernel_is_the_torch_path_bit_for_bit(tokens, heads, head_dim, rot, dtype):
    gen = torch.Generator().manual_seed(tokens * 1000 + head_dim)
    positions = torch.randint(0, 100_000, (tokens,), generator=gen)
    cos, sin = Rotary(rot, 1e6).cos_sin(positions, dtype)
    # a strided view, as the gated q of qwen3.5 is: (T, heads, 2 * head_dim) split in halves
    packed = (torch.randn(tokens, heads, 2 * head_dim, generator=gen) * 3).to(dtype)
    x = packed[..., :head_dim]
    got = rotary(x, cos, sin)
    assert got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, torch_rotary(x, cos, sin))
    # one token alone gives its row of the batch (the AR step vs a verify row)
    assert torch.equal(rotary(x[-1:], cos[-1:], sin[-1:]), got[-1:])


def test_apply_rotary_takes_the_kernel_only_where_it_gives_the_same_result(monkeypatch, kernels_path):
    calls = []
    kernels_path("triton")
    monkeypatch.setattr("flashtree.kernels.rotary.rotary", lambda *a: calls.append(a) or a[0])
    cos, sin = Rotary(16, 1e4).cos_sin(torch.arange(3), torch.float32)
    x = torch.randn(3, 2, 16)
    apply_rotary(x, cos, sin)
    assert len(calls) == 1
    apply_rotary(x.requires_grad_(), cos, sin)  # training: autograd needs the torch ops
    apply_rotary(x.detach().bfloat16(), cos, sin)  # mixed dtypes: torch would promote
    assert len(calls) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,rot", [(4, 2, 64, 64), (6, 2, 32, 16)], ids=["full", "partial"]
)
@pytest.mark.parametrize("tokens", [1, 7])
def test_rotary_store_is_rotary_and_index_copy_bit_for_bit(tokens, heads, kv_heads, head_dim, rot, dtype):
    """The fused launch == rotary on q and k plus the cache's two index copies, with q, k, v strided
    views of one merged projection output (as the attention layer hands them over) and slots out of
    order; the rest of the cache untouched."""
    gen = torch.Generator().manual_seed(tokens + heads)
    width = (heads + 2 * kv_heads) * head_dim
    merged = (torch.randn(tokens, width, generator=gen) * 3).to(dtype)
    q = merged[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = merged[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = merged[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    cos, sin = Rotary(rot, 1e4).cos_sin(torch.randint(0, 5000, (tokens,), generator=gen), dtype)
    slots = torch.randperm(40, generator=gen)[:tokens]
    k_cache, v_cache = (torch.randn(kv_heads, 40, head_dim, generator=gen).to(dtype) for _ in range(2))
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k.index_copy_(1, slots, torch_rotary(k, cos, sin).transpose(0, 1))
    want_v.index_copy_(1, slots, v.transpose(0, 1))
    kv_only = k_cache.clone(), v_cache.clone()
    got_q = rotary_store(q, k, v, cos, sin, k_cache, v_cache, slots)
    assert torch.equal(got_q, torch_rotary(q, cos, sin))
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert rotary_store(None, k, v, cos, sin, *kv_only, slots) is None  # keys and values only (the draft's)
    assert torch.equal(kv_only[0], want_k) and torch.equal(kv_only[1], want_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("head_dim,rot", [(64, 64), (32, 16)], ids=["full", "partial"])
def test_rotary_store_norms_q_and_k_as_the_norm_kernel_does(head_dim, rot, dtype):
    """norms: q and k RMSNorm-ed per head in the same launch == fused.rms_norm (its own launch) then the
    plain fused launch, bit for bit; and within rounding of torch's RMSNorm (the path off the GPU)."""
    from flashtree.kernels.fused import rms_norm as norm_kernel

    tokens, heads, kv_heads = 5, 6, 2
    gen = torch.Generator().manual_seed(head_dim + rot)
    width = (2 * heads + 2 * kv_heads) * head_dim  # qwen3.5's q rows interleave a gate per head
    merged = (torch.randn(tokens, width, generator=gen) * 3).to(dtype)
    q = merged[:, : 2 * heads * head_dim].view(tokens, heads, 2 * head_dim)[..., :head_dim]  # strided heads
    k = merged[:, 2 * heads * head_dim : (2 * heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = merged[:, (2 * heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    q_weight, k_weight = (torch.rand(head_dim, generator=gen) + 0.5 for _ in range(2))
    cos, sin = Rotary(rot, 1e4).cos_sin(torch.randint(0, 5000, (tokens,), generator=gen), dtype)
    slots = torch.randperm(40, generator=gen)[:tokens]
    caches = [[torch.zeros(kv_heads, 40, head_dim, dtype=dtype) for _ in range(2)] for _ in range(2)]
    got_q = rotary_store(q, k, v, cos, sin, *caches[0], slots, (q_weight, k_weight, 1e-6))
    normed_q, normed_k = norm_kernel(q, q_weight, 1e-6), norm_kernel(k, k_weight, 1e-6)
    want_q = rotary_store(normed_q, normed_k, v, cos, sin, *caches[1], slots)
    assert torch.equal(got_q, want_q)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    torch_q = torch.nn.functional.rms_norm(q.float(), (head_dim,), q_weight, 1e-6).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # fp32 sums in another order; bf16: 1 ulp of |x| < 4
    torch.testing.assert_close(got_q.float(), torch_rotary(torch_q, cos, sin).float(), atol=tol, rtol=tol)


def test_kv_cache_takes_the_fused_launch_only_where_it_gives_the_same_result(monkeypatch, kernels_path):
    calls = []
    kernels_path("triton")
    monkeypatch.setattr("flashtree.kernels.rotary.rotary_store", lambda *a: calls.append(a) or a[0])
    cos, sin = Rotary(16, 1e4).cos_sin(torch.arange(3), torch.float32)
    q, k, v = torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    cache = KVCache(torch.zeros(2, 8, 16), torch.zeros(2, 8, 16))
    cache.write_rotated(torch.arange(3), q, k, v, cos, sin)
    assert len(calls) == 1
    cache.write_rotated(torch.arange(3), q.requires_grad_(), k, v, cos, sin)  # autograd: torch ops
    bf16 = torch.zeros(2, 8, 16, dtype=torch.bfloat16)
    bf16_cache = KVCache(bf16, bf16.clone())
    # a cache of another type than the model's (--kv-type bf16 on an fp32 model): torch's write, cast
    bf16_cache.write_rotated(torch.arange(3), q.detach(), k, v, cos, sin)
    assert len(calls) == 1
    assert torch.equal(bf16_cache.k.data[:, :3], apply_rotary(k, cos, sin).to(torch.bfloat16).transpose(0, 1))
