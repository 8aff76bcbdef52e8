"""Replay greedy speculative decoding over a known greedy output: the accept length each decode step
would have, from draft logits computed for many positions at once, without running the target step by step.

Greedy decoding with any draft emits the target's greedy tokens x_0, x_1, ...; the draft decides only how
many each step takes. A step whose root (the last emitted token) sits at position p builds its chain or
DDTree from the draft's logits exactly as SpecDecoder does, and accepts the longest path of it that spells
x_{p+1}, x_{p+2}, ...: the target's sample at a node of depth d on that path is x_{p+d+1}, so accept_path
with those samples finds it. The draft's logits for a root at p are teacher-forced: its context is the
target's features of positions < p, which is what decoding gives it (the accepted tokens are the same).
So the steps are a walk p -> p + accepted + 1 with the accept length `flashtree bench` measures (equal
step for step: tests/test_replay.py), for the cost of one batched draft pass: the trainer reports its
held-out accept length with it, and benchmarks/replay_al.py compares drafts and tree settings on the CPU.
(The ring of `draft_ctx` past features is not modelled: every context position is seen.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from flashtree.config import SpecConfig
from flashtree.engine.generate import GenerationStats
from flashtree.models.dflash import DFlashDraft
from flashtree.spec.accept import accept_path
from flashtree.spec.tree import draft_tree
from flashtree.train.forward import draft_hidden
from flashtree.train.loss import block_attention_mask

LogitsAt = Callable[[int], torch.Tensor]  # root position p -> the draft's logits (B - 1, V) after it


def replay(
    ids: torch.Tensor, first: int, logits_at: LogitsAt, specs: list[SpecConfig], block_size: int
) -> list[GenerationStats]:
    """Decode steps over ids (prompt + greedy output, 1-D long), the first generated token (the prefill's)
    at position `first`, under each spec: every step's emitted count, as GenerationStats records them.
    The walks advance together, the one furthest behind first, so that logits_at is asked for positions
    that only grow (TeacherForcedDraft keeps one chunk of them)."""
    n = ids.shape[0]
    # label of a node at depth d = x_{p+d+1}; -1 past the end matches nothing
    padded = torch.cat([ids, torch.full((block_size + 1,), -1, dtype=ids.dtype, device=ids.device)])
    stats = [GenerationStats(spec.mode) for spec in specs]
    roots = [first] * len(specs)
    while (p := min(roots)) < n - 1:
        i = roots.index(p)
        tree = draft_tree(specs[i], ids[p], logits_at(p))
        samples = padded[p + 1 + tree.layout.depths]
        accepted = int(accept_path(tree.tokens, tree.layout, samples).n)  # root + draft nodes = emitted
        stats[i].record_step(min(accepted, n - 1 - p))
        roots[i] = p + accepted
    return stats


class TeacherForcedDraft:
    """A DFlash draft's logits for roots at any position of one sequence, from the training forward
    (train/forward.draft_hidden, equal to DFlashDraft.propose per block): `chunk` roots per pass and one
    LM head matmul for all of them (per root it would read the whole head each time), computed when one
    of them is first asked for. Only the latest chunk is kept: callers ask for positions that only grow."""

    def __init__(
        self, draft: DFlashDraft, features: torch.Tensor, ids: torch.Tensor, block_size: int, chunk: int = 64
    ):
        self.draft, self.features, self.ids = draft, features[None], ids[None]  # (1, S, F), (1, S)
        self.block_size, self.chunk = block_size, chunk
        self.start, self.logits = -1, None  # the kept chunk's first root, its (chunk, B - 1, V) logits

    @torch.no_grad()
    def __call__(self, p: int) -> torch.Tensor:
        start = p - p % self.chunk
        if start != self.start:
            self.start, self.logits = start, None  # the old chunk's memory goes first
            h = self._block_states(start)[:, 1:]  # (chunk, B - 1, H): the blocks' mask positions
            rows = h.reshape(-1, h.shape[-1]).to(self.draft.target.dtype)  # rows, as every LM head takes
            self.logits = self.draft.lm_head(rows).view(*h.shape[:2], -1)
        return self.logits[p - start]

    def _block_states(self, start: int) -> torch.Tensor:
        s, b = self.ids.shape[1], self.block_size
        anchors = torch.arange(start, min(start + self.chunk, s), device=self.ids.device)[None]  # (1, N)
        pos = anchors[:, :, None] + torch.arange(b, device=anchors.device)  # (1, N, B)
        block_ids = torch.full_like(pos, self.draft.config.mask_token_id)
        block_ids[:, :, 0] = self.ids[:, anchors[0]]
        hidden = draft_hidden(
            self.draft,
            self.features,
            block_ids.view(1, -1),
            pos.view(1, -1),
            block_attention_mask(anchors, s, b),
        )
        return hidden.view(anchors.shape[1], b, -1)


def replay_draft(
    draft: DFlashDraft,
    features: torch.Tensor,
    ids: torch.Tensor,
    first: int,
    specs: list[SpecConfig],
    block_size: int,
) -> list[GenerationStats]:
    """replay() of a DFlash draft under each of `specs` (chain, trees of other settings), sharing one
    teacher-forced pass. features: (S, n_feat * H) the target's captured features at every position."""
    return replay(ids, first, TeacherForcedDraft(draft, features, ids, block_size), specs, block_size)
