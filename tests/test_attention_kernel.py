"""kernels/attention.py (decode/verify attention) on CPU through Triton's interpreter: the masked SDPA of
the torch path to fp32 rounding, and every verify row equal to the AR step at its position bit for bit
(keys at their positions, not at the tree's block slots), however many splits the call launches. Split
sizes follow the cache's length: one tile (a short cache) or several (a long one)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are compiled: run them on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flashtree.kernels import attention  # noqa: E402
from flashtree.kernels.attention import (  # noqa: E402
    MAX_SPLIT,
    ROWS_FROM_KEYS,
    SPLITS_PER_CACHE,
    TILE_POSITIONS,
    UNPACKED_FROM_KEYS,
    UNPACKED_QUERIES,
    VERIFY_QUERIES,
    WIDE_FROM_KEYS,
    block_attention,
    row_group,
    split_positions,
    tree_attention,
)
from flashtree.kernels.qmatmul import tile_counters  # noqa: E402
from flashtree.kernels.sm90 import compile_for_sm90, recording  # noqa: E402
from flashtree.models.block import BlockLayout  # noqa: E402
from flashtree.quant.kv import quantize  # noqa: E402

TREES = {
    "ar": [-1],
    "chain": [-1, 0, 1, 2],
    "tree": [-1, 0, 1, 0, 3, 1, 5, 2, 0],  # siblings, branches back up
}
# (kv heads, query heads, head_dim, committed tokens, cache slots): one split of one tile; six splits
# (a partial one) of one tile; three of eight tiles each (the cache is long: MAX_SPLIT-position splits);
# 20-21 splits of one tile (the combine's rounds: two of maxima, a ragged last one of sums); GQA 1, 2, 6
SHAPES = {
    "short": (2, 12, 32, 37, 90),
    "long": (1, 1, 24, 5 * TILE_POSITIONS + 26, 400),
    "long-cache": (1, 1, 24, 2 * MAX_SPLIT + 90, MAX_SPLIT * SPLITS_PER_CACHE),
    "many-splits": (1, 2, 256, 19 * TILE_POSITIONS + 5, 20 * TILE_POSITIONS),
}
# the verify's program: its rows as row_group gives them at these short contexts (2 at most), the rows
# that fill the tile (as from ROWS_FROM_KEYS keys: 16 rows of GQA-free heads, 8 of 2 heads a KV head), or
# the wider tile (the 27B's heads at a long context)
ROW_CASES = [
    *((shape, "short") for shape in SHAPES),
    ("long", "fill"),
    ("many-splits", "fill"),
    ("short", "wide"),
    ("short", "unpacked"),
]
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def case(shape, tree, dtype, seed=0):
    n_kv, n_heads, hd, start, slots = SHAPES[shape]  # the cache is longer than what is read
    layout = BlockLayout.from_parents(torch.tensor(TREES[tree]))
    t = layout.size
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(n_kv, slots, hd, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(t, n_heads, hd, generator=gen).to(dtype)
    return q, k, v, start, layout


def run(q, k, v, start, layout, n_keys=None, tile=None):
    t, hd = q.shape[0], q.shape[-1]
    path, depths = layout.paths().to(torch.int32), layout.depths.to(torch.int32)
    n_keys = n_keys or start + t
    return tree_attention(q, k, v, torch.tensor(start), path, depths, n_keys, hd**-0.5, tile=tile)


def sdpa(q, k, v, start, layout):
    """The torch path: every committed key and the row's ancestors, by mask over the block's slots."""
    t, hd = q.shape[0], q.shape[-1]
    rel = torch.arange(start + t) - start
    ancestor = layout.visible.gather(1, rel.clamp(0, t - 1)[None, :].expand(t, -1))
    mask = (rel < 0)[None, :] | ((rel >= 0)[None, :] & ancestor)
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None],
        k[None, :, : start + t].float(),
        v[None, :, : start + t].float(),
        attn_mask=mask,
        scale=hd**-0.5,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
@pytest.mark.parametrize("tree", TREES, ids=list(TREES))
@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_tree_attention_is_the_masked_softmax(shape, tree, dtype):
    q, k, v, start, layout = case(shape, tree, DTYPES[dtype])
    got = run(q, k, v, start, layout)
    assert got.dtype == q.dtype and got.shape == q.shape
    # fp32: rounding order only; bf16: the output's rounding (the interpreter's cast truncates)
    tol = 2e-6 if dtype == "f32" else 1e-2
    torch.testing.assert_close(got.float(), sdpa(q, k, v, start, layout), rtol=tol, atol=tol)
    # the last program of each (row, KV head) combined its splits and put its arrival counter back to
    # zero: the next call (or CUDA-graph replay) starts from zero
    assert not tile_counters(q.device, 1).any()


def test_splits_combine_under_the_largest_maximum_of_all():
    """A key whose score would overflow exp() unless every split's maximum is taken (the first split's
    here, with 20 after it): the combine rescales by the max over all splits, not over its last round."""
    q, k, v, start, layout = case("many-splits", "chain", torch.float32)
    k[0, 3] = q[0, 0] * 8.0  # score ~ 8 * |q|^2 / 16 ~ 128 for row 0's first head: exp(128) is not fp32
    got = run(q, k, v, start, layout)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, sdpa(q, k, v, start, layout), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
@pytest.mark.parametrize("shape, tile", ROW_CASES, ids=[f"{shape}-{tile}" for shape, tile in ROW_CASES])
def test_verify_rows_are_the_ar_steps_bit_for_bit(shape, dtype, tile):
    """Each tree node vs one AR step at its position after its path was committed (its ancestors' K/V
    moved to their positions, as commit_path does), and vs a call with more (empty) splits. The AR step's
    program takes its one row alone, the verify's as many rows as `tile` says (row_group's choice at the
    key counts where it takes that tile, launched here at the case's few keys; "unpacked": the 64-query
    tile of a long verify over a q4_0 / tq3_0 cache, 10 rows of the 27B's 6 heads)."""
    q, k, v, start, layout = case(shape, "tree", DTYPES[dtype], seed=1)
    group = q.shape[1] // k.shape[0]
    keys = {"short": start, "fill": ROWS_FROM_KEYS, "unpacked": UNPACKED_FROM_KEYS}.get(tile, WIDE_FROM_KEYS)
    want = {"short": min(2, 16 // group), "fill": 16 // group, "wide": 5, "unpacked": 10}[tile]  # 27B's 6
    rows = row_group(group, layout.size, keys, unpacks=tile == "unpacked")
    assert rows == (want, {"wide": VERIFY_QUERIES, "unpacked": UNPACKED_QUERIES}.get(tile, 16))
    assert row_group(group, 1, keys) == (1, 16)
    got = run(q, k, v, start, layout, tile=rows)
    more = start + 3 * split_positions(k.shape[1])
    assert torch.equal(run(q, k, v, start, layout, n_keys=more, tile=rows), got)
    paths = layout.paths()
    for node in range(layout.size):
        depth = int(layout.depths[node])
        ks, vs = k.clone(), v.clone()
        for j in range(depth + 1):  # the committed path: ancestor at depth j at slot start + j
            ks[:, start + j], vs[:, start + j] = k[:, start + paths[node, j]], v[:, start + paths[node, j]]
        step = run(q[node : node + 1], ks, vs, start + depth, BlockLayout.chain(1))
        assert torch.equal(step[0], got[node]), node


def test_rows_fill_the_query_tile_one_row_pads_to():
    # (query heads per KV head) -> (rows a program, query tile): 27B 6, SmolLM2 3, GQA-free 1, 8B 4, MQA 24
    groups = (6, 3, 1, 2, 4, 16, 24)
    narrow = [(2, 16), (5, 16), (16, 16), (8, 16), (4, 16), (1, 16), (1, 32)]
    alone = [(1, tile) for _, tile in narrow]  # the AR step: its row alone at any length
    assert [row_group(g, 1, 100) for g in groups] == alone
    assert [row_group(g, 1, 32768) for g in groups] == alone
    short = [(min(2, rows), tile) for rows, tile in narrow]  # a few hundred keys: 2 rows at most
    assert [row_group(g, 23, ROWS_FROM_KEYS - 1) for g in groups] == short
    assert [row_group(g, 23, WIDE_FROM_KEYS - 1) for g in groups] == narrow  # a longer context
    # a verify 23 at a long context: the wider tile only where it computes fewer query slots (the 27B:
    # 5 programs x 32 instead of 12 x 16); SmolLM2's 3 would take 3 x 32 instead of 5 x 16, the 8B's a tie
    assert [row_group(g, 23, WIDE_FROM_KEYS) for g in groups] == [(5, 32), *narrow[1:]]


def test_a_long_verify_over_an_unpacked_cache_takes_the_fewest_programs():
    """Over a q4_0 / tq3_0 cache (each program unpacks every tile it reads) from UNPACKED_FROM_KEYS keys:
    the tile of the fewest programs, the narrower of a tie; the 27B's 23 rows in 3 programs of 10 rows x
    64 queries instead of 5 of 5 x 32. Over float caches, at shorter contexts, and for the AR step: as
    before."""
    assert row_group(6, 23, UNPACKED_FROM_KEYS, unpacks=True) == (10, 64)
    assert row_group(6, 23, UNPACKED_FROM_KEYS - 1, unpacks=True) == (5, 32)
    assert row_group(6, 23, UNPACKED_FROM_KEYS) == (5, 32)
    assert row_group(3, 23, UNPACKED_FROM_KEYS, unpacks=True) == (16, 64)  # SmolLM2's 3: 2 programs, not 3
    assert row_group(1, 23, UNPACKED_FROM_KEYS, unpacks=True) == (16, 16)  # 2 programs of any tile: narrow
    assert row_group(24, 23, UNPACKED_FROM_KEYS, unpacks=True) == (2, 64)  # MQA: 12 programs, not 23
    assert row_group(6, 1, 65536, unpacks=True) == (1, 16)  # the AR step's row alone


@pytest.mark.parametrize("kinds", [("tq3_0", "tq3_0"), ("q4_0", "bf16")], ids=["tq3_0", "q4_0-k"])
def test_the_unpacked_tile_is_taken_and_keeps_the_rows_bits(kinds, monkeypatch):
    """tree_attention over a quantized cache takes the 64-query tile where row_group says (the threshold
    lowered to this case's keys), and its rows are those of the 32-query tile bit for bit."""
    q, k, v, start, layout = case("many-splits", "tree", torch.bfloat16, seed=2)
    q = torch.cat([q] * 3, dim=1)  # the 27B's 6 query heads a KV head
    k, v = (x if kind == "bf16" else quantize(x.float(), kind) for x, kind in zip((k, v), kinds, strict=True))
    path, depths = layout.paths().to(torch.int32), layout.depths.to(torch.int32)
    n_keys = start + layout.size
    wide = tree_attention(q, k, v, torch.tensor(start), path, depths, n_keys, 0.0625, tile=(5, 32))
    monkeypatch.setattr(attention, "UNPACKED_FROM_KEYS", n_keys)
    with recording() as found:
        got = tree_attention(q, k, v, torch.tensor(start), path, depths, n_keys, 0.0625)
    assert [(r["constexprs"]["R"], r["constexprs"]["QB"]) for r in found] == [(10, 64)]
    assert torch.equal(got, wide)


def test_split_sizes_follow_the_cache_between_one_tile_and_the_maximum():
    assert TILE_POSITIONS == 64
    assert split_positions(600) == 64  # a short cache: one tile a split
    assert split_positions(2048) == 64 and split_positions(4096 + 1) == 128
    assert split_positions(8192 + 1024) == 256  # an 8K context's cache
    assert split_positions(32768 + 1024) == MAX_SPLIT == 512  # a 32K one: the largest splits
    assert split_positions(256 * 1024) == MAX_SPLIT
    for slots in (90, 400, 5000, 70000):
        split = split_positions(slots)
        assert split % TILE_POSITIONS == 0 and split & (split - 1) == 0
        assert split in (MAX_SPLIT, TILE_POSITIONS) or slots <= split * SPLITS_PER_CACHE


@pytest.mark.parametrize("window", [None, 4, 40], ids=["alike", "window-4", "window-40"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=list(DTYPES))
@pytest.mark.parametrize("n_ctx", [5, 150])
def test_block_attention_is_the_draft_blocks_masked_softmax(n_ctx, dtype, window):
    """A draft block: every row over its context keys and the whole block (no causal order). Dead
    slots include whole splits (the first 70 and the last 30 of 150: a split of masked keys only adds
    nothing) and the kernel's masked scores never leak. With a sliding window each row sees its own
    context keys (row r at position n_ctx + r: the slots past n_ctx + r - window), so the rows that
    share a program's K/V tiles take different masks of them."""
    from flashtree.models.layers import grouped_attention

    n_kv, n_heads, hd, b = 3, 9, 32, 16
    gen = torch.Generator().manual_seed(n_ctx)
    q = torch.randn(b, n_heads, hd, generator=gen).to(dtype)
    keys, values = (torch.randn(n_kv, n_ctx + b, hd, generator=gen).to(dtype) for _ in range(2))
    live = torch.rand(n_ctx, generator=gen) < 0.7
    if n_ctx > 100:
        live[:70] = False
        live[-30:] = False
    key_ok = live[None, :].expand(b, -1)  # every row alike: one mask read by every row (stride 0)
    if window is not None:
        positions = n_ctx + torch.arange(b)
        key_ok = key_ok & (positions[:, None] - torch.arange(n_ctx)[None, :] < window)
        # rows differ but where the window spans the context (5 keys, 40) or only dead slots (150, 4)
        assert torch.equal(key_ok[0], key_ok[-1]) == ((n_ctx, window) in [(5, 40), (150, 4)])
    got = block_attention(q, keys, values, key_ok, hd**-0.5, n_ctx)  # the block right after the context
    # in a ring the block sits past the context slots: the same bits
    gap = torch.randn(n_kv, 7, hd, generator=gen).to(dtype)
    ring_k, ring_v = (torch.cat([t[:, :n_ctx], gap, t[:, n_ctx:]], dim=1) for t in (keys, values))
    assert torch.equal(block_attention(q, ring_k, ring_v, key_ok, hd**-0.5, n_ctx + 7), got)
    mask = torch.cat([key_ok, torch.ones(b, b, dtype=torch.bool)], dim=1)
    want = grouped_attention(q.transpose(0, 1)[None].float(), keys[None].float(), values[None].float(), mask,
                             hd**-0.5)[0].transpose(0, 1)  # fmt: skip
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_the_ar_steps_quantized_tiles_unpack_in_registers_on_sm90():
    """The AR step over q4_0 and tq3_0 caches at the 27B's heads compiled for sm_90 here: the loop over
    committed tiles copies K/V ahead (cp.async, the software pipeline) and feeds the dots with few
    shared-memory stores; q4_0's nibbles split along a trailing pair axis took 132 a tile through shared
    memory (bench/results/cpu-sm90-attention-loops-2026-12-07)."""
    gen = torch.Generator().manual_seed(0)
    launches = []
    for kind in ("q4_0", "tq3_0"):
        k, v = (quantize(torch.randn(4, 256, 256, generator=gen), kind) for _ in range(2))
        q = torch.randn(1, 24, 256, generator=gen).bfloat16()
        one = torch.ones(1, 1, dtype=torch.int32)
        with recording() as found:
            tree_attention(q, k, v, torch.tensor(255), one, one - 1, 256, 0.0625, dots="bf16")
        launches += [r for r in found if r["name"] == "_split_kernel"]
    for facts in compile_for_sm90(launches, also="sass"):
        assert facts["failure"] is None, facts["failure"]
        loop = facts["opcodes"]["pipelined_loop"]
        assert loop.get("LDGSTS", 0) > 0 and loop.get("HMMA", 0) > 0, loop
        assert loop.get("STS", 0) <= 32, loop
