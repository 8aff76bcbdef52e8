"""One speculative step: draft -> tree -> verify -> accept -> commit."""

from __future__ import annotations

import torch

from flashtree.config import SamplingParams, SpecConfig, check_block_size
from flashtree.engine.memory import check_free
from flashtree.engine.sampling import sample
from flashtree.models.dflash import DFlashDraft
from flashtree.models.model import DecoderModel
from flashtree.models.state import ModelState
from flashtree.spec.accept import accept_path
from flashtree.spec.tree import DraftTree, draft_tree, fills_budget


def ring_bytes(draft: DFlashDraft, slots: int) -> int:
    """Bytes of a DraftContext of `slots` K/V slots in all (ring, spare and block scratch)."""
    c = draft.config
    return 2 * c.n_layers * c.n_kv_heads * slots * c.head_dim * draft.dtype.itemsize


class SpecDecoder:
    def __init__(self, target: DecoderModel, draft: DFlashDraft, spec: SpecConfig, window: int = 0):
        """window: the verify's attention window (--attn-window), the AR step's: 0 is full attention."""
        self.target, self.draft, self.spec, self.window = target, draft, spec, window
        if spec.block_size is None:  # the draft's own, from its config file: checked before it sizes anything
            check_block_size("the draft's block_size (--block-size overrides it)", draft.config.block_size)
        self.block_size = spec.block_size or draft.config.block_size
        self.capture_layers = draft.config.target_layer_ids
        self._check_ring()
        # spare ring slots take the padded (rejected) rows a step appends: see DraftContext
        self.context = draft.new_context(spec.draft_ctx, spare=self.max_block, block=self.block_size)

    def _check_ring(self) -> None:
        """The draft's context ring must fit in free memory before it is allocated."""
        if isinstance(self.draft, DFlashDraft):  # (test drafts keep no ring)
            size = self.spec.draft_ctx
            need = ring_bytes(self.draft, size + self.max_block + self.block_size)
            check_free(need, self.draft.device, f"the draft's {size}-token context ring", "lower --draft-ctx")

    @property
    def max_block(self) -> int:
        """Largest verify block: the root plus the draft nodes."""
        return 1 + (self.spec.budget if self.spec.mode == "tree" else self.block_size - 1)

    @property
    def fixed_shape(self) -> bool:
        """Whether a step has the same shapes every time and reads nothing back (CUDA-graph safe)."""
        s = self.spec
        k = min(s.tree_top_k, self.target.config.vocab)
        return s.mode == "chain" or fills_budget(k, self.block_size - 1, s.budget)

    def reset(self) -> None:
        self.context.reset()

    def observe(self, features: torch.Tensor, n: torch.Tensor | None = None) -> None:
        """Target features (T, n_feat * H) of newly committed tokens (the first n) enter the draft's ring."""
        self.draft.append_context(self.context, features, n)

    def draft_tree(self, root: torch.Tensor, n_keys: int | None = None) -> DraftTree:
        logits = self.draft.propose(self.context, root, self.block_size, n_keys)  # (B - 1, V)
        return draft_tree(self.spec, root, logits)

    def step(
        self,
        root: torch.Tensor,
        state: ModelState,
        sampling: SamplingParams,
        seed: torch.Tensor | None = None,
        n_keys: int | None = None,
    ) -> torch.Tensor:
        """Draft from the last emitted token `root` (0-d, on the device), verify, accept, and commit
        the accepted nodes' KV/recurrent state and features. Device work only (the host side of the
        commit is the caller's, from the result): returns Accepted.packed, the step's one read-back."""
        tree = self.draft_tree(root, n_keys)
        out = self.target(
            tree.tokens, state, tree.layout, commit=False, capture=self.capture_layers, n_keys=n_keys,
            window=self.window,
        )  # fmt: skip
        samples = sample(out.logits, sampling, state.position + tree.layout.depths + 1, seed)
        accepted = accept_path(tree.tokens, tree.layout, samples)
        state.commit_path(accepted.path, accepted.n)
        self.observe(out.features[accepted.path], accepted.n)
        return accepted.packed(tree.tokens)
