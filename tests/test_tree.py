"""DDTree construction, tree layouts and the accept walk against plain-Python references.

The references enumerate every rank path (build_tree), walk parent pointers (from_parents) and
follow the target's samples node by node (accept_path); the fast versions must agree exactly.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from flashtree.models.block import BlockLayout
from flashtree.spec.accept import Accepted, accept_path
from flashtree.spec.tree import build_tree, chain_tree


def reference_tree(logits: torch.Tensor, budget: int, top_k: int, chain_seed: bool) -> set[tuple[int, ...]]:
    """The `budget` best token paths over every rank path (scores: summed log-probs), the greedy chain
    first when `chain_seed`."""
    logp, tok = torch.log_softmax(logits.double(), -1).topk(top_k, -1)
    depth_l = logits.shape[0]
    paths = []
    for depth in range(1, depth_l + 1):
        for ranks in itertools.product(range(top_k), repeat=depth):
            score = sum(logp[d, r].item() for d, r in enumerate(ranks))
            is_chain = chain_seed and not any(ranks)
            paths.append((not is_chain, -score, tuple(tok[d, r].item() for d, r in enumerate(ranks))))
    return {p[2] for p in sorted(paths)[:budget]}


def tree_paths(tokens: torch.Tensor, parents: torch.Tensor) -> set[tuple[int, ...]]:
    """Root-excluded token path of every draft node."""
    out = set()
    for i in range(1, len(tokens)):
        path, j = [], i
        while j > 0:
            path.append(int(tokens[j]))
            j = int(parents[j])
        out.add(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("chain_seed", [True, False])
@pytest.mark.parametrize("budget,top_k,depth", [(22, 3, 4), (8, 2, 5), (40, 4, 3), (5, 3, 6)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_build_tree_takes_the_best_paths(chain_seed, budget, top_k, depth, seed):
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(depth, 50, generator=g)
    tree = build_tree(torch.tensor(7), logits, budget, top_k, chain_seed)
    n = min(budget, sum(top_k**d for d in range(1, depth + 1)))
    assert tree.tokens.shape == (n + 1,) and int(tree.tokens[0]) == 7
    parents = tree.layout.parents
    assert int(parents[0]) == -1 and bool((parents[1:] < torch.arange(1, n + 1)).all())  # parents first
    assert tree_paths(tree.tokens, parents) == reference_tree(logits, budget, top_k, chain_seed)


def reference_layout(parents: list[int]) -> tuple[list[int], list[list[bool]]]:
    n = len(parents)
    depths, visible = [], [[False] * n for _ in range(n)]
    for i in range(n):
        j, d = i, 0
        while j >= 0:
            visible[i][j] = True
            j = parents[j]
            d += 1
        depths.append(d - 1)
    return depths, visible


@pytest.mark.parametrize("seed", range(6))
def test_from_parents_matches_walking_the_pointers(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 40, (1,), generator=g))
    # random tree: each node's parent is an earlier node, or -1 (several roots, as in prefill blocks)
    parents = [-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, n)]
    layout = BlockLayout.from_parents(torch.tensor(parents))
    depths, visible = reference_layout(parents)
    assert layout.depths.tolist() == depths
    assert layout.visible.tolist() == visible


@pytest.mark.parametrize("seed", range(10))
def test_accept_path_follows_the_samples(seed):
    g = torch.Generator().manual_seed(seed)
    tree = build_tree(torch.tensor(3), torch.randn(6, 5, generator=g), 20, 3)
    tokens, parents = tree.tokens, tree.layout.parents.tolist()
    # samples that often agree with the tree, so paths of many lengths occur
    samples = tokens[torch.randint(0, len(tokens), (len(tokens),), generator=g)]
    accepted = accept_path(tokens, tree.layout, samples)
    path = accepted.path[: int(accepted.n)]
    emitted = Accepted.emitted(accepted.packed(tokens).tolist())
    node, ref_path = 0, [0]
    while True:  # walk: the child whose token equals the current node's sample
        children = [c for c in range(len(tokens)) if parents[c] == node and tokens[c] == samples[node]]
        child = children[0] if children else None
        if child is None:
            break
        node = child
        ref_path.append(node)
    assert path.tolist() == ref_path
    assert emitted == [int(tokens[i]) for i in ref_path[1:]] + [int(samples[node])]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("shape", ["tree", "chain"])
def test_accept_kernel_is_the_torch_walk(kernels_path, shape, seed):
    """kernels/accept.py under TRITON_INTERPRET=1: the same path, n, bonus and read-back as the torch
    ops, on trees and chains with samples that agree with the block often (long paths) or never."""

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(7, 6, generator=g)
    root = torch.tensor(3)
    tree = build_tree(root, logits, 22, 3) if shape == "tree" else chain_tree(root, logits)
    tokens, parents = tree.tokens, tree.layout.parents.tolist()
    samples = torch.full_like(tokens, 99)  # every 4th seed: no node matches
    for t in range(len(tokens) * (seed % 4 > 0)):  # else each node's sample is one of its children's tokens
        kids = [c for c in range(len(tokens)) if parents[c] == t]
        if kids:
            samples[t] = tokens[kids[int(torch.randint(len(kids), (), generator=g))]]
    want = accept_path(tokens, tree.layout, samples)
    assert int(want.n) > 2 if seed % 4 else int(want.n) == 1  # a walk to a leaf, or the root alone
    kernels_path("triton")
    got = accept_path(tokens, tree.layout, samples)
    assert (
        torch.equal(got.path, want.path) and int(got.n) == int(want.n) and int(got.bonus) == int(want.bonus)
    )
    assert torch.equal(got.packed(tokens), want.packed(tokens))
