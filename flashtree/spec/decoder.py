"""One speculative step: draft -> tree -> verify -> accept -> commit."""

from __future__ import annotations

import torch

from flashtree.config import SamplingParams, SpecConfig
from flashtree.errors import FlashtreeError
from flashtree.models.dflash import DFlashDraft
from flashtree.models.model import DecoderModel
from flashtree.models.state import ModelState
from flashtree.sampling import sample
from flashtree.spec.accept import accept_path
from flashtree.spec.tree import DraftTree, build_tree, chain_tree


class SpecDecoder:
    def __init__(self, target: DecoderModel, draft: DFlashDraft, spec: SpecConfig):
        self.target, self.draft, self.spec = target, draft, spec
        self.block_size = spec.block_size or draft.config.block_size
        if self.block_size < 2:
            raise FlashtreeError(f"block size must be >= 2, got {self.block_size}")
        self.capture_layers = draft.config.target_layer_ids
        self.context = draft.new_context(spec.draft_ctx)

    @property
    def max_block(self) -> int:
        """Largest verify block: the root plus the draft nodes."""
        return 1 + (self.spec.budget if self.spec.mode == "tree" else self.block_size - 1)

    def reset(self) -> None:
        self.context.reset()

    def observe(self, features: torch.Tensor) -> None:
        """Target features (T, n_feat * H) of newly committed tokens enter the draft's context ring."""
        self.draft.append_context(self.context, features)

    def draft_tree(self, root: int) -> DraftTree:
        logits = self.draft.propose(self.context, root, self.block_size)  # (B - 1, V)
        if self.spec.mode == "chain":
            return chain_tree(root, logits)
        s = self.spec
        return build_tree(root, logits, s.budget, s.tree_top_k, s.chain_seed, s.draft_temperature)

    def step(self, root: int, state: ModelState, sampling: SamplingParams) -> list[int]:
        """Draft from the last emitted token, verify, commit; returns the accepted draft tokens plus
        the bonus token."""
        tree = self.draft_tree(root)
        start = state.seq_len  # the root's position
        out = self.target(tree.tokens, state, tree.layout, commit=False, capture=self.capture_layers)
        samples = sample(out.logits, sampling, start + tree.layout.depths + 1)
        path, emitted = accept_path(tree.tokens, tree.layout, samples)
        state.commit_path(path)
        self.observe(out.features[path])
        return emitted
