"""The small Triton kernels of the decode/verify path on the GPU, against their torch paths (no model files).

The CPU tests run these kernels under Triton's interpreter, which is not the compiler; these run them
compiled:
- rotary (kernels/rotary.py): bit for bit the torch ops of layers.apply_rotary, fp32 and bf16, full and
  partial rotary, a strided q; and rotary_store (RoPE on q and k plus the K/V cache write in one launch)
  bit for bit rotary + index_copy;
- the DDTree build (kernels/ddtree.py: the draft's top-k in two launches, then the tree in one): the
  torch path's tree (tokens, parents, depths, visibility) on random fp32 draft logits of SmolLM2's and
  the 27B's vocabularies; and the accept walk on it (kernels/accept.py): the torch path's path and
  read-back;
- grouped_attention (models/layers.py: query heads folded into rows) and block_attention (the draft
  block's attention on the GPU, kernels/attention.py) within 1e-5 (fp32) / 1.6e-2 (bf16) of SDPA's own
  grouped-query attention at the drafts' shapes;
- tree conv + SiLU (kernels/tree_conv.py): within 1e-5 of the torch formula in fp32 on a tree with
  siblings, its windows exact, each token computed alone equal to its row of the whole launch (the
  verify) bit for bit, and the AR step (one token, the state updated in place) too;
- the fused RMSNorm variants and SiLU-and-multiply (kernels/fused.py) at the 27B's shapes: within one
  bf16 unit in the last place of the torch path (fp32: 2e-6 relative), the residual sum bit for bit,
  and a row alone equal to its row of 23 bit for bit; with int8 buffers on one token (the AR step of
  int8 matrices) the same output bits, the buffers getting exactly qmatmul.quantize_activations' codes;
- fp8 draft matrices (kernels/fp8.py) at the 27B draft's shapes: the Triton row quantizer's bytes and
  scales equal to torch's cast, and Fp8Linear (torch._scaled_mm) within fp8 rounding of x @ W^T.
The decode/verify attention and the tree Gated DeltaNet are test_attention_gpu.py and
test_tree_deltanet_gpu.py.
"""

from types import SimpleNamespace

import pytest
import torch

from benchmarks import knobs
from benchmarks.checks import PARENTS, TOL
from flashtree.kernels import fp8, fused
from flashtree.kernels.attention import block_attention
from flashtree.kernels.qmatmul import new_activations, quantize_activations
from flashtree.kernels.rotary import rotary, rotary_store
from flashtree.kernels.tree_conv import tree_conv_silu
from flashtree.models import layers
from flashtree.models.block import BlockLayout
from flashtree.models.layers import Rotary, apply_rotary, grouped_attention
from flashtree.spec.accept import accept_path
from flashtree.spec.tree import build_tree

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
FP8_TOL = 0.06  # e4m3's 3 mantissa bits on both operands (tests/test_fp8.py)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def torch_path(fn, *args):
    """fn's torch ops, with the kernels switched off."""
    with knobs.triton_kernels(False):
        return fn(*args)


def torch_rotary(x, cos, sin):
    return torch_path(apply_rotary, x, cos, sin)


# --- rotary ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", (1, 23))
@pytest.mark.parametrize("heads,head_dim,rot", ((16, 128, 128), (24, 256, 64), (9, 64, 64)))
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_equals_torch(dtype, heads, head_dim, rot, tokens):
    dtype = DTYPES[dtype]
    gen = torch.Generator().manual_seed(tokens + head_dim)
    positions = torch.randint(0, 200_000, (tokens,), generator=gen)
    cos, sin = (c.to(DEVICE) for c in Rotary(rot, 1e7).cos_sin(positions, dtype))
    packed = torch.randn(tokens, heads, 2 * head_dim, generator=gen).to(DEVICE, dtype) * 3
    x = packed[..., :head_dim]  # strided, as qwen3.5's gated q
    got, reference = rotary(x, cos, sin), torch_rotary(x, cos, sin)
    diff = (got.float() - reference.float()).abs().max().item()
    assert torch.equal(got, reference), f"max |diff| {diff:.2e}"


@pytest.mark.parametrize("tokens", (1, 23))
@pytest.mark.parametrize("heads,kv_heads,head_dim,rot", ((9, 3, 64, 64), (24, 4, 256, 64)))
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_store_equals_rotary_and_index_copy(dtype, heads, kv_heads, head_dim, rot, tokens):
    dtype = DTYPES[dtype]
    gen = torch.Generator().manual_seed(tokens + heads)
    width = (heads + 2 * kv_heads) * head_dim
    merged = (torch.randn(tokens, width, generator=gen) * 3).to(DEVICE, dtype)
    q = merged[:, : heads * head_dim].view(tokens, heads, head_dim)
    q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
    k = merged[:, q_end:k_end].view(tokens, kv_heads, head_dim)
    v = merged[:, k_end:].view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 200_000, (tokens,), generator=gen)
    cos, sin = (c.to(DEVICE) for c in Rotary(rot, 1e7).cos_sin(positions, dtype))
    slots = torch.randperm(600, generator=gen)[:tokens].to(DEVICE)
    caches = [torch.randn(kv_heads, 600, head_dim, generator=gen) for _ in range(2)]
    caches = [c.to(DEVICE, dtype) for c in caches]
    want_k, want_v = (c.clone() for c in caches)
    want_k.index_copy_(1, slots, torch_rotary(k, cos, sin).transpose(0, 1))
    want_v.index_copy_(1, slots, v.transpose(0, 1))
    got_q = rotary_store(q, k, v, cos, sin, *caches, slots)
    assert torch.equal(got_q, torch_rotary(q, cos, sin)), "q"
    assert torch.equal(caches[0], want_k), "the K cache"
    assert torch.equal(caches[1], want_v), "the V cache"


# --- DDTree build and accept ----------------------------------------------------------------------------


@pytest.mark.parametrize("chain_seed", (True, False))
@pytest.mark.parametrize(
    "vocab,depth,budget,top_k", ((49152, 15, 22, 8), (248320, 15, 22, 8), (49152, 15, 63, 8))
)
def test_ddtree_build_and_accept_equal_torch(vocab, depth, budget, top_k, chain_seed):
    gen = torch.Generator().manual_seed(vocab + budget)
    logits = (3 * torch.randn(depth, vocab, generator=gen)).to(DEVICE)
    root = torch.tensor(7, device=DEVICE)
    want = torch_path(build_tree, root, logits, budget, top_k, chain_seed)
    got = build_tree(root, logits, budget, top_k, chain_seed)
    assert torch.equal(got.tokens, want.tokens), "tokens"
    assert torch.equal(got.layout.parents, want.layout.parents), "parents"
    assert torch.equal(got.layout.depths, want.layout.depths), "depths"
    assert torch.equal(got.layout.visible, want.layout.visible), "visibility"
    # the accept kernel (kernels/accept.py) on this tree, samples walking it to a leaf
    samples = got.tokens.cpu().clone()
    for child, parent in enumerate(got.layout.parents.tolist()):
        if parent >= 0:
            samples[parent] = got.tokens[child]
    samples = samples.to(DEVICE)
    fast = accept_path(got.tokens, got.layout, samples)
    ref = torch_path(accept_path, got.tokens, got.layout, samples)
    assert torch.equal(fast.path, ref.path), "the accepted path"
    assert torch.equal(fast.packed(got.tokens), ref.packed(got.tokens)), "the read-back"


# --- the drafts' attention ------------------------------------------------------------------------------


@pytest.mark.parametrize("heads,kv_heads,head_dim,keys_n", ((9, 3, 64, 528), (32, 8, 128, 4112)))
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_and_block_attention_match_sdpa(dtype, heads, kv_heads, head_dim, keys_n):
    dtype = DTYPES[dtype]
    gen = torch.Generator().manual_seed(heads)
    q = torch.randn(1, heads, 16, head_dim, generator=gen).to(DEVICE, dtype)
    kv = [torch.randn(1, kv_heads, keys_n, head_dim, generator=gen) for _ in range(2)]
    kv = [t.to(DEVICE, dtype) for t in kv]
    mask = (torch.rand(16, keys_n, generator=gen) < 0.7).to(DEVICE)
    mask[:, -16:] = True
    # the draft's block attention over the context slots, then the whole block: one mask for
    # every row (the live slots, a row broadcast), or a mask a row (a sliding window's layer)
    shared = mask[0, :-16][None].expand(16, -1)
    q_rows = q[0].transpose(0, 1).contiguous()  # (16, heads, head_dim)
    cases = [("grouped_attention", grouped_attention(q, *kv, mask, head_dim**-0.5), mask)]
    for kernel, ctx_mask in (("block_attention", shared), ("block_attention rows", mask[:, :-16])):
        block = block_attention(q_rows, kv[0][0], kv[1][0], ctx_mask, head_dim**-0.5, keys_n - 16)
        block_mask = torch.cat([ctx_mask, mask[:, -16:]], dim=1)
        cases.append((kernel, block.transpose(0, 1)[None], block_mask))
    # other attention kernels: fp32 sums in another order; bf16 outputs (|x| < 1) 2 ulp apart
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    failures = []
    for kernel, got, kernel_mask in cases:
        want = torch.nn.functional.scaled_dot_product_attention(
            q, *kv, attn_mask=kernel_mask, scale=head_dim**-0.5, enable_gqa=True
        )
        diff = (got.float() - want.float()).abs().max().item()
        if not diff <= tol:
            failures.append(f"{kernel}: max |diff| {diff:.2e}")
    assert not failures, "; ".join(failures)


# --- tree conv ------------------------------------------------------------------------------------------


def test_tree_conv_matches_formula_and_rows():
    gen = torch.Generator().manual_seed(0)
    kernel, channels = 4, 10240  # the 27B's conv channels
    layout = BlockLayout.from_parents(torch.tensor(PARENTS))
    t = layout.size
    src = torch.randn(kernel - 1 + t, channels, generator=gen).to(DEVICE)
    state, new = src[: kernel - 1].clone(), src[kernel - 1 :]
    weight = torch.randn(channels, kernel, generator=gen).to(DEVICE)
    index = layout.conv_window_index(kernel).to(DEVICE)
    windows = torch.empty(t, kernel - 1, channels, device=DEVICE)
    got = tree_conv_silu(state, new, index, weight, windows)
    reference = torch.nn.functional.silu((src[index] * weight.t()[None]).sum(1))
    alone = torch.cat([tree_conv_silu(state, new, index[i : i + 1], weight) for i in range(t)])
    # the AR step: one token, the state updated in place
    ar_out = tree_conv_silu(state, new[:1], index[:1], weight, state[None])
    err = (got - reference).abs().max().item()
    assert err < TOL, f"max |err| {err:.2e} from the formula"
    assert torch.equal(windows, src[index][:, 1:]), "the windows written"
    assert torch.equal(ar_out, alone[:1]), "the AR step's output"
    assert torch.equal(state, src[1:kernel]), "the AR step's state, updated in place"
    assert torch.equal(alone, got), "a token alone differs from its row of the launch"


# --- fused norms and gates ------------------------------------------------------------------------------

FUSED = ("rms_norm", "rms_norm heads", "add_rms_norm", "gated_rms_norm", "sigmoid_gate", "silu_mul")
FUSED_QUANTIZED = ("rms_norm", "add_rms_norm", "gated_rms_norm", "silu_mul", "sigmoid_gate")


@pytest.fixture(scope="module")
def fused_inputs():
    """The 27B's shapes, 23 tokens, drawn in one sequence from one seed."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=torch.bfloat16, scale=3.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)

    t, hidden, ff = 23, 5120, 17408  # the 27B's
    x, residual, w = randn(t, hidden), randn(t, 2 * hidden)[:, hidden:], randn(hidden, scale=1.0)
    heads = randn(t, 24 * 512)[:, : 24 * 256].view(t, 24, 256)  # gated q: a strided head view
    o, z = randn(t, 48, 128, dtype=torch.float32), randn(t, 3 * 6144)[:, 6144 : 2 * 6144]
    gate_up = randn(t, 2 * ff)
    q_gate, heads_out = randn(t, 24, 512)[..., 256:], randn(t, 24 * 256)  # gated q: [q_h | gate_h] per head
    return SimpleNamespace(
        t=t, ff=ff, x=x, residual=residual, w=w, heads=heads, o=o, z=z, gate_up=gate_up, q_gate=q_gate,
        heads_out=heads_out,
    )  # fmt: skip


def fused_cases(i) -> dict:
    """name: (kernel(rows), torch path(rows)) -> tuples of outputs; rows: a slice of the tokens."""
    x, residual, w, heads, o, z = i.x, i.residual, i.w, i.heads, i.o, i.z
    gate_up, ff, q_gate, heads_out = i.gate_up, i.ff, i.q_gate, i.heads_out
    return {
        "rms_norm": (lambda r: (fused.rms_norm(x[r], w, 1e-6),), lambda r: (layers.rms_norm(x[r], w, 1e-6),)),
        "rms_norm heads": (
            lambda r: (fused.rms_norm(heads[r], w[:256], 1e-6),),
            lambda r: (layers.rms_norm(heads[r], w[:256], 1e-6),),
        ),
        "add_rms_norm": (  # (sum, norm)
            lambda r: fused.rms_norm(x[r], w, 1e-6, residual=residual[r]),
            lambda r: (lambda h, normed: (h, normed.x))(*layers.add_rms_norm(x[r], residual[r], w, 1e-6)),
        ),
        "gated_rms_norm": (
            lambda r: (fused.rms_norm(o[r], w[:128], 1e-6, gate=z[r], out_dtype=torch.bfloat16).flatten(1),),
            lambda r: (layers.gated_rms_norm(o[r], w[:128], 1e-6, z[r], torch.bfloat16).x,),
        ),
        "sigmoid_gate": (  # the gated attention output: gate a strided head view
            lambda r: (fused.gate_mul(q_gate[r], heads_out[r], "sigmoid"),),
            lambda r: (layers.sigmoid_gate(heads_out[r], q_gate[r]).x,),
        ),
        "silu_mul": (
            lambda r: (fused.gate_mul(gate_up[r, :ff], gate_up[r, ff:]),),
            lambda r: (layers.silu_mul(gate_up[r, :ff], gate_up[r, ff:]).x,),
        ),
    }


def within_rounding(got: torch.Tensor, want: torch.Tensor) -> bool:
    """bf16: at most one unit in the last place apart; fp32: 2e-6 relative."""
    bf16 = want.dtype == torch.bfloat16
    got, want = got.float(), want.float()
    if bf16:
        return bool(((got - want).abs() <= 2.0 ** (torch.frexp(want)[1] - 8).float()).all())
    return bool(((got - want).abs() <= 2e-6 * want.abs() + 1e-6).all())


@pytest.mark.parametrize("name", FUSED)
def test_fused_within_rounding_and_rows(fused_inputs, name):
    kernel, reference = fused_cases(fused_inputs)[name]
    got, want = kernel(slice(None)), torch_path(reference, slice(None))
    diff = max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want, strict=True))
    for g, w in zip(got, want, strict=True):
        assert within_rounding(g, w), f"max |diff| {diff:.2e}"
    if name == "add_rms_norm":
        assert torch.equal(got[0], want[0]), "the residual sum: one rounding, as torch's add"
    t = fused_inputs.t
    for i in (0, t - 1):
        for g_i, g in zip(kernel(slice(i, i + 1)), got, strict=True):
            assert torch.equal(g_i, g[i : i + 1]), f"row {i} alone differs from its row of {t}"


@pytest.mark.parametrize("name", FUSED_QUANTIZED)
def test_fused_quantize_carries_the_rows_codes(fused_inputs, name):
    """int8 buffers on one token (the AR step of int8 matrices): the same output bits, and the buffers get
    exactly qmatmul.quantize_activations' codes, scales and sums of the token's row."""
    i = fused_inputs
    x, residual, w, o, z, gate_up, ff = i.x, i.residual, i.w, i.o, i.z, i.gate_up, i.ff
    make = {
        "rms_norm": lambda q: fused.rms_norm(x[:1], w, 1e-6, int8=q),
        "add_rms_norm": lambda q: fused.rms_norm(x[:1], w, 1e-6, residual=residual[:1], int8=q)[1],
        "gated_rms_norm": lambda q: fused.rms_norm(
            o[:1], w[:128], 1e-6, gate=z[:1], out_dtype=torch.bfloat16, int8=q
        ),
        "silu_mul": lambda q: fused.gate_mul(gate_up[:1, :ff], gate_up[:1, ff:], int8=q),
        "sigmoid_gate": lambda q: fused.gate_mul(i.q_gate[:1], i.heads_out[:1], "sigmoid", int8=q),
    }[name]
    plain = make(None)
    carried = new_activations(plain.numel(), 1, plain.device)
    assert torch.equal(plain, make(carried)), "the output's bits changed with int8 buffers"
    row = plain.reshape(1, -1)
    for field, a, b in zip(carried._fields, carried, quantize_activations(row), strict=True):
        assert torch.equal(a, b), field


# --- fp8 draft matrices ---------------------------------------------------------------------------------


@pytest.mark.parametrize("m,k,n", ((16, 5120, 34816), (15, 5120, 31040), (23, 25600, 5120), (1, 4096, 5120)))
def test_fp8_quantizer_and_product(m, k, n):
    g = torch.Generator().manual_seed(m + k + n)
    x = torch.randn(m, k, generator=g) * torch.exp(torch.randn(k, generator=g))  # outlier channels
    x, w = (
        x.to(DEVICE, torch.bfloat16),
        (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, torch.bfloat16),
    )
    codes, scales = fp8.quantize_rows(x)
    want_codes, want_scales = fp8.quantize_rows_reference(x)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)), "the e4m3 bytes"
    assert torch.equal(scales, want_scales), "the row scales"
    with torch.no_grad():
        y = layers.Fp8Linear(w)(x)
    want = x.double() @ w.double().t()
    err = float((y.double() - want).norm() / want.norm())
    assert err < FP8_TOL, f"the product's relative error {err:.2e}"
