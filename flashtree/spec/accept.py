"""Lossless acceptance: walk the verified tree along the target's own samples.

Every block token's target sample is drawn once (sampling.sample). A node is accepted iff its
parent is accepted and its token equals the parent's sample. Siblings carry distinct tokens, so
the accepted nodes form one path from the root; the deepest one's sample is the bonus token.
Every emitted token is thus the target's sample given the accepted prefix, for any draft.
"""

from __future__ import annotations

import torch

from flashtree.models.block import BlockLayout


def accept_path(tokens: torch.Tensor, layout: BlockLayout, samples: torch.Tensor) -> tuple[torch.Tensor, int]:
    """tokens, samples: (N + 1,) with the root at 0. Returns (path indices root-first, bonus token)."""
    parents = layout.parents
    match = tokens == samples[parents.clamp(min=0)]
    match[0] = True  # the root is already committed
    accepted = match.clone()
    for _ in range(int(layout.depths.max())):  # propagate rejection down the tree, one level per pass
        accepted = match & accepted[parents.clamp(min=0)]
        accepted[0] = True
    deepest = int(torch.where(accepted, layout.depths, -1).argmax())
    path = torch.nonzero(layout.visible[deepest]).flatten()
    return path, int(samples[deepest])
