"""The fp32 decode-step matmul kernel (kernels/dense_matmul.py) under TRITON_INTERPRET=1: the product
within fp32 rounding, each row independent of the others bit for bit, and the layers taking it only
where it applies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashtree.errors import FlashtreeError
from flashtree.kernels import dense_matmul
from flashtree.kernels.dense_matmul import dense_linear
from flashtree.kernels.qmatmul import k_splits
from flashtree.kernels.tiles import DEFAULT_DENSE_TILES, DenseTiles, KernelConfig
from flashtree.models.layers import Linear
from flashtree.settings import Settings

TILES = {
    "default": DEFAULT_DENSE_TILES["default"],
    "splits-fused": DenseTiles(rows=16, k_block=32, warps=4, stages=1, programs=64, fused_sum=1),
    "splits-second-launch": DenseTiles(rows=16, k_block=32, warps=4, stages=1, programs=64, fused_sum=0),
}
TOL = 2e-6  # relative to the largest output: fp32 sums of up to 200 products


@pytest.mark.parametrize("tiles", TILES.values(), ids=list(TILES))
@pytest.mark.parametrize("n,k", [(40, 96), (70, 200), (16, 64)])
def test_dense_linear_is_the_product_and_each_row_its_own(n, k, tiles):
    gen = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(23, k, generator=gen)
    got = dense_linear(x, w, tiles)
    want = x.double() @ w.double().t()
    assert got.dtype == torch.float32 and got.shape == (23, n)
    assert (got.double() - want).abs().max() <= TOL * want.abs().max()
    # every row alone (the AR step) and inside any batch (a verify or a draft block) is the same bits
    for m in (1, 5, 16):
        assert torch.equal(dense_linear(x[:m], w, tiles), got[:m])
    for i in (0, 7, 22):
        assert torch.equal(dense_linear(x[i : i + 1], w, tiles), got[i : i + 1])


@pytest.mark.parametrize("tiles", TILES.values(), ids=list(TILES))
def test_the_swiglu_input_is_made_as_the_two_launches_make_it(tiles):
    """dense_linear(gate, w, up=up): silu(gate) * up made as the tile loads, the same bits as
    fused.gate_mul's launch followed by the product, rows independent of the batch; gate and up read as
    the strided halves of a merged gate/up output."""
    from flashtree.kernels.fused import gate_mul

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(40, 96, generator=gen)
    merged = torch.randn(23, 2 * 96, generator=gen)
    gate, up = merged[:, :96], merged[:, 96:]
    got = dense_linear(gate, w, tiles, up=up)
    assert torch.equal(got, dense_linear(gate_mul(gate, up), w, tiles))
    want = (F.silu(gate.double()) * up.double()) @ w.double().t()
    assert (got.double() - want).abs().max() <= TOL * want.abs().max()
    for i in (0, 7, 22):
        assert torch.equal(dense_linear(gate[i : i + 1], w, tiles, up=up[i : i + 1]), got[i : i + 1])


def test_swiglu_takes_one_launch_where_the_dense_kernel_runs(monkeypatch, kernels_path):
    from flashtree.models.layers import MergedLinear, SwiGLU

    kernels_path("triton")
    gen = torch.Generator().manual_seed(4)
    gate_w, up_w, down_w = (torch.randn(n, k, generator=gen) for n, k in ((32, 16), (32, 16), (16, 32)))
    mlp = SwiGLU(MergedLinear.dense([gate_w, up_w]), Linear(down_w))
    x = torch.randn(3, 16, generator=gen)
    calls = []
    real = dense_matmul.dense_linear
    monkeypatch.setattr(dense_matmul, "dense_linear", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    with torch.no_grad():
        fused = mlp(x)
        assert [("up" in kw) for kw in calls] == [False, True]  # gate/up, then down with the activation
        mlp.down.dense_kernel = False  # plain decoding: cuBLAS, and the activation's own launch
        torch.testing.assert_close(mlp(x), fused, rtol=1e-5, atol=1e-5)
    assert len(calls) == 3


@pytest.mark.parametrize("tiles", TILES.values(), ids=list(TILES))
@pytest.mark.parametrize("with_residual", [True, False])
def test_the_norm_is_made_as_the_tile_loads(tiles, with_residual):
    """dense_linear(x, w, norm=Norm(g, eps, residual, total)): the product of rms_norm(x [+ residual]) * g
    in one launch, within fp32 rounding of fused.rms_norm's launch then the product (its sum of squares
    is a tf32x3 dot, not the norm kernel's reduction), the sum stored to `total` bit for bit, and every
    row the same bits alone as in any batch."""
    from flashtree.kernels.dense_matmul import Norm
    from flashtree.kernels.fused import rms_norm

    gen = torch.Generator().manual_seed(5)
    w, g = torch.randn(40, 96, generator=gen), torch.randn(96, generator=gen)
    x, res = torch.randn(2, 23, 96, generator=gen)
    residual = res if with_residual else None

    def product(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        total = torch.full_like(x[rows], float("nan"))
        return dense_linear(
            x[rows], w, tiles, norm=Norm(g, 1e-6, res[rows] if with_residual else None, total)
        ), total

    got, total = product(slice(None))
    if with_residual:
        want_total, normed = rms_norm(x, g, 1e-6, residual=residual)
        assert torch.equal(total, want_total)
    else:
        normed = rms_norm(x, g, 1e-6)
    want = dense_linear(normed, w, tiles)
    assert (got - want).abs().max() <= TOL * want.abs().max()
    for i in (0, 7, 22):
        alone, total_alone = product(slice(i, i + 1))
        assert torch.equal(alone, got[i : i + 1])
        assert not with_residual or torch.equal(total_alone, total[i : i + 1])


def test_a_decoder_layer_leaves_its_norms_to_the_dense_kernel(monkeypatch, tiny_root, kernels_path):
    """A tiny llama's decode step on the dense kernel: q/k/v and gate/up make their input's norm, down its
    SwiGLU activation, as they load it: no norm launch but the final one; the logits within fp32
    rounding of the step with the norms' own launches."""
    from flashtree.kernels import fused
    from flashtree.models.layers import MergedLinear
    from flashtree.models.loader import load_target
    from tests.tiny import tiny_gguf

    kernels_path("triton")
    model, _ = load_target(tiny_gguf("llama", 0, tiny_root), device="cpu", dtype=torch.float32)
    ids = torch.randint(0, 320, (5,), generator=torch.Generator().manual_seed(3))

    def step() -> tuple[torch.Tensor, list[dict], int]:
        calls, norms = [], []
        real_dense, real_norm = dense_matmul.dense_linear, fused.rms_norm
        with monkeypatch.context() as mp:
            mp.setattr(
                dense_matmul, "dense_linear", lambda *a, **kw: calls.append(kw) or real_dense(*a, **kw)
            )
            mp.setattr(fused, "rms_norm", lambda *a, **kw: norms.append(1) or real_norm(*a, **kw))
            state = model.new_state(16)
            with torch.no_grad():
                model(ids[:4], state)  # prefill: 4 rows, the dense kernel too
                state.advance(4)
                logits = model(ids[4:], state).logits
        return logits, calls, len(norms)

    fused_logits, calls, norm_launches = step()
    layers = model.config.n_layers
    assert sum("norm" in kw for kw in calls) == 2 * 2 * layers  # q/k/v and gate/up, prefill and step
    assert sum("up" in kw for kw in calls) == 2 * layers
    assert norm_launches == 2  # the final norm, once a forward
    monkeypatch.setattr(MergedLinear, "defers_norm", lambda self, x: False)
    own_logits, _, norm_launches = step()
    assert norm_launches == 2 * (2 * layers + 1)
    torch.testing.assert_close(fused_logits, own_logits, rtol=1e-5, atol=1e-5)


def test_a_normed_input_a_matmul_does_not_take_is_made_first(kernels_path):
    """A NormedInput given to a product off the dense kernel: its norm's own launch first, the sum stored
    to `total` as the dense kernel would store it."""
    from flashtree.models.layers import NormedInput, add_rms_norm

    kernels_path("triton")
    gen = torch.Generator().manual_seed(6)
    x, res = torch.randn(2, 3, 16, generator=gen)
    g, layer = torch.randn(16, generator=gen), Linear(torch.randn(8, 16, generator=gen))
    layer.dense_kernel = False  # cuBLAS: it cannot make the norm
    total = torch.full_like(x, float("nan"))
    with torch.no_grad():
        got = layer(NormedInput(x, dense_matmul.Norm(g, 1e-6, res, total)))
        h, normed = add_rms_norm(x, res, g, 1e-6)
    assert torch.equal(total, h)
    assert torch.equal(got, F.linear(normed.x, layer.weight))


def test_splits_come_from_the_shape_only():
    # (row tiles, K blocks, programs wanted), as dense_linear asks qmatmul.k_splits
    assert k_splits(2, 9, 64) == (9, 1)
    assert k_splits(64, 9, 64) == (1, 9)
    assert k_splits(16, 9, 64) == (3, 3)
    splits, per_split = k_splits(3, 10, 16)
    assert (splits - 1) * per_split < 10 <= splits * per_split


def test_dense_linear_keeps_leading_dims_and_reads_strided_rows():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(24, 48, generator=gen)
    merged = torch.randn(2, 3, 100, generator=gen)
    x = merged[..., 10:58]  # rows with a stride, as a head view of a merged projection
    got = dense_linear(x, w)
    assert got.shape == (2, 3, 24)
    torch.testing.assert_close(got, x @ w.t(), atol=1e-5, rtol=1e-5)


def test_linear_takes_the_kernel_only_for_fp32_decode_rows_outside_autograd(monkeypatch, kernels_path):
    calls = []
    kernels_path("triton")
    monkeypatch.setattr(dense_matmul, "dense_linear", lambda x, w, tiles: calls.append(x) or F.linear(x, w))
    layer = Linear(torch.randn(8, 16))
    with torch.no_grad():
        layer(torch.randn(1, 23, 16))
        assert len(calls) == 1
        layer(torch.randn(65, 16))  # a prefill chunk: cuBLAS
        Linear(torch.randn(8, 16).bfloat16())(torch.randn(3, 16).bfloat16())  # bf16 models: torch / packed
        layer.dense_kernel = False  # plain decoding: cuBLAS (use_dense_kernel)
        layer(torch.randn(3, 16))
    layer.dense_kernel = True
    layer(torch.randn(3, 16, requires_grad=True))  # training: autograd needs the torch op
    assert len(calls) == 1


def test_engine_load_takes_the_kernel_for_speculative_decoding_only(monkeypatch, tiny_root, tmp_path):
    """The target's dense matrices (and so the draft's shared LM head) run the batch-invariant kernel
    when the engine decodes speculatively, cuBLAS when it does not; the settings may say which.
    The draft's own matrices keep the kernel (nothing is verified against them; it is the faster one
    at a draft block's 16 rows)."""
    from spec_util import random_draft_dir

    from flashtree.engine.generate import Engine
    from tests.tiny import tiny_gguf

    def kernel_flags(model):
        return {m.dense_kernel for m in model.modules() if isinstance(m, Linear)}

    target = tiny_gguf("llama", 0, tiny_root)
    draft = random_draft_dir(target, tmp_path)
    engine = Engine.load(target, draft, max_ctx=64, device="cpu", settings=Settings())
    assert kernel_flags(engine.target) == {True}
    assert kernel_flags(engine.draft) == {True}
    assert kernel_flags(Engine.load(target, draft, mode="ar", max_ctx=64, device="cpu").target) == {False}
    assert kernel_flags(Engine.load(target, "none", max_ctx=64, device="cpu").target) == {False}
    on, off = (Settings(kernels=KernelConfig(dense_kernel=flag)) for flag in (True, False))
    assert kernel_flags(Engine.load(target, "none", max_ctx=64, device="cpu", settings=on).target) == {True}
    assert kernel_flags(Engine.load(target, draft, max_ctx=64, device="cpu", settings=off).target) == {False}


def test_tiles_are_chosen_per_matrix_shape():
    kernels = KernelConfig(dense_tiles={"default": TILES["default"], "40x96": TILES["splits-fused"]})
    assert dense_matmul.tiles_for(40, 96, kernels) == TILES["splits-fused"]
    assert dense_matmul.tiles_for(96, 40, kernels) == TILES["default"]
    with pytest.raises(FlashtreeError, match='"default"'):
        KernelConfig(dense_tiles={"40x96": TILES["splits-fused"]})


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_verify_rows_equal_the_ar_steps_with_every_kernel(family, tiny_root, kernels_path):
    """Every decode-path kernel inside the model (dense matmul, norms, rotary, attention): each chain
    node of a tree verify gives the logits of the AR step for its token bit for bit, so speculative
    greedy output equals plain decoding by construction, not by fp32 rounding luck."""
    from flashtree.models.loader import load_target
    from tests.spec_util import verify_and_ar_logits
    from tests.tiny import tiny_gguf

    kernels_path("triton")
    model, _ = load_target(tiny_gguf(family, 0, tiny_root), device="cpu", dtype=torch.float32)
    ids = torch.randint(0, 320, (30,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # nodes 0, 1, 2: a chain
        tree, steps = verify_and_ar_logits(model, ids, [-1, 0, 1, 0, 3, 4, 2], 20)
    assert torch.equal(tree[:3], steps)
