"""The shape of one forward pass: which earlier token of the same pass each token follows.

A causal chain (prefill, AR decode, chain verify) and a DDTree (tree verify) are both described
by `parents`: parents[i] is the index of token i's predecessor inside the block, or -1 when it
follows the last committed token. Attention masks, RoPE positions and the DeltaNet/conv recurrences
are all derived from it, so one forward serves every mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockLayout:
    parents: torch.Tensor  # (T,) long, parents[i] < i, -1 = the committed prefix
    depths: torch.Tensor  # (T,) long, 0 for tokens whose parent is -1
    visible: torch.Tensor  # (T, T) bool, token i sees token j iff j is i or an ancestor of i

    @property
    def size(self) -> int:
        return self.parents.shape[0]

    @staticmethod
    def chain(n: int, device: torch.device | str = "cpu") -> BlockLayout:
        idx = torch.arange(n, device=device)
        visible = idx[:, None] >= idx[None, :]
        return BlockLayout(parents=idx - 1, depths=idx, visible=visible)

    @staticmethod
    def from_parents(parents: torch.Tensor, max_depth: int | None = None) -> BlockLayout:
        """Tree layout from parent pointers (parents precede children; no node deeper than
        `max_depth`, default T - 1). Fixed-size torch ops only: no host sync."""
        n = parents.shape[0]
        max_depth = n - 1 if max_depth is None else max_depth
        idx = torch.arange(n, device=parents.device)
        # reach[i, j] = 1 iff j is i or one of its ancestors: the reflexive closure of the parent
        # relation, by squaring: after s squarings it spans paths of up to 2^s edges. The 0/1 counts
        # stay exact in fp32, so log2(max_depth) small matmuls replace a loop over depths.
        reach = torch.eye(n, device=parents.device)
        reach[idx, parents.clamp(min=0)] += (parents >= 0).float()
        for _ in range(max_depth.bit_length()):
            reach = (reach @ reach).clamp(max=1.0)
        visible = reach > 0
        depths = visible.sum(1) - 1
        return BlockLayout(parents=parents, depths=depths, visible=visible)

    def paths(self) -> torch.Tensor:
        """(T, T): row t lists t's ancestors and t itself in increasing order, root first (its first
        depths[t] + 1 entries; the rest are other tokens). A parent precedes its children, so this is
        depth order: entry j is the ancestor at depth j."""
        return torch.sort((~self.visible).to(torch.uint8), dim=1, stable=True).indices

    def restart_points(self) -> torch.Tensor:
        """(T,) bool: the tokens a later token of the block restarts from, i.e. whose child is not the
        token right after them (a sibling branch). A walk in block order needs only their states kept.
        Fixed-size torch ops only: no host sync."""
        idx = torch.arange(self.size, device=self.parents.device)
        restarts = (self.parents >= 0) & (self.parents != idx - 1)  # (T,) tokens that restart
        return ((self.parents[None, :] == idx[:, None]) & restarts[None, :]).any(dim=1)

    def conv_window_index(self, kernel: int) -> torch.Tensor:
        """(T, kernel) indices into [conv_state (kernel-1 rows) | block tokens (T rows)]: the causal
        conv window of each token along its own ancestry, oldest first."""
        k1 = kernel - 1
        cur = torch.arange(self.size, device=self.parents.device) + k1
        cols = [cur]
        for _ in range(k1):
            in_block = cur >= k1
            parent = self.parents[(cur - k1).clamp(min=0)]
            from_block = torch.where(parent >= 0, parent + k1, torch.full_like(parent, k1 - 1))
            cur = torch.where(in_block, from_block, cur - 1)
            cols.append(cur)
        return torch.stack(cols[::-1], dim=1)
