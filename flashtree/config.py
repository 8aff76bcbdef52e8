"""Frozen settings shared along the data path: sampling, speculation, engine."""

from __future__ import annotations

from dataclasses import dataclass

from flashtree.errors import FlashtreeError


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next token is chosen. temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise FlashtreeError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise FlashtreeError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise FlashtreeError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


MODES = ("ar", "chain", "tree")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding settings. mode: ar (no draft), chain (one DFlash block), tree (DDTree)."""

    mode: str = "tree"
    block_size: int | None = None  # None = the draft's own block size
    budget: int = 22  # DDTree non-root nodes
    tree_top_k: int = 8  # candidates per depth considered by the tree builder
    chain_seed: bool = False  # insert the draft's greedy chain first (lowers the mean AL: spec/tree.py)
    draft_temperature: float = 1.0  # temperature of the draft distributions the tree is built from
    draft_ctx: int = 4096  # ring of past target features the draft attends to

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise FlashtreeError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.budget < 1:
            raise FlashtreeError(f"budget must be >= 1, got {self.budget}")
        if self.tree_top_k < 1:
            raise FlashtreeError(f"tree-top-k must be >= 1, got {self.tree_top_k}")
        if self.block_size is not None and self.block_size < 2:
            raise FlashtreeError(f"block size must be >= 2, got {self.block_size}")
        if self.draft_temperature <= 0:
            raise FlashtreeError(f"draft temperature must be > 0, got {self.draft_temperature}")
        if self.draft_ctx < 1:
            raise FlashtreeError(f"draft-ctx must be >= 1, got {self.draft_ctx}")
