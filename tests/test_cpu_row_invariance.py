"""The CPU's torch path computes a verify row as its AR step does, bit for bit (kernels/row_invariant.py,
KVCache.attend_each_row): logits and the K/V the verify writes, for every KV cache type (issue #39)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashtree.kernels import row_invariant
from flashtree.models.block import BlockLayout
from flashtree.quant.kv import KV_TYPES

FAMILIES = ["llama", "qwen3", "qwen35"]
PARENTS = [-1, 0, 1, 0, 3, 2, 0, 6, 1]  # three branches at the root, two under node 1


@pytest.fixture(autouse=True)
def fresh_self_check():
    """Each test sees the BLAS self-check run anew (a faked BLAS must not leave its answer cached)."""
    row_invariant.block_rows.cache_clear()
    yield
    row_invariant.block_rows.cache_clear()


@pytest.fixture(scope="module", params=FAMILIES)
def target32(request, tiny_root):
    """A tiny target of each family with heads of 32 values (the quantized types' blocks), fp32."""
    from flashtree.models.loader import load_target
    from tests.tiny import tiny_gguf

    target, _ = load_target(
        tiny_gguf(request.param, 0, tiny_root, head_dim=32), device="cpu", dtype=torch.float32
    )
    return target


def _kv_fields(state, slots: list[int]) -> list[torch.Tensor]:
    """Every field of every KV store (layers, n_kv, slots, ...) at `slots`."""
    planes = [p for s in state.stores if hasattr(s, "k") for p in (s.k, s.v)]
    return [f[:, :, slots] for p in planes for f in p.fields]


def _prefilled(target, prompt: list[int]):
    state = target.new_state(48)
    target(torch.tensor(prompt), state, logits="none")
    state.advance(len(prompt))
    return state


def _check_verify_rows_are_ar_rows(target, kind: str, prompt: list[int], block: list[int], window: int = 0):
    target.set_kv_types(kind, kind)
    try:
        verify = _prefilled(target, prompt)
        layout = BlockLayout.from_parents(torch.tensor(PARENTS))
        rows = target(torch.tensor(block), verify, layout, commit=False, logits="all", window=window).logits
        start = len(prompt)
        for node, path in enumerate(layout.paths().tolist()):
            path = path[: int(layout.depths[node]) + 1]
            ar = _prefilled(target, prompt)
            for token in path:  # the AR steps along the node's ancestry
                step = target(torch.tensor([block[token]]), ar, window=window).logits
                ar.advance(1)
            assert torch.equal(step[0], rows[node]), (kind, node)
            written = _kv_fields(verify, [start + j for j in path])
            kept = _kv_fields(ar, list(range(start, start + len(path))))
            assert all(torch.equal(a, b) for a, b in zip(written, kept, strict=True)), (kind, node)
    finally:
        target.set_kv_types(None, None)


@pytest.mark.parametrize("kind", KV_TYPES)
def test_verify_rows_are_the_ar_steps_on_the_cpu(target32, kind):
    """Each node of a branching verify vs the AR steps along its path: its logits and the K/V it wrote
    (every field) bit for bit, whatever the KV type; and with an attention window (--attn-window)."""
    gen = torch.Generator().manual_seed(KV_TYPES.index(kind))
    vocab = target32.config.vocab
    prompt = torch.randint(vocab, (21,), generator=gen).tolist()
    block = torch.randint(vocab, (len(PARENTS),), generator=gen).tolist()
    for window in (0, 7):
        _check_verify_rows_are_ar_rows(target32, kind, prompt, block, window)


def test_padded_linear_rows_are_one_row_calls():
    """Row i of an M-row product is the one-row product of x[i], for M up to the decode rows."""
    gen = torch.Generator().manual_seed(0)
    for n, k in ((96, 64), (960, 576), (576, 1536)):
        w, x = torch.randn(n, k, generator=gen), torch.randn(row_invariant.DECODE_ROWS, k, generator=gen)
        alone = torch.cat([row_invariant.linear(x[i : i + 1], w) for i in range(x.shape[0])])
        for m in (2, 3, 8, 16, 23, 33, row_invariant.DECODE_ROWS):
            assert torch.equal(row_invariant.linear(x[:m], w), alone[:m]), (n, k, m)
        torch.testing.assert_close(alone, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_plain_linear_rows_depend_on_the_row_count():
    """Why the padding: F.linear's row 0 for 1 and for 23 rows (MKL on this machine: other bits)."""
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(960, 576, generator=gen), torch.randn(23, 576, generator=gen)
    if torch.equal(F.linear(x[:1], w), F.linear(x, w)[:1]):
        pytest.skip("this machine's BLAS computes 1 and 23 rows alike: nothing to show")
    assert torch.equal(row_invariant.linear(x[:1], w), row_invariant.linear(x, w)[:1])


def _position_dependent_linear(x, w, bias=None):
    """A BLAS whose multi-row products round by row (the kind of machine the self-check guards against)."""
    y = torch.matmul(x, w.t()) if bias is None else torch.addmm(bias, x, w.t())
    if x.dim() == 2 and x.shape[0] > 1:
        y = y + torch.arange(x.shape[0], dtype=y.dtype)[:, None] * 1e-3
    return y


def test_self_check_falls_back_to_one_row_calls(monkeypatch):
    """Where a row's result depends on its place in a block, the self-check answers 1, and every product
    is then one-row calls: rows still equal their one-row products."""
    assert row_invariant.block_rows(torch.float32) == row_invariant.BLOCK_ROWS  # this machine passes
    row_invariant.block_rows.cache_clear()
    monkeypatch.setattr(F, "linear", _position_dependent_linear)
    assert row_invariant.block_rows(torch.float32) == 1
    rows_seen = []

    def counted(x, w):
        rows_seen.append(x.shape[0])
        return _position_dependent_linear(x, w)

    monkeypatch.setattr(F, "linear", counted)
    gen = torch.Generator().manual_seed(1)
    w, x = torch.randn(40, 64, generator=gen), torch.randn(23, 64, generator=gen)
    y = row_invariant.linear(x, w)
    assert rows_seen == [1] * 23
    assert all(torch.equal(y[i : i + 1], _position_dependent_linear(x[i : i + 1], w)) for i in range(23))


def test_one_row_fallback_keeps_verify_rows_exact(target32, monkeypatch):
    """The model with the fallback (one-row products): verify rows still equal the AR steps', q8_0."""
    calls = []

    def one_row(dtype):
        calls.append(dtype)
        return 1

    monkeypatch.setattr(row_invariant, "block_rows", one_row)
    gen = torch.Generator().manual_seed(7)
    vocab = target32.config.vocab
    prompt = torch.randint(vocab, (9,), generator=gen).tolist()
    block = torch.randint(vocab, (len(PARENTS),), generator=gen).tolist()
    _check_verify_rows_are_ar_rows(target32, "q8_0", prompt, block)
    assert calls


def test_plain_engines_keep_the_plain_path(tiny_root):
    """Engine.load: a speculating engine's modules take the row-invariant path, a plain AR engine's not."""
    from flashtree.engine.generate import Engine
    from tests.spec_util import random_draft_dir
    from tests.tiny import tiny_gguf

    target = tiny_gguf("qwen3", 0, tiny_root, head_dim=32)
    draft = random_draft_dir(target, tiny_root)
    for mode, on in (("tree", True), ("ar", False)):
        engine = Engine.load(target, draft, mode, device="cpu", max_ctx=64)
        flags = {m.row_invariant for m in engine.target.modules() if hasattr(m, "row_invariant")}
        assert flags == {on}, mode


def test_bench_plain_baseline_takes_the_plain_path(tiny_root, monkeypatch):
    """`bench --baseline plain` times AR as a plain engine runs it, then puts the speculating path back."""
    from flashtree.bench import run as bench_run
    from flashtree.engine.generate import Engine
    from tests.spec_util import random_draft_dir
    from tests.tiny import tiny_gguf

    target = tiny_gguf("qwen3", 0, tiny_root, head_dim=32)
    base = Engine.load(target, random_draft_dir(target, tiny_root), "tree", device="cpu", max_ctx=64)
    runners = bench_run.make_runners(base, ["ar"], ["plain"], 64)
    seen, generate = [], Engine.generate

    def spied(engine, *args, **kwargs):
        seen.append(engine.target.lm_head.row_invariant)
        return generate(engine, *args, **kwargs)

    monkeypatch.setattr(Engine, "generate", spied)
    runners["plain"]([1, 2, 3], 4)
    runners["ar"]([1, 2, 3], 4)
    assert seen == [False, True]
