"""The Triton tree DeltaNet kernel vs the torch recurrence, on CPU through Triton's interpreter."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is compiled: run it on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402

from flashtree.kernels.tree_deltanet import tree_gated_delta_rule  # noqa: E402
from flashtree.models.deltanet import delta_rule_inputs, recurrent_delta_rule  # noqa: E402

TREES = {
    "single": [-1],  # the AR step
    "chain": [-1, 0, 1, 2, 3],
    "tree": [-1, 0, 1, 0, 3, 1, 5, 2, -1],  # siblings, a branch back up, a second root child
}
# (key heads, value heads, k_dim, v_dim)
SHAPES = {"pow2": (1, 3, 16, 8), "ragged": (2, 4, 12, 40)}


def raw_inputs(t, nk, nv, kd, vd, seed):
    """What the layer hands the recurrence: conv output, the alpha / beta projections as column slices
    of one wider projection (as MergedLinear returns them), dt_bias, ssm_a and a state."""
    gen = torch.Generator().manual_seed(seed)
    conv_out = torch.randn(t, 2 * nk * kd + nv * vd, generator=gen)
    conv_out[0, :kd] = 0.0  # an all-zero q head: eps decides
    projection = torch.randn(t, 5 + 2 * nv, generator=gen) * 3  # includes softplus's linear range
    projection[:, 5] = 25.0
    alpha, beta = projection[:, 5 : 5 + nv], projection[:, 5 + nv :]
    dt_bias = torch.randn(nv, generator=gen)
    ssm_a = -torch.rand(nv, generator=gen) * 2
    s0 = torch.randn(nv, kd, vd, generator=gen) * 0.3
    return conv_out, alpha, beta, dt_bias, ssm_a, s0


@pytest.mark.parametrize("tile", [(16, 4), (8, 1)], ids=["bv16-w4", "bv8-w1"])
@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
@pytest.mark.parametrize("tree", TREES, ids=list(TREES))
def test_tree_kernel_matches_torch_recurrence(shape, tree, tile):
    nk, nv, kd, vd = SHAPES[shape]
    parents = torch.tensor(TREES[tree])
    t = parents.shape[0]
    conv_out, alpha, beta, dt_bias, ssm_a, s0 = raw_inputs(t, nk, nv, kd, vd, seed=t + kd)
    inputs = delta_rule_inputs(conv_out, alpha, beta, dt_bias, ssm_a, nk, kd, vd)
    ref_o, ref_states = recurrent_delta_rule(*inputs, s0, parents.tolist())
    o, states = tree_gated_delta_rule(conv_out, alpha, beta, dt_bias, ssm_a, s0, parents, nk, tile=tile)
    torch.testing.assert_close(o, ref_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, ref_states, atol=1e-5, rtol=1e-5)


def test_tree_kernel_token_does_not_depend_on_the_launch():
    """A chain in one launch equals the same tokens one launch each, every state carried over: the
    AR step and the verify pass compute each token bit for bit alike."""
    nk, nv, kd, vd = SHAPES["ragged"]
    t = 5
    conv_out, alpha, beta, dt_bias, ssm_a, s0 = raw_inputs(t, nk, nv, kd, vd, seed=1)
    chain = torch.arange(-1, t - 1)
    o, states = tree_gated_delta_rule(conv_out, alpha, beta, dt_bias, ssm_a, s0, chain, nk)
    state = s0
    for i in range(t):
        step = slice(i, i + 1)
        o_i, s_i = tree_gated_delta_rule(
            conv_out[step], alpha[step], beta[step], dt_bias, ssm_a, state, torch.tensor([-1]), nk
        )
        assert torch.equal(o_i[0], o[i]) and torch.equal(s_i[0], states[i])
        state = s_i[0]


def test_qwen35_decode_and_verify_with_the_kernels_match_the_torch_path(tiny_root, kernels_path):
    """The kernels inside the model (as on the GPU; the rotary kernel of its attention layers too): AR
    steps and a tree verify after a prefill give the torch path's logits, and the verify's chain rows
    give the AR steps' logits."""
    from flashtree.models.loader import load_target
    from tests.spec_util import verify_and_ar_logits
    from tests.tiny import tiny_gguf

    model, _ = load_target(tiny_gguf("qwen35", 0, tiny_root), device="cpu", dtype=torch.float32)
    ids = torch.randint(0, 320, (30,), generator=torch.Generator().manual_seed(0))
    parents = [-1, 0, 1, 0, 3, 4]  # nodes 0, 1, 2: a chain

    torch_tree, torch_steps = verify_and_ar_logits(model, ids, parents, 20)
    kernels_path("triton")
    kernel_tree, kernel_steps = verify_and_ar_logits(model, ids, parents, 20)
    torch.testing.assert_close(kernel_tree, torch_tree, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kernel_steps, torch_steps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kernel_tree[:3], kernel_steps, atol=1e-5, rtol=1e-5)


def test_single_token_may_write_its_state_in_place():
    """The AR step passes its state as the output: same bits as a separate output; refused for more
    tokens (a later token would read a state already overwritten)."""
    nk, nv, kd, vd = SHAPES["ragged"]
    conv_out, alpha, beta, dt_bias, ssm_a, s0 = raw_inputs(3, nk, nv, kd, vd, seed=3)
    root = torch.tensor([-1])
    o, states = tree_gated_delta_rule(conv_out[:1], alpha[:1], beta[:1], dt_bias, ssm_a, s0, root, nk)
    state = s0.clone()
    o_in_place, _ = tree_gated_delta_rule(
        conv_out[:1], alpha[:1], beta[:1], dt_bias, ssm_a, state, root, nk, states=state[None]
    )
    assert torch.equal(o_in_place, o) and torch.equal(state, states[0])
    with pytest.raises(ValueError, match="single token"):
        chain = torch.tensor([-1, 0])
        tree_gated_delta_rule(
            conv_out[:2], alpha[:2], beta[:2], dt_bias, ssm_a, state, chain, nk, states=state[None]
        )


def test_bf16_projections_are_widened_in_the_kernel():
    """alpha / beta as bf16 column slices of one projection (the 27B's activations): the same bits as
    handing the kernel their fp32 copies (the widening is exact), and no copy of them is needed."""
    nk, nv, kd, vd = SHAPES["ragged"]
    parents = torch.tensor(TREES["tree"])
    conv_out, alpha, beta, dt_bias, ssm_a, s0 = raw_inputs(parents.shape[0], nk, nv, kd, vd, seed=7)
    projection = torch.cat([alpha, beta], dim=1).bfloat16()
    alpha16, beta16 = projection[:, :nv], projection[:, nv:]
    o, states = tree_gated_delta_rule(conv_out, alpha16, beta16, dt_bias, ssm_a, s0, parents, nk)
    ref_o, ref_states = tree_gated_delta_rule(
        conv_out, alpha16.float(), beta16.float(), dt_bias, ssm_a, s0, parents, nk
    )
    assert torch.equal(o, ref_o) and torch.equal(states, ref_states)


def ancestry(parents: list[int], node: int) -> list[int]:
    """The root-first path of block tokens ending at `node`."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


@pytest.mark.parametrize("replay", ["kernel", "torch"])
def test_commit_replay_rebuilds_every_node_state_bit_for_bit(kernels_path, replay):
    """The commit's replay of an accepted path, every layer in one call, from the verify's kept conv
    output, decays and betas, ends in exactly the state the verify walk computed for the path's last
    node: for each node of a tree with siblings and a branch back up, as the deepest accepted one.
    `kernel`: the Triton walk and replay (interpreted); `torch`: GatedDeltaNet's reference walk and
    deltanet's reference replay."""
    from flashtree.models.deltanet import replay_accepted

    kernels_path("triton" if replay == "kernel" else "torch")
    nk, nv, kd, vd = SHAPES["ragged"]
    parents = TREES["tree"]
    t, layers = len(parents), 3
    per_layer = [raw_inputs(t, nk, nv, kd, vd, seed=10 + i) for i in range(layers)]
    conv_out = torch.stack([p[0] for p in per_layer])
    committed = torch.stack([p[5] for p in per_layer])
    gates = torch.empty(layers, t, 2, nv)
    node_states = []
    for i, (c, alpha, beta, dt_bias, ssm_a, s0) in enumerate(per_layer):
        if replay == "kernel":
            walk = tree_gated_delta_rule(
                c, alpha, beta, dt_bias, ssm_a, s0, torch.tensor(parents), nk, gates=gates[i]
            )
            states = walk[1]
        else:  # as GatedDeltaNet.tree_recurrence walks on the CPU
            q, k, v, g, b = delta_rule_inputs(c, alpha, beta, dt_bias, ssm_a, nk, kd, vd)
            gates[i] = torch.stack([g.exp(), b], dim=1)
            states = recurrent_delta_rule(q, k, v, g, b, s0, parents, decay=g.exp())[1]
        node_states.append(states)
    _, _, _, g, b = delta_rule_inputs(*per_layer[0][:5], nk, kd, vd)
    torch.testing.assert_close(gates[0], torch.stack([g.exp(), b], dim=1), atol=1e-6, rtol=1e-6)
    for node in range(t):
        path = ancestry(parents, node)
        padded = torch.tensor(path + [i for i in range(t) if i not in path])  # fixed shape, as a step passes
        state = committed.clone()
        replay_accepted(conv_out, gates, padded, torch.tensor([len(path)]), state, nk, (16, 1))
        for layer in range(layers):
            assert torch.equal(state[layer], node_states[layer][node]), (node, layer)


def test_verify_keeps_only_the_states_its_siblings_restart_from():
    """keep (a verify's BlockLayout.restart_points): the tokens a sibling branch restarts from are the
    only states written, the outputs are the same bits, the other rows of `states` are left as they
    were (a 27B verify of 23 nodes wrote 3.4 GB of states no one read)."""
    from flashtree.models.block import BlockLayout

    nk, nv, kd, vd = SHAPES["ragged"]
    parents = torch.tensor(TREES["tree"])
    layout = BlockLayout.from_parents(parents)
    keep = layout.restart_points()
    assert keep.tolist() == [True, True, True] + [False] * 6  # 3, 5 and 7 restart from 0, 1 and 2
    assert not BlockLayout.chain(5).restart_points().any()
    t = parents.shape[0]
    conv_out, alpha, beta, dt_bias, ssm_a, s0 = raw_inputs(t, nk, nv, kd, vd, seed=3)
    o, states = tree_gated_delta_rule(conv_out, alpha, beta, dt_bias, ssm_a, s0, parents, nk)
    scratch = torch.full_like(states, float("nan"))
    kept_o, _ = tree_gated_delta_rule(
        conv_out, alpha, beta, dt_bias, ssm_a, s0, parents, nk, states=scratch, keep=keep.to(torch.int8)
    )
    assert torch.equal(kept_o, o)
    assert torch.equal(scratch[keep], states[keep])
    assert scratch[~keep].isnan().all()
