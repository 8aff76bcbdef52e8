"""spec/tree.py's DDTree build in one Triton program, where the torch path launches a top-k, adds and
gathers per depth, two sorts and the ancestor matrix by repeated squaring: launches bound a small model's
tree step (bench/results/h200-step-2026-12-03). Its input, the draft's per-depth top-k log-probs, comes
from `draft_topk` in two launches.

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

from flashtree.kernels import tl, triton
from flashtree.kernels.launch import pdl_options, wait_for_inputs

LOW = 0x7FFFFFFF  # index complement base: keys' low 32 bits
TOPK_CHUNK = 2048  # vocab entries per program of the draft top-k's first stage


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
def _best_per_depth(
    logp_ptr, score_buf, pick_buf, sort_buf,
    L: tl.constexpr, K: tl.constexpr, W: tl.constexpr, BONUS: tl.constexpr,
    BW: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """Per depth the W best (parent slot x rank) candidates: score_buf their scores (without the bonus),
    pick_buf their candidate indices (slot * K + rank), both (L, W)."""
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


@triton.jit
def _best_nodes(
    score_buf, sort_buf, node_buf,
    L: tl.constexpr, W: tl.constexpr, N: tl.constexpr, BONUS: tl.constexpr,
    BLW: tl.constexpr, BT: tl.constexpr,
):  # fmt: skip
    """The grid indices (depth * W + slot) of the N best candidates of all depths, node q + 1 at q, in
    depth order; node_buf (L * W) cleared to -1."""
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
    return (tl.load(sort_buf + q, mask=q < N, other=0) & 0xFFFFF).to(tl.int32)


@triton.jit
def _ancestors(parents_ptr, visible_ptr, L: tl.constexpr, N: tl.constexpr, BT: tl.constexpr):
    """visible[t, j]: j is t or an ancestor of t; walk the parent pointers L times."""
    t = tl.arange(0, BT)
    cur = tl.where(t < N + 1, t, -1)
    seen = cur[:, None] == t[None, :]
    for _ in range(L):
        cur = tl.load(parents_ptr + tl.maximum(cur, 0), mask=cur >= 0, other=-1).to(tl.int32)
        seen = seen | ((cur[:, None] == t[None, :]) & (cur[:, None] >= 0))
    at = t[:, None] * (N + 1) + t[None, :]
    tl.store(visible_ptr + at, seen.to(tl.int8), mask=(t[:, None] < N + 1) & (t[None, :] < N + 1))


@triton.jit
def _ddtree_kernel(
    logp_ptr, tok_ptr, root_ptr, tokens_ptr, parents_ptr, depths_ptr, visible_ptr,
    score_buf, pick_buf, sort_buf, node_buf,
    L: tl.constexpr, K: tl.constexpr, W: tl.constexpr, N: tl.constexpr, BONUS: tl.constexpr,
    BW: tl.constexpr, BK: tl.constexpr, BLW: tl.constexpr, BT: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(GDC)
    _best_per_depth(logp_ptr, score_buf, pick_buf, sort_buf, L, K, W, BONUS, BW, BK)
    node = _best_nodes(score_buf, sort_buf, node_buf, L, W, N, BONUS, BLW, BT)  # grid index of node q + 1
    q = tl.arange(0, BT)
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
    _ancestors(parents_ptr, visible_ptr, L, N, BT)


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


@triton.jit
def _chunk_topk_kernel(
    x_ptr, vals_ptr, idx_ptr, max_ptr, sum_ptr, V, n_chunks, temperature,
    K: tl.constexpr, BK: tl.constexpr, CHUNK: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """Program (row, chunk) of x = logits / temperature: the chunk's max, its sum of exp(x - max), and its
    K largest x with their vocab indices (largest first; equal values: the lower index first)."""
    wait_for_inputs(GDC)
    row, c = tl.program_id(0), tl.program_id(1)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * V + cols, mask=cols < V, other=float("-inf"))
    x = tl.math.div_rn(x, temperature)
    top = tl.max(x, axis=0)
    at = row * n_chunks + c
    tl.store(max_ptr + at, top)
    tl.store(sum_ptr + at, tl.sum(tl.exp(x - top), axis=0))
    rank = tl.arange(0, BK)
    vals = tl.full((BK,), float("-inf"), tl.float32)
    idxs = tl.zeros((BK,), tl.int32)
    for r in tl.static_range(K):
        best = tl.max(x, axis=0)
        first = tl.min(tl.where(x == best, cols, 0x7FFFFFFF), axis=0)
        vals = tl.where(rank == r, best, vals)
        idxs = tl.where(rank == r, first, idxs)
        x = tl.where(cols == first, float("-inf"), x)
    tl.store(vals_ptr + at * K + rank, vals, mask=rank < K)
    tl.store(idx_ptr + at * K + rank, idxs, mask=rank < K)


@triton.jit
def _merge_topk_kernel(
    vals_ptr, idx_ptr, max_ptr, sum_ptr, logp_ptr, tok_ptr, n_chunks,
    K: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """Program row: the row's K best of its chunks' candidates as log-probs, x - max - log(sum exp(x -
    max)) over the whole row (the chunks' sums rescaled to the row's max), and their tokens."""
    wait_for_inputs(GDC)
    row = tl.program_id(0)
    ch = tl.arange(0, BC)
    m = tl.load(max_ptr + row * n_chunks + ch, mask=ch < n_chunks, other=float("-inf"))
    sums = tl.load(sum_ptr + row * n_chunks + ch, mask=ch < n_chunks, other=0.0)
    top = tl.max(m, axis=0)
    log_total = tl.log(tl.sum(sums * tl.exp(m - top), axis=0))
    cand = tl.arange(0, BC * BK)
    real = cand < n_chunks * K
    vals = tl.load(vals_ptr + row * n_chunks * K + cand, mask=real, other=float("-inf"))
    tokens = tl.load(idx_ptr + row * n_chunks * K + cand, mask=real, other=0)
    tokens = tl.where(real, tokens, 0x7FFFFFFF - cand)  # padding: distinct, never the lowest
    for r in tl.static_range(K):
        best = tl.max(vals, axis=0)
        first = tl.min(tl.where(vals == best, tokens, 0x7FFFFFFF), axis=0)
        tl.store(logp_ptr + row * K + r, (best - top) - log_total)
        tl.store(tok_ptr + row * K + r, first.to(tl.int64))
        vals = tl.where(tokens == first, float("-inf"), vals)


def draft_topk(logits: torch.Tensor, k: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.log_softmax(logits / temperature, -1).topk(k) for (L, V) fp32 logits in two launches (torch
    takes ~15: the division, the softmax and a multi-block radix top-k): (logp (L, k) fp32, largest
    first, tokens (L, k) long; equal log-probs: the lower token first). The log-probs equal torch's up
    to the order of the sum (a few ulp)."""
    rows, vocab = logits.shape
    n_chunks = triton.cdiv(vocab, TOPK_CHUNK)
    dev = logits.device
    vals = torch.empty(rows, n_chunks, k, dtype=torch.float32, device=dev)
    idxs = torch.empty(rows, n_chunks, k, dtype=torch.int32, device=dev)
    maxes = torch.empty(rows, n_chunks, dtype=torch.float32, device=dev)
    sums = torch.empty_like(maxes)
    bk = triton.next_power_of_2(k)
    x = logits.contiguous()
    _chunk_topk_kernel[(rows, n_chunks)](
        x, vals, idxs, maxes, sums, vocab, n_chunks, float(temperature), K=k, BK=bk, CHUNK=TOPK_CHUNK,
        num_warps=4, **pdl_options(x),
    )  # fmt: skip
    logp = torch.empty(rows, k, dtype=torch.float32, device=dev)
    tok = torch.empty(rows, k, dtype=torch.long, device=dev)
    _merge_topk_kernel[(rows,)](
        vals, idxs, maxes, sums, logp, tok, n_chunks, K=k, BK=bk, BC=triton.next_power_of_2(n_chunks),
        num_warps=4, **pdl_options(x),
    )  # fmt: skip
    return logp, tok
