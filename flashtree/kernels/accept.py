"""spec/accept.py's accept walk in one Triton program, where the torch path takes ~15 launches (the
match, the any-reduction over ancestors, an argmax, a stable sort for the path, a sum, gathers and the
read-back's concatenation): launches bound a small model's tree step.

The same function: node t is accepted iff every node on its path (visible[t]) matches its parent's
sample; the deepest accepted node (one per depth: siblings carry distinct tokens) gives the path
(its ancestors and itself, root first, then every other node in increasing order, as the stable sort
puts them) and the bonus token, its sample. Integers only: the result is exact.
"""

from __future__ import annotations

import torch

from flashtree.kernels import tl, triton
from flashtree.kernels.launch import pdl_options, wait_for_inputs


@triton.jit
def _accept_kernel(
    tokens_ptr, samples_ptr, parents_ptr, depths_ptr, visible_ptr, path_ptr, packed_ptr, T,
    BT: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(GDC)
    i = tl.arange(0, BT)
    ok = i < T
    tokens = tl.load(tokens_ptr + i, mask=ok, other=0)
    parents = tl.load(parents_ptr + i, mask=ok, other=-1)
    parent_sample = tl.load(samples_ptr + tl.maximum(parents, 0), mask=ok, other=0)
    match = (tokens == parent_sample) | (parents < 0)
    both = ok[:, None] & ok[None, :]
    visible = tl.load(visible_ptr + i[:, None] * T + i[None, :], mask=both, other=0) != 0  # [t, ancestor]
    broken = tl.sum((visible & (match == 0)[None, :]).to(tl.int32), axis=1)
    depth = tl.where(ok & (broken == 0), tl.load(depths_ptr + i, mask=ok, other=0), -1)
    deepest = tl.argmax(depth, axis=0)  # the first of the deepest: there is one per depth
    on_path = (tl.load(visible_ptr + deepest * T + i, mask=ok, other=0) != 0) & ok
    n = tl.sum(on_path.to(tl.int64), axis=0)
    # root-first path, then the other nodes, each group in increasing order (a stable sort's order)
    before_on = tl.cumsum(on_path.to(tl.int64), axis=0) - 1
    before_off = tl.cumsum((ok & ~on_path).to(tl.int64), axis=0) - 1
    at = tl.where(on_path, before_on, n + before_off)
    tl.store(path_ptr + at, i.to(tl.int64), mask=ok)
    tl.store(packed_ptr + 2 + at, tokens, mask=ok)
    tl.store(packed_ptr, n)
    tl.store(packed_ptr + 1, tl.load(samples_ptr + deepest))


def accept(
    tokens: torch.Tensor, samples: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
    visible: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(path (T,) long, packed (T + 2,) long = [n, bonus, tokens along path...]) of a verified block of
    T = N + 1 nodes: tokens, samples, parents, depths (T,) long; visible (T, T) bool."""
    t = tokens.shape[0]
    path = torch.empty(t, dtype=torch.long, device=tokens.device)
    packed = torch.empty(t + 2, dtype=torch.long, device=tokens.device)
    _accept_kernel[(1,)](
        tokens, samples, parents, depths, visible.contiguous().view(torch.uint8), path, packed, t,
        BT=triton.next_power_of_2(t), num_warps=4, **pdl_options(tokens),
    )  # fmt: skip
    return path, packed
