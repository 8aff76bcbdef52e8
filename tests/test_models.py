"""Our GGUF-loaded models against Hugging Face transformers on tiny random models (fp32)."""

import pytest
import torch
from spec_util import feed

from flashtree.errors import FlashtreeError
from flashtree.models.block import BlockLayout
from flashtree.models.layers import grouped_attention
from flashtree.models.loader import load_target
from tests.tiny import hf_model, tiny_gguf

FAMILIES = ["llama", "qwen3", "qwen35"]
TOL = dict(atol=2e-4, rtol=2e-4)  # fp32 logits of magnitude ~1-10; chunked vs recurrent DeltaNet forms


def load(family, seed, tiny_root):
    model, _ = load_target(tiny_gguf(family, seed, tiny_root), device="cpu", dtype=torch.float32)
    return model


def prompt(n, vocab=320, seed=0):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", [0, 1])
def test_full_prompt_logits_match_transformers(family, seed, tiny_root):
    ours = load(family, seed, tiny_root)
    ref = hf_model(family, seed)
    ids = prompt(150, seed=seed)  # > one 64-token DeltaNet chunk
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    got = ours(ids, ours.new_state(256), logits="all").logits
    torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_after_chunked_prefill_matches_transformers(family, tiny_root):
    ours = load(family, 1, tiny_root)
    ref = hf_model(family, 1)
    ids = prompt(90, seed=3)
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    state = ours.new_state(128)
    got = []
    for lo, hi in [(0, 37), (37, 70), (70, 71)]:  # prefill in uneven chunks...
        got.append(feed(ours, ids[lo:hi], state, logits="all").logits)
    for i in range(71, 90):  # ...then token-by-token decode
        got.append(feed(ours, ids[i : i + 1], state, logits="all").logits)
    torch.testing.assert_close(torch.cat(got), expected, **TOL)
    assert state.seq_len == 90


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_identical_to_transformers(family, tiny_root):
    ours = load(family, 0, tiny_root)
    ref = hf_model(family, 0)
    ids = prompt(12, seed=5)
    with torch.no_grad():
        expected = ref.generate(ids[None], max_new_tokens=64, do_sample=False, min_new_tokens=64,
                                pad_token_id=0)[0, 12:].tolist()  # fmt: skip
    state = ours.new_state(128)
    logits = feed(ours, ids, state, logits="last").logits
    got = []
    for _ in range(64):
        tok = int(logits.argmax(-1))
        got.append(tok)
        logits = feed(ours, torch.tensor([tok]), state, logits="last").logits
    assert got == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_verify_equals_chain_per_branch(family, tiny_root):
    """Each tree node's logits and features equal a plain causal pass over its root path."""
    ours = load(family, 0, tiny_root)
    ids = prompt(20, seed=9)
    parents = torch.tensor([-1, 0, 1, 0, 3, 1, 5, 2])
    tokens = prompt(8, seed=11)
    layout = BlockLayout.from_parents(parents)
    state = ours.new_state(64)
    feed(ours, ids, state, logits="none")
    tree = ours(tokens, state, layout, commit=False, capture=(0, 1))
    for node in range(8):
        path = torch.nonzero(layout.visible[node]).flatten()
        ref_state = ours.new_state(64)
        feed(ours, ids, ref_state, logits="none")
        chain = feed(ours, tokens[path], ref_state, capture=(0, 1))
        torch.testing.assert_close(tree.logits[node], chain.logits[-1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(tree.features[node], chain.features[-1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_commit_path_state_equals_ar_state(family, tiny_root):
    """After committing a tree path, KV, DeltaNet and conv state equal an AR run over the same tokens
    (up to fp32 rounding: a 7-token matmul rounds differently from 1-token ones)."""
    ours = load(family, 1, tiny_root)
    ids = prompt(30, seed=2)
    parents = torch.tensor([-1, 0, 1, 0, 3, 4, 2])
    tokens = prompt(7, seed=4)
    state = ours.new_state(64)
    feed(ours, ids, state, logits="none")
    ours(tokens, state, BlockLayout.from_parents(parents), commit=False, logits="none")
    path = torch.tensor([0, 3, 4, 5])
    state.commit_path(path, torch.tensor(4))
    state.advance(4)

    ref = ours.new_state(64)
    feed(ours, ids, ref, logits="none")
    for t in tokens[path]:
        feed(ours, t[None], ref, logits="none")
    assert state.seq_len == ref.seq_len == 34
    for a, b in zip(state.layers, ref.layers, strict=True):
        if hasattr(a, "k"):
            torch.testing.assert_close(a.k.data[:, :34], b.k.data[:, :34], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(a.v.data[:, :34], b.v.data[:, :34], atol=1e-5, rtol=1e-4)
        else:
            torch.testing.assert_close(a.recurrent, b.recurrent, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(a.conv, b.conv, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("n", [2, 9])  # fewer prompt tokens than the conv's kernel - 1 (3), and more
def test_a_prefill_leaves_the_conv_state_of_token_by_token_steps(n, tiny_root):
    """The chunked prefill keeps its last kernel-1 conv inputs (of the prompt, or state rows and the
    prompt when it is shorter) as AR steps over the same tokens would (up to the in-projection's fp32
    rounding: an n-token matmul rounds differently from 1-token ones)."""
    ours = load("qwen35", 1, tiny_root)
    ids = prompt(n, seed=5)
    state, ref = ours.new_state(32), ours.new_state(32)
    feed(ours, ids, state, logits="none")
    for t in ids:
        feed(ours, t[None], ref, logits="none")
    for a, b in zip(state.layers, ref.layers, strict=True):
        if not hasattr(a, "k"):
            torch.testing.assert_close(a.conv, b.conv, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_states_are_slices_of_one_store_per_kind(family, tiny_root):
    """So that commit_path moves every layer's accepted K/V, and adopts every DeltaNet layer's state, in
    one gather and one write per tensor."""
    state = load(family, 0, tiny_root).new_state(16)
    kinds = {"k": [s for s in state.layers if hasattr(s, "k")]}
    kinds["recurrent"] = [s for s in state.layers if hasattr(s, "recurrent")]
    assert len(state.stores) == sum(bool(layers) for layers in kinds.values())
    for store in state.stores:
        first = "k" if hasattr(store, "k") else "recurrent"
        layers = kinds[first]
        tensor = (lambda plane: plane.data) if first == "k" else (lambda t: t)  # K/V: planes' data
        assert tensor(getattr(store, first)).shape[0] == len(layers) > 0
        for i, layer in enumerate(layers):
            for name in ("k", "v") if first == "k" else ("recurrent", "conv"):
                assert tensor(getattr(layer, name)).data_ptr() == tensor(getattr(store, name))[i].data_ptr()


@pytest.mark.parametrize("family", FAMILIES)
def test_truncate_rewinds_attention_state_and_refuses_recurrent_state(family, tiny_root):
    ours = load(family, 0, tiny_root)
    ids, other = prompt(30, seed=6), prompt(5, seed=8)
    state = ours.new_state(64)
    feed(ours, ids, state, logits="none")
    feed(ours, prompt(5, seed=7), state, logits="none")
    if family == "qwen35":  # DeltaNet state cannot be rewound: a clear error, nothing changed
        with pytest.raises(FlashtreeError, match="cannot rewind"):
            state.truncate(30)
        assert state.seq_len == 35
        return
    state.truncate(30)
    fresh = ours.new_state(64)
    feed(ours, ids, fresh, logits="none")
    got, want = feed(ours, other, state).logits, feed(ours, other, fresh).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mask_kind", ["none", "shared", "per_batch"])
def test_grouped_attention_equals_sdpa_with_grouped_heads(mask_kind):
    """Query heads folded into rows (the draft's and the trainer's decoding attention) == SDPA's own
    grouped-query attention: 6 query heads on 2 KV heads, 2 sequences, 5 queries, 9 keys."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 5, 8, generator=gen, dtype=torch.float64)
    keys = torch.randn(2, 2, 9, 8, generator=gen, dtype=torch.float64)
    values = torch.randn(2, 2, 9, 8, generator=gen, dtype=torch.float64)
    mask = {
        "none": None,
        "shared": torch.rand(5, 9, generator=gen) < 0.6,
        "per_batch": torch.rand(2, 5, 9, generator=gen) < 0.6,
    }[mask_kind]
    if mask is not None:
        mask[..., 0] = True  # no empty row
    want_mask = None if mask is None else (mask if mask.ndim == 2 else mask[:, None])
    want = torch.nn.functional.scaled_dot_product_attention(
        q, keys, values, attn_mask=want_mask, scale=0.3, enable_gqa=True
    )
    torch.testing.assert_close(grouped_attention(q, keys, values, mask, 0.3), want, rtol=1e-12, atol=1e-12)
