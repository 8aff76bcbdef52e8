"""DeltaNet recurrences against transformers' reference implementations, and tree vs chain."""

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from flashtree.models.block import BlockLayout
from flashtree.models.deltanet import chunked_delta_rule, l2_normalize, recurrent_delta_rule

TOL = dict(atol=2e-5, rtol=1e-4)  # fp32, sequences up to 150 tokens


def inputs(t, h=3, dk=8, dv=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, dk, generator=g)
    k = torch.randn(t, h, dk, generator=g)
    v = torch.randn(t, h, dv, generator=g)
    decay = -torch.rand(t, h, generator=g) * 0.5
    beta = torch.rand(t, h, generator=g)
    s0 = torch.randn(h, dk, dv, generator=g) * 0.3
    return q, k, v, decay, beta, s0


def ours_prepared(q, k):
    return l2_normalize(q) * q.shape[-1] ** -0.5, l2_normalize(k)


@pytest.mark.parametrize("t", [1, 5, 64, 150])
def test_chunked_and_recurrent_match_transformers(t):
    q, k, v, g, beta, s0 = inputs(t, seed=t)
    args = (q[None], k[None], v[None], g[None], beta[None])
    opts = dict(initial_state=s0[None], output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref_o, ref_s = torch_recurrent_gated_delta_rule(*args, **opts)
    ref_co, ref_cs = torch_chunk_gated_delta_rule(*args, **opts)
    qn, kn = ours_prepared(q, k)
    o, states = recurrent_delta_rule(qn, kn, v, g, beta, s0, list(range(-1, t - 1)))
    co, cs = chunked_delta_rule(qn, kn, v, g, beta, s0)
    torch.testing.assert_close(o, ref_o[0], **TOL)
    torch.testing.assert_close(states[-1], ref_s[0], **TOL)
    torch.testing.assert_close(co, ref_co[0], **TOL)
    torch.testing.assert_close(cs, ref_cs[0], **TOL)


def test_tree_node_equals_chain_along_its_path():
    # Tree: 0 <- 1 <- 2, 0 <- 3, 1 <- 4 <- 5 ; every node must equal running its root path as a chain.
    parents = torch.tensor([-1, 0, 1, 0, 1, 4])
    q, k, v, g, beta, s0 = inputs(6, seed=7)
    qn, kn = ours_prepared(q, k)
    o, states = recurrent_delta_rule(qn, kn, v, g, beta, s0, parents.tolist())
    layout = BlockLayout.from_parents(parents)
    for node in range(6):
        path = torch.nonzero(layout.visible[node]).flatten()  # ancestors + self, in order
        po, ps = recurrent_delta_rule(
            qn[path], kn[path], v[path], g[path], beta[path], s0, list(range(-1, len(path) - 1))
        )
        torch.testing.assert_close(o[node], po[-1], atol=0, rtol=0)
        torch.testing.assert_close(states[node], ps[-1], atol=0, rtol=0)
    assert layout.depths.tolist() == [0, 1, 2, 1, 2, 3]


def test_conv_window_index_follows_ancestry():
    layout = BlockLayout.from_parents(torch.tensor([-1, 0, 1, 0, 3]))
    idx = layout.conv_window_index(4)  # rows index [state0, state1, state2, n0, n1, n2, n3, n4]
    assert idx.tolist() == [
        [0, 1, 2, 3],  # n0: the three committed inputs, then itself
        [1, 2, 3, 4],
        [2, 3, 4, 5],
        [1, 2, 3, 6],  # n3 is a sibling of n1: window skips n1, n2
        [2, 3, 6, 7],
    ]
    chain = BlockLayout.chain(5).conv_window_index(4)
    assert chain.tolist() == [[i, i + 1, i + 2, i + 3] for i in range(5)]


def test_l2_normalize_is_the_formula_and_row_independent():
    """Written as RMSNorm for its row-invariant kernel; it must still be x / sqrt(sum(x^2) + eps), and
    a row's result must not depend on how many rows come with it (verify rows vs the AR step)."""
    x = torch.randn(23, 4, 16, generator=torch.Generator().manual_seed(0)) * 3
    x[0, 0] = 0.0  # eps matters here
    formula = x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)
    y = l2_normalize(x)
    torch.testing.assert_close(y, formula, atol=0, rtol=3e-7)  # within an ulp or two
    assert torch.equal(torch.cat([l2_normalize(x[i : i + 1]) for i in range(len(x))]), y)
