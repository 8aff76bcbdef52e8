"""What every layer of one forward pass shares: where the block starts, its layout, masks, RoPE."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashtree.models.block import BlockLayout
from flashtree.models.layers import Rotary


@dataclass
class ForwardPass:
    start: int  # committed tokens before this block (= first write slot)
    layout: BlockLayout
    commit: bool  # True: prefill/AR, state advances; False: verify, per-token state kept pending
    rotary: Rotary | None
    dtype: torch.dtype
    _cache: dict = field(default_factory=dict)

    @property
    def positions(self) -> torch.Tensor:
        return self.start + self.layout.depths

    @property
    def attn_mask(self) -> torch.Tensor | None:
        """(T, start + T) bool, or None when every key is visible (a single token)."""
        if "mask" not in self._cache:
            t = self.layout.size
            if t == 1:
                mask = None
            else:
                past = torch.ones(t, self.start, dtype=torch.bool, device=self.layout.parents.device)
                mask = torch.cat([past, self.layout.visible], dim=1)
            self._cache["mask"] = mask
        return self._cache["mask"]

    @property
    def parents_list(self) -> list[int]:
        """Parent indices on the host, read once per pass (not once per layer)."""
        if "parents" not in self._cache:
            self._cache["parents"] = self.layout.parents.tolist()
        return self._cache["parents"]

    def rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        if "rope" not in self._cache:
            self._cache["rope"] = self.rotary.cos_sin(self.positions, self.dtype)
        return self._cache["rope"]

    def conv_index(self, kernel: int) -> torch.Tensor:
        key = ("conv", kernel)
        if key not in self._cache:
            self._cache[key] = self.layout.conv_window_index(kernel)
        return self._cache[key]
