"""What every layer of one forward pass shares: where the block starts, its layout, masks, RoPE."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashtree.models.block import BlockLayout
from flashtree.models.layers import Rotary


@dataclass
class ForwardPass:
    start: torch.Tensor  # 0-d long on the device: committed tokens before this block (= first KV slot)
    n_keys: int  # KV slots attention reads: start + T exactly, or a larger fixed bucket (CUDA graphs)
    exact: bool  # n_keys == start + T
    layout: BlockLayout
    commit: bool  # True: prefill/AR, state advances; False: verify, per-token state kept pending
    rotary: Rotary | None
    dtype: torch.dtype
    window: int = 0  # > 0: attention reads the last `window` positions of each row only (--attn-window)
    _cache: dict = field(default_factory=dict)

    @property
    def positions(self) -> torch.Tensor:
        return self.start + self.layout.depths

    @property
    def slots(self) -> torch.Tensor:
        """(T,) KV slots this block writes."""
        if "slots" not in self._cache:
            self._cache["slots"] = self.start + torch.arange(
                self.layout.size, device=self.layout.parents.device
            )
        return self._cache["slots"]

    @property
    def attn_mask(self) -> torch.Tensor | None:
        """(T, n_keys) bool: every committed key, the token's ancestors in the block and itself (with a
        window, those of them at the row's last `window` positions); None when that is every key read (a
        single token over an exact-length read, no window). n_keys is start + T for a prefill chunk: the
        mask never spans the cache's unused capacity."""
        if "mask" not in self._cache:
            t = self.layout.size
            mask = None
            if not (self.exact and t == 1 and not self.window):
                key = torch.arange(self.n_keys, device=self.layout.parents.device)
                rel = key - self.start  # (S,) index of key in the block, when 0 <= rel < T
                in_block = (rel >= 0) & (rel < t)
                ancestor = self.layout.visible.gather(1, rel.clamp(0, t - 1)[None, :].expand(t, -1))
                mask = (rel < 0)[None, :] | (in_block[None, :] & ancestor)
                if self.window:  # by position: a block key's is its depth's, as the AR step sees it
                    depths = self.layout.depths
                    key_pos = torch.where(in_block, self.start + depths[rel.clamp(0, t - 1)], key)
                    mask &= key_pos[None, :] > (self.start + depths)[:, None] - self.window
            self._cache["mask"] = mask
        return self._cache["mask"]

    @property
    def parents_list(self) -> list[int]:
        """Parent indices on the host, read once per pass (not once per layer)."""
        if "parents" not in self._cache:
            self._cache["parents"] = self.layout.parents.tolist()
        return self._cache["parents"]

    @property
    def host_start(self) -> int:
        """`start` on the host: known without a read where n_keys is exact."""
        if "start" not in self._cache:
            self._cache["start"] = self.n_keys - self.layout.size if self.exact else int(self.start)
        return self._cache["start"]

    @property
    def ancestors_list(self) -> list[list[int]]:
        """Per token, its ancestors in the block and itself, root first, on the host: one read per pass,
        none for one token."""
        if "ancestors" not in self._cache:
            layout = self.layout
            if layout.size == 1:
                self._cache["ancestors"] = [[0]]
            else:
                rows = torch.cat([layout.depths[:, None] + 1, layout.paths()], dim=1).tolist()
                self._cache["ancestors"] = [row[1 : 1 + row[0]] for row in rows]
        return self._cache["ancestors"]

    @property
    def parents_int32(self) -> torch.Tensor:
        """Parent indices as the Triton kernels read them, converted once per pass (not once per layer)."""
        if "parents32" not in self._cache:
            self._cache["parents32"] = self.layout.parents.to(torch.int32)
        return self._cache["parents32"]

    @property
    def restart_points(self) -> torch.Tensor:
        """(T,) int8: the tokens whose DeltaNet state a later token restarts from (BlockLayout), once per
        pass: the verify's kernel stores only theirs."""
        if "restarts" not in self._cache:
            self._cache["restarts"] = self.layout.restart_points().to(torch.int8)
        return self._cache["restarts"]

    @property
    def attention_paths(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(paths (T, T), depths (T,)) as int32, for kernels/attention.py, once per pass."""
        if "paths" not in self._cache:
            layout = self.layout
            self._cache["paths"] = (layout.paths().to(torch.int32), layout.depths.to(torch.int32))
        return self._cache["paths"]

    def rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        if "rope" not in self._cache:
            self._cache["rope"] = self.rotary.cos_sin(self.positions, self.dtype)
        return self._cache["rope"]

    def conv_index(self, kernel: int) -> torch.Tensor:
        key = ("conv", kernel)
        if key not in self._cache:
            self._cache[key] = self.layout.conv_window_index(kernel)
        return self._cache[key]
