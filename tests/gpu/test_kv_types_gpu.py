"""KV cache types on the GPU (quant/kv.py, kernels/kv_tiles.py): the decode/verify attention over each
type's planes against the CPU path (dequantize, then SDPA) at the 27B's heads (bf16) and SmolLM2's
(fp32), in a cache of one-tile splits and one of several-tile splits, every tree node equal to the AR
step at its position bit for bit; the fused RoPE + quantizing write equal to quantize on the CPU bit for
bit; and speculative output equal to AR's on a tiny model for every type."""

import pytest
import torch

from flashtree.quant.kv import quantize
from tests.test_kv_types import MIXED, _commit_path, _kernel, _reference

pytestmark = pytest.mark.gpu

HEADS = {"27b": (24, 4, 256, torch.bfloat16), "smollm2": (9, 3, 64, torch.float32)}
CACHES = {"short": 1024, "long": 20000}  # splits of one tile; of several (split_positions)
TYPES = ["q8_0", "q4_0", "tq3_0", "f16", "bf16"]
TREE = [-1, 0, 1, 0, 3, 1, 5, 2, 0]


def _case(heads, slots, kinds, start=600, seed=0):
    from flashtree.models.block import BlockLayout

    n_heads, n_kv, hd, dtype = HEADS[heads]
    gen = torch.Generator().manual_seed(seed)
    layout = BlockLayout.from_parents(torch.tensor(TREE))
    q = torch.randn(layout.size, n_heads, hd, generator=gen).to(dtype)
    k, v = (quantize(torch.randn(n_kv, slots, hd, generator=gen), kind) for kind in kinds)
    return q, k, v, start, layout


def _cuda(case):
    q, k, v, start, layout = case
    from flashtree.models.block import BlockLayout

    cuda = BlockLayout.from_parents(layout.parents.cuda())
    return q.cuda(), k.map(torch.Tensor.cuda), v.map(torch.Tensor.cuda), start, cuda


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("kind", TYPES)
def test_kernel_reads_each_type_as_the_cpu_path(kind, heads, cache):
    case = _case(heads, CACHES[cache], (kind, kind))
    got = _kernel(*_cuda(case)).cpu()
    tol = 2e-5 if case[0].dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), _reference(*case).float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("window", [0, 300], ids=["full", "window300"])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("kinds", MIXED, ids=["-".join(k) for k in MIXED])
def test_verify_rows_are_the_ar_steps(kinds, heads, window):
    from flashtree.models.block import BlockLayout

    q, k, v, start, layout = _cuda(_case(heads, CACHES["long"], kinds, seed=1))
    got = _kernel(q, k, v, start, layout, window)
    paths = layout.paths().cpu()
    for node in range(layout.size):
        depth = int(layout.depths[node])
        path = paths[node, : depth + 1].tolist()
        ks, vs = _commit_path(k, start, path), _commit_path(v, start, path)
        step = _kernel(q[node : node + 1], ks, vs, start + depth, BlockLayout.chain(1, "cuda"), window)
        assert torch.equal(step[0], got[node]), node


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("kind", TYPES)
def test_fused_write_quantizes_as_the_cpu(kind, heads):
    """The kernel's block sums, divisions and square roots round as torch's on the CPU."""
    from flashtree.models.state import KVStore

    n_heads, n_kv, hd, dtype = HEADS[heads]
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(7, n, hd, generator=gen).to(dtype) for n in (n_heads, n_kv, n_kv))
    angles = torch.randn(7, hd // 2, generator=gen)
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    at = torch.tensor([3, 7, 1, 10, 0, 2, 4])
    gpu = KVStore(1, n_kv, 12, hd, dtype, "cuda", (kind, kind))
    gpu.layer(0).write_rotated(at.cuda(), q.cuda(), k.cuda(), v.cuda(), cos.cuda(), sin.cuda())
    cpu = KVStore(1, n_kv, 12, hd, dtype, "cpu", (kind, kind))
    cpu.layer(0).write_rotated(at, q, k, v, cos, sin)
    for a, b in zip((*cpu.k.fields, *cpu.v.fields), (*gpu.k.fields, *gpu.v.fields), strict=True):
        assert torch.equal(a, b.cpu())


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "tq3_0"])
def test_tree_and_chain_output_is_ar_output(kind, tiny_root):
    """A tiny qwen35 (heads of 32 values) on the GPU, every step from CUDA graphs where the engine takes
    them, with a random draft (an oracle's host-side proposals would not run in a graph)."""
    from flashtree.config import SamplingParams, SpecConfig
    from flashtree.engine.generate import Engine
    from flashtree.models.loader import load_target
    from tests.spec_util import random_draft
    from tests.tiny import tiny_gguf

    gguf = tiny_gguf("qwen35", 0, tiny_root, head_dim=32)
    target, _ = load_target(gguf, device="cuda")
    draft = random_draft(gguf, target, tiny_root, layers=1)
    prompts = [[5, 77, 190, 3, 41, 41, 9, 120, 33], [1, 2, 3], list(range(40, 90))]

    def generate(prompt, draft, **spec):
        engine = Engine(target, None, draft, SpecConfig(**spec), max_ctx=256, kv_types=(kind, kind))
        return [t for step in engine.generate(prompt, 64, SamplingParams(), stop_ids=()) for t in step]

    for prompt in prompts:
        ar = generate(prompt, None, mode="ar")
        for mode, spec in (("chain", dict(block_size=8)), ("tree", dict(block_size=8, budget=12))):
            assert generate(prompt, draft, mode=mode, **spec) == ar, (prompt, mode)
