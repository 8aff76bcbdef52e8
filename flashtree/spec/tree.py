"""DDTree: the `budget` most likely draft continuations as a prefix tree, from one DFlash pass.

The draft gives independent per-depth distributions, so a path's score is the sum of its tokens'
log-probs. Because a child never scores above its parent, the `budget` best rank-paths form a tree
(prefix-closed), and the best nodes at depth d only extend the best nodes at depth d - 1. We build
it level by level with fixed-size torch ops (no heap, no host sync, same shapes every step):
keep the `budget` best candidates per depth, then take the `budget` best over all depths.
With `chain_seed` the draft's greedy chain is inserted first (as the peer does), so a step never accepts
less than chain decoding would. Off by default: the chain's deep nodes crowd out likelier paths, and the
mean accept length falls (bench/results/cpu-replay-2026-12-05).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashtree import kernels
from flashtree.config import SpecConfig
from flashtree.models.block import BlockLayout

NEG_INF = float("-inf")
CHAIN_BONUS = 1e9  # lifts the greedy chain above every other candidate
# The Triton build holds the (budget + 1)^2 visibility mask in one program, a power-of-two tile: past 511
# (a 1024 x 1024 tile) it did not compile within minutes on an H100. Larger budgets build in torch.
KERNEL_MAX_BUDGET = 511


@dataclass(frozen=True)
class DraftTree:
    """A verify block: index 0 is the root (the last emitted token), then the draft nodes."""

    tokens: torch.Tensor  # (N + 1,) long
    layout: BlockLayout


def chain_tree(root: torch.Tensor, draft_logits: torch.Tensor) -> DraftTree:
    """Chain decoding: the draft's argmax at every depth. root: 0-d long on the device."""
    tokens = torch.cat([root.view(1), draft_logits.argmax(-1)])
    return DraftTree(tokens, BlockLayout.chain(tokens.shape[0], tokens.device))


def draft_tree(spec: SpecConfig, root: torch.Tensor, draft_logits: torch.Tensor) -> DraftTree:
    """The verify block of a chain or tree step (spec.mode) from the draft's logits (L, V)."""
    if spec.mode == "chain":
        return chain_tree(root, draft_logits)
    return build_tree(
        root, draft_logits, spec.budget, spec.tree_top_k, spec.chain_seed, spec.draft_temperature
    )


def fills_budget(top_k: int, depth: int, budget: int) -> bool:
    """Whether `depth` levels of `top_k` ranks always hold `budget` paths (else build_tree reads the
    count back to the host, which a CUDA graph cannot)."""
    return top_k**depth >= budget


def build_tree(
    root: torch.Tensor,  # 0-d long on the device
    draft_logits: torch.Tensor,  # (L, V): depth d + 1 distribution in row d
    budget: int,
    top_k: int,
    chain_seed: bool = False,
    temperature: float = 1.0,
) -> DraftTree:
    depth_l, vocab = draft_logits.shape
    k = min(top_k, vocab)
    kernel = budget <= KERNEL_MAX_BUDGET and kernels.triton_kernels_for(draft_logits)
    if kernel and fills_budget(k, depth_l, budget):
        from flashtree.kernels.ddtree import ddtree, draft_topk  # the same tree in three launches

        logp, tok = draft_topk(draft_logits.float(), k, temperature)
        tokens, parents, depths, visible = ddtree(root, logp, tok, budget, CHAIN_BONUS if chain_seed else 0.0)
        return DraftTree(tokens, BlockLayout(parents=parents, depths=depths, visible=visible))
    logp, tok = torch.log_softmax(draft_logits.float() / temperature, dim=-1).topk(k, dim=-1)  # (L, k)
    dev = draft_logits.device
    width = budget  # candidates kept per depth
    # With chain_seed the greedy chain is slot 0 of every level: the bonus on (slot 0, rank 0) makes
    # it win each level's selection, and the same bonus on slot 0 wins the final one.
    # (built by comparison: an item assignment copies a host scalar, which a CUDA graph cannot hold)
    first = torch.arange(width * k, device=dev) == 0
    bonus = first * (CHAIN_BONUS if chain_seed else 0.0)  # (width * k,)

    # Level d keeps `width` candidates (slot order = selection order): their scores and their flat
    # index (parent slot * k + rank) into the level's (width, k) candidate grid. Dead slots score -inf.
    score = torch.where(first[:width], 0.0, NEG_INF)  # only the root is alive
    level_scores, level_picks = [], []
    for d in range(depth_l):
        cand = (score[:, None] + logp[d][None, :]).flatten()  # (width * k,): every parent x every rank
        pick = (cand + bonus).topk(width).indices
        score = cand[pick]
        level_scores.append(score)
        level_picks.append(pick)
    scores, picks = torch.stack(level_scores), torch.stack(level_picks)  # (L, width)
    parent_slot = picks // k
    tokens = tok.gather(1, picks % k)  # (L, width)

    key = scores.clone()
    key[:, 0] += bonus[0]  # the chain's nodes first
    # Only a tiny vocabulary can have fewer than `budget` distinct paths; count them then (a sync).
    n = budget if fills_budget(k, depth_l, budget) else min(budget, int(torch.isfinite(scores).sum()))
    # The best `budget` over all depths. Entries are laid out depth-major and the sort is stable, so a
    # tie goes to the shallower node: a parent always outranks its children, keeping the set a tree.
    chosen = torch.sort(key.flatten(), descending=True, stable=True).indices[:n]
    chosen = chosen[torch.sort(chosen // width, stable=True).indices]  # parents before children
    depth, slot = chosen // width, chosen % width

    node_of = torch.full((depth_l, width), -1, dtype=torch.long, device=dev)  # (depth, slot) -> block index
    node_of[depth, slot] = torch.arange(1, n + 1, device=dev)
    parent_node = torch.where(
        depth == 0, torch.zeros_like(slot), node_of[(depth - 1).clamp(min=0), parent_slot[depth, slot]]
    )
    block_tokens = torch.cat([root.view(1), tokens[depth, slot]])
    block_parents = torch.cat([torch.full((1,), -1, dtype=torch.long, device=dev), parent_node])
    return DraftTree(block_tokens, BlockLayout.from_parents(block_parents, max_depth=depth_l))
