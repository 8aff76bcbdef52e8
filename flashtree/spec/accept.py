"""Lossless acceptance: walk the verified tree along the target's own samples.

Every block token's target sample is drawn once (sampling.sample). A node is accepted iff its
parent is accepted and its token equals the parent's sample. Siblings carry distinct tokens, so
the accepted nodes form one path from the root; the deepest one's sample is the bonus token.
Every emitted token is thus the target's sample given the accepted prefix, for any draft.
"""

from __future__ import annotations

import torch

from flashtree.models.block import BlockLayout


def accept_path(
    tokens: torch.Tensor, layout: BlockLayout, samples: torch.Tensor
) -> tuple[torch.Tensor, list[int]]:
    """tokens, samples: (N + 1,) with the root at 0. Returns (path: block indices root-first, on the
    device; emitted: the accepted draft tokens then the bonus). One host transfer per call."""
    # A node is accepted iff it and each of its ancestors match (the root always does).
    match = (tokens == samples[layout.parents.clamp(min=0)]) | (layout.parents < 0)
    accepted = ~(layout.visible & ~match[None, :]).any(1)  # (N + 1,)
    deepest = torch.where(accepted, layout.depths, -1).argmax()
    on_path = layout.visible[deepest]  # (N + 1,) bool: the deepest accepted node and its ancestors
    host = torch.cat([on_path.long(), tokens, samples[deepest, None]]).tolist()
    n = tokens.shape[0]
    path = [i for i in range(n) if host[i]]
    # The path's indices in increasing order, without copying the host list back to the device.
    on_device = torch.sort((~on_path).to(torch.uint8), stable=True).indices[: len(path)]
    return on_device, [host[n + i] for i in path[1:]] + [host[-1]]
