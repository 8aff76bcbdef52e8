"""KV cache types (quant/kv.py, kernels/kv_tiles.py): quantize / dequantize error bounds on Gaussian
vectors, tq3_0's rotation (orthonormal, each row's bits alone), the kernels' tile loads equal to
dequantize bit for bit."""

import pytest
import torch

from flashtree.errors import FlashtreeError
from flashtree.kernels import tl, triton
from flashtree.kernels.kv_tiles import kv_tile, plane_args, rotate_rows
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
    data, scale, high, out, sdh, sds, ssh, sss, shh, shs, valid,
    N: tl.constexpr, HD: tl.constexpr, BD: tl.constexpr, KIND: tl.constexpr, TRANS: tl.constexpr,
):  # fmt: skip
    """Every other slot's tile (N, BD) of head program_id(0), the first `valid` slots unmasked, stored
    whole (as (BD, N) K^T with TRANS, as the attention kernels load it)."""
    h = tl.program_id(0)
    n, d = tl.arange(0, N), tl.arange(0, BD)
    fields = data + h * sdh, scale + h * ssh, high + h * shh
    v = kv_tile(*fields, 2 * n, n < valid, sds, sss, shs, HD, N, BD, KIND, TRANS).to(tl.float32)
    if TRANS:
        tl.store(out + h * N * BD + n[None, :] * BD + d[:, None], v)
    else:
        tl.store(out + h * N * BD + n[:, None] * BD + d[None, :], v)


# 96 and 384: head sizes below their power of two (masked head dims); tq3_0 takes 384, not 96
TILE_CASES = [(kind, hd) for kind in KV_TYPES for hd in (64, 96, 384) if kind != "tq3_0" or hd != 96]


@pytest.mark.parametrize(("kind", "hd"), TILE_CASES, ids=[f"{k}-{hd}" for k, hd in TILE_CASES])
@pytest.mark.parametrize("trans", [False, True])
def test_kv_tile_loads_dequantized_values(kind, hd, trans):
    """kv_tile's values are dequantize's bit for bit; masked slots and head dims past hd are 0."""
    n, valid, bd = 16, 11, triton.next_power_of_2(hd)
    plane = quantize(torch.randn(2, 2 * n, hd, generator=torch.Generator().manual_seed(2)), kind)
    out = torch.full((2, n, bd), float("nan"))
    args = plane_args(plane)
    _tiles_kernel[(2,)](*args[:3], out, *args[3:9], valid, N=n, HD=hd, BD=bd, KIND=args[9], TRANS=trans)
    want = torch.zeros(2, n, bd)
    want[:, :valid, :hd] = dequantize(plane)[:, ::2][:, :valid]
    assert torch.equal(out, want)


def _rope(t: int, hd: int, rot: int, dtype):
    angles = torch.randn(t, rot // 2, generator=torch.Generator().manual_seed(5))
    return torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kinds", [("q8_0", "q4_0"), ("tq3_0", "tq3_0"), ("q4_0", "f16"), ("bf16", "q8_0")])
def test_write_kernel_is_the_torch_write(kinds, dtype, kernels_path):
    """kernels/rotary.py's fused RoPE + store quantizes K and V as quantize does, bit for bit (every
    field), and returns the same rotated q."""
    from flashtree.models.state import KVStore

    t, nq, n_kv, hd, slots = 5, 4, 2, 64, 12
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(t, n, hd, generator=gen).to(dtype) for n in (nq, n_kv))
    v = torch.randn(t, n_kv, hd, generator=gen).to(dtype)
    cos, sin = _rope(t, hd, 32, dtype)
    at = torch.tensor([3, 7, 1, 10, 0])
    caches = []
    for use in (False, True):
        kernels_path("triton" if use else "torch")
        store = KVStore(1, n_kv, slots, hd, dtype, "cpu", kinds)
        caches.append((store.layer(0).write_rotated(at, q, k, v, cos, sin), store))
    (q_torch, torch_store), (q_kernel, kernel_store) = caches
    assert torch.equal(q_torch, q_kernel)
    for a, b in zip((*torch_store.k, *torch_store.v), (*kernel_store.k, *kernel_store.v), strict=True):
        assert a == b if isinstance(a, str) or a is None else torch.equal(a, b)
    assert kernel_store.k.kind == kinds[0] and kernel_store.v.kind == kinds[1]


TREE = [-1, 0, 1, 0, 3, 1, 5, 2, 0]  # siblings, branches back up
MIXED = [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("tq3_0", "tq3_0"), ("bf16", "f16"), ("q4_0", "tq3_0")]


def _kernel_case(kinds, dtype, n_kv=2, n_heads=6, hd=64, start=150, slots=200, seed=0):
    """q (T, heads, hd), K and V planes (n_kv, slots, ...) of random vectors, the tree's layout."""
    from flashtree.models.block import BlockLayout

    gen = torch.Generator().manual_seed(seed)
    layout = BlockLayout.from_parents(torch.tensor(TREE))
    q = torch.randn(layout.size, n_heads, hd, generator=gen).to(dtype)
    k, v = (quantize(torch.randn(n_kv, slots, hd, generator=gen), kind) for kind in kinds)
    return q, k, v, start, layout


def _kernel(q, k, v, start, layout, window=0, n_keys=None):
    from flashtree.kernels.attention import tree_attention

    path, depths = layout.paths().to(torch.int32), layout.depths.to(torch.int32)
    n_keys = n_keys or start + layout.size
    return tree_attention(
        q,
        k,
        v,
        torch.tensor(start, device=q.device),
        path,
        depths,
        n_keys,
        q.shape[-1] ** -0.5,
        window=window,
    )


def _reference(q, k, v, start, layout, window=0):
    """The CPU path (KVCache.attend: dequantize, then SDPA) under the tree's mask by position."""
    from flashtree.models.state import KVCache

    t = layout.size
    rel = torch.arange(start + t) - start
    ancestor = layout.visible.gather(1, rel.clamp(0, t - 1)[None, :].expand(t, -1))
    mask = (rel < 0)[None, :] | ((rel >= 0)[None, :] & ancestor)
    if window:
        depths = layout.depths
        key_pos = torch.where(rel >= 0, start + depths[rel.clamp(0, t - 1)], rel + start)
        mask &= key_pos[None, :] > (start + depths)[:, None] - window
    return KVCache(k, v).attend(q, start + t, mask, q.shape[-1] ** -0.5)


@pytest.mark.parametrize("window", [0, 70], ids=["full", "window70"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kinds", MIXED, ids=["-".join(k) for k in MIXED])
def test_kernel_reads_each_type_as_the_cpu_path(kinds, dtype, window):
    """tree_attention over planes of each type (GQA 3, a branching tree, an optional window) against
    dequantize-then-attend. fp32: rounding order only (tq3_0's rotations included); bf16: the kernel's
    bf16 operands (each dequantized value rounded to bf16) and its bf16 output."""
    q, k, v, start, layout = _kernel_case(kinds, dtype)
    got = _kernel(q, k, v, start, layout, window)
    assert got.dtype == q.dtype and got.shape == q.shape
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        got.float(), _reference(q, k, v, start, layout, window).float(), rtol=tol, atol=tol
    )


def _commit_path(plane, start, path):
    """The plane with the path's nodes moved to their positions (as KVStore.commit moves them)."""
    moved = plane.map(torch.clone)
    for field, src in zip(moved.fields, plane.fields, strict=True):
        for j, node in enumerate(path):
            field[:, start + j] = src[:, start + node]
    return moved


@pytest.mark.parametrize("window", [0, 70], ids=["full", "window70"])
@pytest.mark.parametrize("kinds", MIXED, ids=["-".join(k) for k in MIXED])
def test_verify_rows_are_the_ar_steps_for_each_type(kinds, window):
    """Each node of a verify vs one AR step at its position after its path was committed: bit for bit,
    whatever the type, and with more (empty) splits launched."""
    from flashtree.models.block import BlockLayout

    q, k, v, start, layout = _kernel_case(kinds, torch.bfloat16, seed=1)
    got = _kernel(q, k, v, start, layout, window)
    assert torch.equal(_kernel(q, k, v, start, layout, window, n_keys=start + 130), got)
    paths = layout.paths()
    for node in range(layout.size):
        depth = int(layout.depths[node])
        path = paths[node, : depth + 1].tolist()
        ks, vs = _commit_path(k, start, path), _commit_path(v, start, path)
        step = _kernel(q[node : node + 1], ks, vs, start + depth, BlockLayout.chain(1), window)
        assert torch.equal(step[0], got[node]), node


FAMILIES = ["llama", "qwen3", "qwen35"]
QUANTIZED = ["q8_0", "q4_0", "tq3_0", "f16"]


@pytest.fixture(scope="module", params=FAMILIES)
def target32(request, tiny_root):
    """A tiny target of each family with heads of 32 values (the quantized types' blocks), fp32."""
    from flashtree.models.loader import load_target
    from tests.tiny import tiny_gguf

    target, _ = load_target(
        tiny_gguf(request.param, 0, tiny_root, head_dim=32), device="cpu", dtype=torch.float32
    )
    return target


def _generate(target, kinds, draft, prompt, n, **spec):
    from flashtree.config import SamplingParams, SpecConfig
    from flashtree.engine.generate import Engine

    target.set_kv_types(*kinds)
    mode = spec.pop("mode", "ar")
    engine = Engine(target, None, draft, SpecConfig(mode=mode, **spec), max_ctx=160)
    target.set_kv_types(None, None)
    store = next(s for s in engine.state.stores if hasattr(s, "k"))
    assert (store.k.kind, store.v.kind) == kinds
    return [t for step in engine.generate(prompt, n, SamplingParams(), stop_ids=()) for t in step]


@pytest.mark.parametrize("kind", QUANTIZED)
def test_speculative_output_is_ar_output_for_each_type(target32, kind):
    """Losslessness per KV type: chain and tree greedy outputs equal AR's with the same type (an oracle
    draft that is often right and sometimes wrong, so accepted paths span lengths and branch), for K
    and V of the type, and for K of the type with V in another (seeded prompts)."""
    import random

    from tests.spec_util import OracleDraft

    rng = random.Random(QUANTIZED.index(kind))
    vocab = target32.config.vocab
    for i, kinds in enumerate([(kind, kind), (kind, "q8_0" if kind != "q8_0" else "tq3_0")]):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(3, 30))]
        ar = _generate(target32, kinds, None, prompt, 32)
        for mode, spec in (("chain", dict(block_size=8)), ("tree", dict(block_size=8, budget=12))):
            oracle = OracleDraft(prompt + ar, vocab, 8, 0.25, seed=i)
            assert _generate(target32, kinds, oracle, prompt, 32, mode=mode, **spec) == ar, (kinds, mode)


def test_kernel_path_is_lossless_with_quantized_types(tiny_root, kernels_path):
    """The GPU path (the fused quantizing write, tree_attention over the planes) run in the interpreter
    inside a model: tree output equals AR's, with a tq3_0 K and a q4_0 V."""
    from flashtree.models.loader import load_target
    from tests.spec_util import OracleDraft
    from tests.tiny import tiny_gguf

    kernels_path("triton")
    target, _ = load_target(tiny_gguf("llama", 0, tiny_root, head_dim=32), device="cpu", dtype=torch.float32)
    kinds, prompt = ("tq3_0", "q4_0"), [5, 77, 190]
    ar = _generate(target, kinds, None, prompt, 8)
    oracle = OracleDraft(prompt + ar, target.config.vocab, 4, 0.3, seed=1)
    assert _generate(target, kinds, oracle, prompt, 8, mode="tree", block_size=4, budget=6) == ar


@pytest.mark.parametrize("kinds", [("q4_0", "tq3_0"), ("q8_0", "bf16")])
def test_commit_moves_every_fields_slots(kinds):
    """A verify's accepted nodes (block slots 5 + path) move to their positions in every layer, every
    field of K and V (codes, scales, high bits); the committed slots before them stay."""
    from flashtree.models.state import CommitPlan, KVStore

    store = KVStore(2, 3, 16, 64, torch.float32, "cpu", kinds)
    gen = torch.Generator().manual_seed(4)
    for i in range(2):
        x = torch.randn(16, 3, 64, generator=gen)
        store.layer(i).write(torch.arange(16), x, -x)
    before = [f.clone() for f in (*store.k.fields, *store.v.fields)]
    path = torch.tensor([0, 2, 5])  # block nodes 0, 2, 5 accepted: slots 5, 7, 10 -> 5, 6, 7
    src, dst = 5 + path, 5 + torch.arange(3)
    store.commit(CommitPlan(path, torch.tensor([3]), path[2:], src, dst))
    assert len(before) == (5 if kinds[0] == "q4_0" else 3)  # every field: codes, scales, high bits
    for old, new in zip(before, (*store.k.fields, *store.v.fields), strict=True):
        assert torch.equal(new[:, :, dst], old[:, :, src]) and torch.equal(new[:, :, :5], old[:, :, :5])


@pytest.mark.parametrize("kinds", [("tq3_0", "q4_0"), ("q8_0", "f16"), (None, None)])
def test_state_bytes_count_every_field(target32, kinds):
    target32.set_kv_types(*kinds)
    try:
        state = target32.new_state(40)
        tensors = [t for s in state.stores for t in vars(s).values() if isinstance(t, torch.Tensor)]
        planes = [f for s in state.stores if hasattr(s, "k") for f in (*s.k.fields, *s.v.fields)]
        allocated = sum(t.numel() * t.element_size() for t in tensors + planes)
        assert allocated == target32.state_bytes(40)
    finally:
        target32.set_kv_types(None, None)
    with pytest.raises(FlashtreeError, match="tq3_0"):
        target32.set_kv_types("tq3_0", "q7")


def test_kv_type_options(tiny_root):
    """run --kv-type / --kv-type-k / --kv-type-v: the engine's cache in those types (the JSON and the
    summary line say which); an unknown type, or one the model's heads cannot hold, is one error line."""
    import json

    from typer.testing import CliRunner

    from flashtree.cli import app
    from tests.tiny import tiny_gguf

    def run(target, *options):
        argv = ["run", "-p", "Hi", "--target", str(target), "-n", "3", "--device", "cpu", "--draft", "none"]
        return CliRunner().invoke(app, [*argv, *options])

    target = tiny_gguf("qwen3", 0, tiny_root, head_dim=32)
    result = run(target, "--kv-type", "q4_0", "--kv-type-v", "tq3_0", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["kv_types"] == ["q4_0", "tq3_0"]
    result = run(target, "--kv-type", "q8_0")
    assert result.stderr.strip().splitlines()[-1].endswith(", KV cache q8_0")
    for bad, options in (("unknown KV cache type 'q3'", ("--kv-type-k", "q3")),
                         ("head size divisible by 32, not 24", ("--kv-type", "q8_0"))):  # fmt: skip
        small = target if "q3" in options else tiny_gguf("qwen3", 0, tiny_root)  # heads of 24 values
        result = run(small, *options)
        assert result.exit_code == 1 and result.stderr.startswith("error: ") and bad in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_speculation_over_a_rounding_cache_is_ar_on_the_torch_path(tiny_root, kernels_path):
    """The CPU's torch path computes a speculating engine's rows as its AR step does
    (kernels/row_invariant.py), so `Engine.load` runs tree over a cache that rounds and its greedy output
    is AR's, token for token (it was refused while the torch matmuls were not row-invariant). The bitwise
    row checks, which fail without it, are tests/test_cpu_row_invariance.py's."""
    from flashtree.engine.generate import Engine
    from tests.spec_util import random_draft_dir
    from tests.tiny import tiny_gguf

    target = tiny_gguf("llama", 0, tiny_root, head_dim=32)
    draft = random_draft_dir(target, tiny_root)
    kernels_path("torch")
    prompt = list(range(5, 17))
    for kinds in (("q4_0", None), (None, "tq3_0"), ("bf16", "bf16")):
        outputs = []
        for mode in ("ar", "tree"):
            engine = Engine.load(target, draft, mode, device="cpu", max_ctx=96, kv_types=kinds)
            assert engine.mode == mode
            outputs.append([t for step in engine.generate(prompt, 40, stop_ids=[]) for t in step])
        assert outputs[0] == outputs[1], kinds


@triton.jit
def _rotate_kernel(x_ptr, out_ptr, signs, M: tl.constexpr, BD: tl.constexpr, ROT: tl.constexpr,
                   RSCALE: tl.constexpr, INVERSE: tl.constexpr):  # fmt: skip
    at = tl.arange(0, M)[:, None] * BD + tl.arange(0, BD)[None, :]
    tl.store(out_ptr + at, rotate_rows(tl.load(x_ptr + at), signs, M, BD, ROT, RSCALE, INVERSE))


@pytest.mark.parametrize("hd", [32, 64, 256])
def test_kernel_rotation_is_the_torch_rotation(hd):
    """kv_tiles.rotate_rows (the attention kernel's query and output rotations, the write's) computes
    quant/kv.py's rotate / unrotate bit for bit."""
    from flashtree.quant.kv import rotation_scale, rotation_signs, rotation_size

    x = torch.randn(16, hd, generator=torch.Generator().manual_seed(hd))
    r = rotation_size(hd)
    for inverse, reference in ((False, rotate), (True, unrotate)):
        out = torch.empty_like(x)
        _rotate_kernel[(1,)](x, out, rotation_signs(r, x.device), 16, hd, r, rotation_scale(r), inverse)
        assert torch.equal(out, reference(x))
