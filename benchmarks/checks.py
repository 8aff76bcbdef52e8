"""Device checks that a sweep repeats for each setting it times, and tests/gpu asserts at the defaults.

- check_attention: the decode/verify attention (kernels/attention.py) at the 27B's heads (bf16) and
  SmolLM2's (fp32), after 600 committed tokens, in a cache of 664 slots (splits of one or two tiles) and
  one of MAX_SPLIT x SPLITS_PER_CACHE slots (splits of several tiles): the masked SDPA within rounding,
  and every node of a tree equal to the AR step at its position (its path's K/V committed) bit for bit,
  with more (empty) splits launched too (tests/gpu/test_attention_gpu.py; gpu_attention.py per setting);
- check_tree_deltanet: the tree Gated DeltaNet (kernels/tree_deltanet.py) within 1e-5 of the torch
  reference in fp32 on a tree with siblings, and bit for bit: each token computed alone (from its
  parent's state) equal to its row of the whole launch, the AR step writing its state in place, the
  verify as the model runs it (gates kept, restart states only) and the commit's replay of each node's
  path (tests/gpu/test_tree_deltanet_gpu.py; gpu_deltanet.py per tile).
CUDA only.
"""

from __future__ import annotations

import itertools

import torch

from benchmarks import knobs
from flashtree.kernels.attention import split_positions, tree_attention
from flashtree.kernels.tree_deltanet import replay_path, tree_gated_delta_rule
from flashtree.models.block import BlockLayout
from flashtree.models.deltanet import delta_rule_inputs, recurrent_delta_rule

DEVICE = torch.device("cuda")
PARENTS = [-1, 0, 1, 0, 3, 1, 5, 2, -1]  # siblings, a branch back up, a second root child
TOL = 1e-5

# --- decode/verify attention ----------------------------------------------------------------------------

ATTENTION_HEADS = {  # (KV heads, heads, head dim, dtype)
    "27B heads bf16": (4, 24, 256, torch.bfloat16),
    "SmolLM2 heads fp32": (3, 9, 64, torch.float32),
}
ATTENTION_START = 600  # committed tokens before the tree
ATTENTION_CACHES = ("one-tile splits", "several-tile splits")


def attention_slots(cache: str) -> int:
    """A cache's slots: 64 past the tree's start (splits of one tile), or as many as the settings now
    in force cut into their longest splits (several tiles each)."""
    if cache == "one-tile splits":
        return ATTENTION_START + 64
    settings = knobs.attention_settings()
    return settings["MAX_SPLIT"] * settings["SPLITS_PER_CACHE"]


def check_attention_case(heads: str, cache: str) -> dict:
    """One head shape in one cache: {"kernel", "max_abs_err", "tol", "ok" (within tol of SDPA),
    "rows_bitwise" (every node equal to its AR step, and to a launch of more splits)}."""
    n_kv, n_heads, hd, dtype = ATTENTION_HEADS[heads]
    slots = attention_slots(cache)
    layout = BlockLayout.from_parents(torch.tensor(PARENTS, device=DEVICE))
    t, start = layout.size, ATTENTION_START
    paths, depths = layout.paths().to(torch.int32), layout.depths.to(torch.int32)
    chain_path = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    gen = torch.Generator().manual_seed(hd)
    k, v = (torch.randn(n_kv, slots, hd, generator=gen).to(DEVICE, dtype) for _ in range(2))
    q = torch.randn(t, n_heads, hd, generator=gen).to(DEVICE, dtype)
    start_t = torch.tensor(start, device=DEVICE)
    got = tree_attention(q, k, v, start_t, paths, depths, start + t, hd**-0.5)
    rel = torch.arange(start + t, device=DEVICE) - start
    visible = layout.visible.gather(1, rel.clamp(0, t - 1)[None, :].expand(t, -1))
    mask = (rel < 0)[None, :] | ((rel >= 0)[None, :] & visible)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], k[None, :, : start + t].float(), v[None, :, : start + t].float(),
        attn_mask=mask, scale=hd**-0.5, enable_gqa=True,
    )[0].transpose(0, 1)  # fmt: skip
    err = (got.float() - want).abs().max().item()
    more = start + 3 * split_positions(slots)  # keys: more (empty) splits launched
    alone = torch.equal(tree_attention(q, k, v, start_t, paths, depths, more, hd**-0.5), got)
    for node in range(t):
        depth = int(layout.depths[node])
        ks, vs = k.clone(), v.clone()
        for j in range(depth + 1):
            src = start + int(layout.paths()[node, j])
            ks[:, start + j], vs[:, start + j] = k[:, src], v[:, src]
        step = tree_attention(
            q[node : node + 1], ks, vs, torch.tensor(start + depth, device=DEVICE), chain_path,
            depths[:1] * 0, start + depth + 1, hd**-0.5,
        )  # fmt: skip
        alone &= torch.equal(step[0], got[node])
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    return {
        "kernel": f"attention {heads} cache {slots}", "max_abs_err": err, "tol": tol, "ok": err < tol,
        "rows_bitwise": alone,
    }  # fmt: skip


def check_attention() -> list[dict]:
    """check_attention_case for every head shape and cache, under the settings now in force."""
    return [check_attention_case(h, c) for h, c in itertools.product(ATTENTION_HEADS, ATTENTION_CACHES)]


# --- tree Gated DeltaNet --------------------------------------------------------------------------------


def check_tree_deltanet(tile: tuple[int, int] | None = None) -> dict:
    """The kernel at `tile` (None: its default) at the 27B's heads: {"kernel", "max_abs_err", "ok"
    (within TOL of the reference), "rows_bitwise" (all of "bitwise": alone, in_place, verify, replay)}."""
    gen = torch.Generator().manual_seed(0)
    nk, nv, kd, vd = 16, 48, 128, 128  # the 27B's heads
    t = len(PARENTS)
    projection = torch.randn(t, 2 * nv, generator=gen) * 3
    conv_out, alpha, beta, dt_bias, ssm_a, s0 = (
        x.to(DEVICE)
        for x in (
            torch.randn(t, 2 * nk * kd + nv * vd, generator=gen),
            projection[:, :nv],
            projection[:, nv:],
            torch.randn(nv, generator=gen),
            -torch.rand(nv, generator=gen) * 2,
            torch.randn(nv, kd, vd, generator=gen) * 0.3,
        )
    )
    parents = torch.tensor(PARENTS, dtype=torch.int32, device=DEVICE)
    o, states = tree_gated_delta_rule(conv_out, alpha, beta, dt_bias, ssm_a, s0, parents, nk, tile=tile)
    inputs = delta_rule_inputs(conv_out, alpha, beta, dt_bias, ssm_a, nk, kd, vd)
    ref_o, ref_states = recurrent_delta_rule(*inputs, s0, PARENTS)
    err = max((o - ref_o).abs().max().item(), (states - ref_states).abs().max().item())
    same, root = {"alone": True}, torch.tensor([-1], dtype=torch.int32, device=DEVICE)
    for i, p in enumerate(PARENTS):  # each node alone, from its parent's state as the kernel left it
        step = slice(i, i + 1)
        start = s0 if p < 0 else states[p]
        o_i, s_i = tree_gated_delta_rule(
            conv_out[step], alpha[step], beta[step], dt_bias, ssm_a, start, root, nk, tile=tile
        )
        same["alone"] &= torch.equal(o_i[0], o[i]) and torch.equal(s_i[0], states[i])
    # the AR step writes the new state over the old one (states=state): the same bits
    state = s0.clone()
    o_0, _ = tree_gated_delta_rule(
        conv_out[:1], alpha[:1], beta[:1], dt_bias, ssm_a, state, root, nk, states=state[None], tile=tile
    )
    same["in_place"] = torch.equal(o_0[0], o[0]) and torch.equal(state, states[0])
    # the verify as the model runs it (gates kept, only the restart points' states stored): the same outputs
    # and kept states; its gates feed the commit's replay of each node's ancestry (two layers' copies of the
    # walk), which ends in that node's state
    gates = torch.empty(2, t, 2, nv, device=DEVICE)
    restarts = BlockLayout.from_parents(parents.long()).restart_points()
    kept = torch.zeros_like(states)
    o_v, _ = tree_gated_delta_rule(
        conv_out, alpha, beta, dt_bias, ssm_a, s0, parents, nk, states=kept, tile=tile, gates=gates[0],
        keep=restarts.to(torch.int8),
    )  # fmt: skip
    same["verify"] = torch.equal(o_v, o) and torch.equal(kept[restarts], states[restarts])
    gates[1] = gates[0]
    same["replay"] = True
    for node in range(t):
        path = [node]
        while PARENTS[path[-1]] >= 0:
            path.append(PARENTS[path[-1]])
        path = torch.tensor(path[::-1], dtype=torch.int32, device=DEVICE)
        replayed = torch.stack([s0, s0]).contiguous()
        count = torch.tensor([path.shape[0]], dtype=torch.int32, device=DEVICE)
        replay_path(torch.stack([conv_out, conv_out]), gates, path, count, replayed, nk, tile=tile)
        same["replay"] &= torch.equal(replayed[0], states[node]) and torch.equal(replayed[1], states[node])
    return {
        "kernel": "tree_deltanet", "max_abs_err": err, "ok": err < TOL, "rows_bitwise": all(same.values()),
        "bitwise": same,
    }  # fmt: skip
