"""spec/tree.py's DDTree build in one Triton program, where the torch path takes ~120 launches (a top-k,
adds and gathers per depth, two sorts, the ancestor matrix by repeated squaring): launches bound a
small model's tree step (bench/results/h200-step-2026-12-03/pair-b241d29: 15 top-k, 15 sorts and 15
elementwise launches per step for the depth loop alone).

The same selection as the torch path: per depth the `width` best (parent slot x rank) candidates by
score (the chain's bonus on slot 0 included), then the `n` best over all depths in a stable order,
ordered by depth. Scores are the same fp32 sums. Sorting is on int64 keys: the score's order-preserving
bits above, the complement of the candidate's index below, so equal scores go to the lower index
(torch's stable sort does the same; torch's per-depth top-k leaves ties unordered, so on exactly tied
scores the two may pick different but equally scored nodes). Scratch buffers in global memory hand
sorted vectors between threads of the program (a barrier after each store).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashtree.kernels.launch import pdl_options, wait_for_inputs

LOW = 0x7FFFFFFF  # index complement base: keys' low 32 bits


@triton.jit
def _key(score, index):
    """int64 sort key: descending order = higher score first, then lower index."""
    bits = score.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # monotone in the float's value
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - index).to(tl.int64)


@triton.jit
def _index(key):
    return 0x7FFFFFFF - (key & 0xFFFFFFFF).to(tl.int32)


@triton.jit
def _ddtree_kernel(
    logp_ptr, tok_ptr, root_ptr, tokens_ptr, parents_ptr, depths_ptr, visible_ptr,
    score_buf, pick_buf, sort_buf, node_buf,
    L: tl.constexpr, K: tl.constexpr, W: tl.constexpr, N: tl.constexpr, BONUS: tl.constexpr,
    BW: tl.constexpr, BK: tl.constexpr, BLW: tl.constexpr, BT: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(GDC)
    slot = tl.arange(0, BW)
    rank = tl.arange(0, BK)
    flat = slot[:, None] * K + rank[None, :]  # the torch path's candidate index
    valid = (slot[:, None] < W) & (rank[None, :] < K)
    index = tl.reshape(tl.where(valid, flat, W * K + slot[:, None] * BK + rank[None, :]), (BW * BK,))
    for d in range(L):
        # every alive parent slot of depth d - 1 (the root alone at d = 0) x every rank
        if d == 0:
            parent = tl.where(slot == 0, 0.0, float("-inf"))
        else:
            parent = tl.load(score_buf + (d - 1) * W + slot, mask=slot < W, other=float("-inf"))
        logp = tl.load(logp_ptr + d * K + rank, mask=rank < K, other=float("-inf"))
        cand = tl.where(valid, parent[:, None] + logp[None, :], float("-inf"))
        bonus = tl.where(flat == 0, BONUS, 0.0)
        keys = tl.sort(_key(tl.reshape(cand + bonus, (BW * BK,)), index), descending=True)
        tl.store(sort_buf + tl.arange(0, BW * BK), keys)
        tl.debug_barrier()
        # the depth's W best: always real candidates (W * K of them, and padding sorts below them)
        pick = tl.where(slot < W, _index(tl.load(sort_buf + slot, mask=slot < W, other=0)), 0)
        if d == 0:
            base = tl.where(pick // K == 0, 0.0, float("-inf"))
        else:
            base = tl.load(score_buf + (d - 1) * W + pick // K)
        score = base + tl.load(logp_ptr + d * K + pick % K)  # the candidate's score, without the bonus
        tl.store(score_buf + d * W + slot, score, mask=slot < W)
        tl.store(pick_buf + d * W + slot, pick, mask=slot < W)
        tl.debug_barrier()

    # The N best of all depths (stable: a tie goes to the shallower node, so parents come first).
    i = tl.arange(0, BLW)
    in_grid = i < L * W
    scores = tl.load(score_buf + i, mask=in_grid, other=float("-inf"))
    keys = _key(scores + tl.where(i % W == 0, BONUS, 0.0), tl.where(in_grid, i, L * W + i))
    keys = tl.sort(keys, descending=True)
    tl.store(sort_buf + i, keys)
    tl.debug_barrier()
    q = tl.arange(0, BT)
    chosen = _index(tl.load(sort_buf + q, mask=q < N, other=0))
    # ... in depth order, ties by score rank: (depth, rank, grid index) packed ascending
    depth = chosen // W
    packed = (depth.to(tl.int64) << 40) | (q.to(tl.int64) << 20) | chosen.to(tl.int64)
    order = tl.where(q < N, packed, 1 << 62)
    order = tl.sort(order)
    tl.store(sort_buf + q, order)
    tl.store(node_buf + i, -1, mask=in_grid)
    tl.debug_barrier()
    node = (tl.load(sort_buf + q, mask=q < N, other=0) & 0xFFFFF).to(tl.int32)  # grid index of node q + 1
    depth = node // W
    tl.store(node_buf + node, q + 1, mask=q < N)
    tl.debug_barrier()
    pick = tl.load(pick_buf + node, mask=q < N, other=0)
    above = tl.load(node_buf + tl.maximum(depth - 1, 0) * W + pick // K, mask=q < N, other=0)
    parent = tl.where(depth == 0, 0, above)
    token = tl.load(tok_ptr + depth * K + pick % K, mask=q < N, other=0)
    tl.store(tokens_ptr + 1 + q, token, mask=q < N)
    tl.store(parents_ptr + 1 + q, parent.to(tl.int64), mask=q < N)
    tl.store(depths_ptr + 1 + q, (depth + 1).to(tl.int64), mask=q < N)
    tl.store(tokens_ptr, tl.load(root_ptr))
    tl.store(parents_ptr, -1)
    tl.store(depths_ptr, 0)
    tl.debug_barrier()
    # visible[t, j]: j is t or an ancestor of t; walk the parent pointers L times
    t = tl.arange(0, BT)
    cur = tl.where(t < N + 1, t, -1)
    seen = cur[:, None] == t[None, :]
    for _ in range(L):
        cur = tl.load(parents_ptr + tl.maximum(cur, 0), mask=cur >= 0, other=-1).to(tl.int32)
        seen = seen | ((cur[:, None] == t[None, :]) & (cur[:, None] >= 0))
    at = t[:, None] * (N + 1) + t[None, :]
    tl.store(visible_ptr + at, seen.to(tl.int8), mask=(t[:, None] < N + 1) & (t[None, :] < N + 1))


def ddtree(
    root: torch.Tensor, logp: torch.Tensor, tok: torch.Tensor, budget: int, bonus: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens (n+1,), parents (n+1,), depths (n+1,), visible (n+1, n+1) bool) of the DDTree over the
    per-depth top-k log-probs `logp` (L, k) fp32 and their tokens `tok` (L, k), n = budget nodes below
    `root` (0-d long); `bonus` on slot 0 of every depth (the chain seed) or 0. The caller guarantees
    that budget paths exist (spec.tree.fills_budget)."""
    depth_l, k = logp.shape
    dev = logp.device
    n, width = budget, budget
    tokens = torch.empty(n + 1, dtype=torch.long, device=dev)
    parents = torch.empty(n + 1, dtype=torch.long, device=dev)
    depths = torch.empty(n + 1, dtype=torch.long, device=dev)
    visible = torch.empty(n + 1, n + 1, dtype=torch.int8, device=dev)
    bw, bk = triton.next_power_of_2(width), triton.next_power_of_2(k)
    blw, bt = triton.next_power_of_2(depth_l * width), triton.next_power_of_2(n + 1)
    scores = torch.empty(depth_l * width, dtype=torch.float32, device=dev)
    picks = torch.empty(depth_l * width, dtype=torch.int32, device=dev)
    sort_buf = torch.empty(max(bw * bk, blw, bt), dtype=torch.int64, device=dev)
    nodes = torch.empty(depth_l * width, dtype=torch.int32, device=dev)
    _ddtree_kernel[(1,)](
        logp.contiguous(), tok.contiguous(), root, tokens, parents, depths, visible,
        scores, picks, sort_buf, nodes, L=depth_l, K=k, W=width, N=n, BONUS=bonus,
        BW=bw, BK=bk, BLW=blw, BT=bt, num_warps=4, enable_fp_fusion=False, **pdl_options(tokens),
    )  # fmt: skip
    return tokens, parents, depths, visible.view(torch.bool)
