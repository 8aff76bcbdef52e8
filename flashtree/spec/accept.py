"""Lossless acceptance: walk the verified tree along the target's own samples.

Every block token's target sample is drawn once (sampling.sample). A node is accepted iff its
parent is accepted and its token equals the parent's sample. Siblings carry distinct tokens, so
the accepted nodes form one path from the root; the deepest one's sample is the bonus token.
Every emitted token is thus the target's sample given the accepted prefix, for any draft.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashtree import kernels
from flashtree.models.block import BlockLayout


@dataclass(frozen=True)
class Accepted:
    """The accepted path, on the device, in fixed shapes (a CUDA graph can produce it)."""

    path: torch.Tensor  # (N + 1,) block indices: the n accepted ones root-first, then the others
    n: torch.Tensor  # 0-d long: accepted nodes, the root included
    bonus: torch.Tensor  # 0-d long: the target's sample after the deepest accepted node
    read_back: torch.Tensor | None = None  # packed(tokens), where the accept kernel wrote it already

    def packed(self, tokens: torch.Tensor) -> torch.Tensor:
        """(N + 3,) [n, bonus, tokens along path...]: everything the host needs, in one read."""
        if self.read_back is not None:
            return self.read_back
        return torch.cat([self.n.view(1), self.bonus.view(1), tokens[self.path]])

    @staticmethod
    def emitted(packed: list[int]) -> list[int]:
        """The step's output from a read-back `packed`: the accepted draft tokens, then the bonus."""
        n = packed[0]
        return packed[3 : 2 + n] + [packed[1]]


def accept_path(tokens: torch.Tensor, layout: BlockLayout, samples: torch.Tensor) -> Accepted:
    """tokens, samples: (N + 1,) with the root at 0. No host transfer. On the GPU one launch
    (kernels/accept.py) computes the same."""
    if kernels.triton_kernels_for(tokens):
        from flashtree.kernels.accept import accept

        path, packed = accept(tokens, samples, layout.parents, layout.depths, layout.visible)
        return Accepted(path, packed[0], packed[1], packed)
    # A node is accepted iff it and each of its ancestors match (the root always does).
    match = (tokens == samples[layout.parents.clamp(min=0)]) | (layout.parents < 0)
    accepted = ~(layout.visible & ~match[None, :]).any(1)  # (N + 1,)
    deepest = torch.where(accepted, layout.depths, -1).argmax().view(1)
    # index_select/gather, not [deepest]: indexing with a 0-d tensor would read it back to the host
    on_path = layout.visible.index_select(0, deepest)[0]  # (N + 1,): the deepest node and its ancestors
    # A stable sort of "off the path" puts the path's indices first, in increasing (root-first) order.
    path = torch.sort((~on_path).to(torch.uint8), stable=True).indices
    return Accepted(path, on_path.sum(), samples.gather(0, deepest)[0])
