"""DDTree: the `budget` most likely draft continuations as a prefix tree, from one DFlash pass.

The draft gives independent per-depth distributions, so a path's score is the sum of its tokens'
log-probs. Because a child never scores above its parent, the `budget` best rank-paths form a tree
(prefix-closed), and the best nodes at depth d only extend the best nodes at depth d - 1. We build
it level by level with fixed-size torch ops (no heap, no host sync, same shapes every step):
keep the `budget` best candidates per depth, then take the `budget` best over all depths.
With `chain_seed` the draft's greedy chain is inserted first (as the peer does), so the tree never
accepts less than chain decoding would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashtree.models.block import BlockLayout

NEG_INF = float("-inf")
CHAIN_BONUS = 1e9  # lifts the greedy chain above every other candidate


@dataclass(frozen=True)
class DraftTree:
    """A verify block: index 0 is the root (the last emitted token), then the draft nodes."""

    tokens: torch.Tensor  # (N + 1,) long
    layout: BlockLayout


def chain_tree(root: int, draft_logits: torch.Tensor) -> DraftTree:
    """Chain decoding: the draft's argmax at every depth."""
    tokens = torch.cat([draft_logits.new_tensor([root], dtype=torch.long), draft_logits.argmax(-1)])
    return DraftTree(tokens, BlockLayout.chain(tokens.shape[0], tokens.device))


def build_tree(
    root: int,
    draft_logits: torch.Tensor,  # (L, V): depth d + 1 distribution in row d
    budget: int,
    top_k: int,
    chain_seed: bool = True,
    temperature: float = 1.0,
) -> DraftTree:
    depth_l, vocab = draft_logits.shape
    k = min(top_k, vocab)
    logp, tok = torch.log_softmax(draft_logits.float() / temperature, dim=-1).topk(k, dim=-1)  # (L, k)
    dev = draft_logits.device
    width = budget  # candidates kept per depth

    # Level d holds `width` candidates: score, token, rank, parent slot in level d - 1 (-1 = root).
    scores, tokens, parents, greedy = [], [], [], []
    prev_score = torch.full((width,), NEG_INF, device=dev)
    prev_score[0] = 0.0  # the root
    prev_greedy = torch.zeros(width, dtype=torch.bool, device=dev)
    prev_greedy[0] = True
    for d in range(depth_l):
        cand = prev_score[:, None] + logp[d][None, :]  # (width, k): every parent x every rank
        cand_greedy = prev_greedy[:, None] & (torch.arange(k, device=dev) == 0)[None, :]
        key = cand + cand_greedy * (CHAIN_BONUS if chain_seed else 0.0)
        best = key.flatten().topk(min(width, key.numel())).indices
        if best.shape[0] < width:  # tiny vocab: pad with dead slots
            best = torch.cat([best, best.new_zeros(width - best.shape[0])])
            dead = torch.arange(width, device=dev) >= key.numel()
        else:
            dead = torch.zeros(width, dtype=torch.bool, device=dev)
        par, rank = best // k, best % k
        score = cand.flatten()[best].masked_fill(dead, NEG_INF)
        scores.append(score)
        tokens.append(tok[d][rank])
        parents.append(par if d > 0 else torch.full_like(par, -1))
        greedy.append(cand_greedy.flatten()[best] & ~dead)
        prev_score, prev_greedy = score, greedy[-1]

    score = torch.stack(scores)  # (L, width)
    is_greedy = torch.stack(greedy)
    key = score + is_greedy * (CHAIN_BONUS if chain_seed else 0.0)
    # Only a tiny vocabulary can have fewer than `budget` distinct paths; count them then (a sync).
    n = budget if k**depth_l >= budget else min(budget, int(torch.isfinite(score).sum()))
    # The best `budget` over all depths. Entries are laid out depth-major and the sort is stable, so a
    # tie goes to the shallower node: a parent always outranks its children, keeping the set a tree.
    chosen = torch.sort(key.flatten(), descending=True, stable=True).indices[:n]
    chosen = chosen[torch.sort(chosen // width, stable=True).indices]  # parents before children
    depth, slot = chosen // width, chosen % width

    node_of = torch.full((depth_l, width), -1, dtype=torch.long, device=dev)  # (depth, slot) -> block index
    node_of[depth, slot] = torch.arange(1, n + 1, device=dev)
    parent_slot = torch.stack(parents)[depth, slot]
    parent_node = torch.where(
        depth == 0, torch.zeros_like(slot), node_of[(depth - 1).clamp(min=0), parent_slot]
    )
    node_tokens = torch.stack(tokens)[depth, slot]

    block_tokens = torch.cat([torch.tensor([root], device=dev), node_tokens])
    block_parents = torch.cat([torch.tensor([-1], device=dev), parent_node])
    return DraftTree(block_tokens, BlockLayout.from_parents(block_parents, max_depth=depth_l))
