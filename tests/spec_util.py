"""Test drafts for speculative decoding: a random real DFlash draft and an oracle draft."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from flashtree.config import SamplingParams, SpecConfig
from flashtree.convert.synth import synth_draft
from flashtree.engine.generate import Engine, GenerationStats
from flashtree.models.block import BlockLayout
from flashtree.models.dflash import load_draft


def random_draft_dir(target_gguf: Path, root: Path, layers: int = 1, seed: int = 0) -> Path:
    """A random z-lab-format draft for the target, written once per test session."""
    out = root / f"{target_gguf.stem}-draft{layers}-{seed}"
    if not (out / "config.json").exists():
        synth_draft(target_gguf, layers, out, seed)
    return out


def sliding_draft_dir(target_gguf: Path, root: Path) -> Path:
    """The random 2-layer draft with its first layer a sliding window's (10 positions)."""
    src = root / f"{target_gguf.stem}-sliding-draft"
    if not src.exists():
        plain = random_draft_dir(target_gguf, root, layers=2)
        src.mkdir()
        cfg = json.loads((plain / "config.json").read_text())
        cfg.update(
            layer_types=["sliding_attention", "full_attention"], sliding_window=10, use_sliding_window=True
        )
        (src / "config.json").write_text(json.dumps(cfg))
        shutil.copy(plain / "model.safetensors", src / "model.safetensors")
    return src


def random_draft(target_gguf: Path, target, root: Path, layers: int = 1, seed: int = 0):
    return load_draft(random_draft_dir(target_gguf, root, layers, seed), target)


class _Context:
    def __init__(self):
        self.length = 0

    def reset(self):
        self.length = 0


class OracleDraft:
    """Proposes the target's own continuation (known in advance), corrupting each token with
    probability `error`. A corrupted position still ranks the true token second, so DDTree can
    recover through a sibling: accepted lengths span 1..B and trees branch for real."""

    def __init__(self, sequence: list[int], vocab: int, block_size: int, error: float, seed: int = 0):
        from types import SimpleNamespace

        self.sequence, self.vocab, self.error, self.seed = sequence, vocab, error, seed
        self.config = SimpleNamespace(block_size=block_size, target_layer_ids=(0,))

    def new_context(self, size: int, spare: int = 0, block: int | None = None) -> _Context:
        return _Context()

    def append_context(self, ctx: _Context, features: torch.Tensor, n: torch.Tensor | None = None) -> None:
        ctx.length += features.shape[0] if n is None else int(n)

    def propose(
        self, ctx: _Context, root: torch.Tensor, block_size: int, n_keys: int | None = None
    ) -> torch.Tensor:
        start = ctx.length  # the root's position
        g = torch.Generator().manual_seed(self.seed * 100003 + start)
        logits = torch.randn(block_size - 1, self.vocab, generator=g)
        for j in range(1, block_size):
            pos = start + j
            true = (
                self.sequence[pos]
                if pos < len(self.sequence)
                else int(torch.randint(self.vocab, (1,), generator=g))
            )
            if float(torch.rand(1, generator=g)) < self.error:
                wrong = (true + 1 + int(torch.randint(self.vocab - 1, (1,), generator=g))) % self.vocab
                logits[j - 1, wrong] = 12.0
                logits[j - 1, true] = 11.0
            else:
                logits[j - 1, true] = 12.0
        return logits if root is None else logits.to(root.device)  # made on the host, used by the target


_engines: dict = {}


def engine(target, draft, **spec) -> Engine:
    """An Engine for (target, draft, spec settings), built once and reused (it resets per request)."""
    mode = spec.pop("mode", "tree" if draft is not None else "ar")
    key = (id(target), id(draft), mode, tuple(sorted(spec.items())))
    if key not in _engines:
        _engines[key] = Engine(target, None, draft, SpecConfig(mode=mode, **spec), max_ctx=512)
    return _engines[key]


def generate(
    target, draft, prompt: list[int], n: int, sampling=None, **spec
) -> tuple[list[int], GenerationStats]:
    """Tokens of one generation with stop ids disabled (random models emit EOS at random)."""
    e = engine(target, draft, **spec)
    stats = GenerationStats(e.mode)
    out = [
        t
        for step in e.generate(prompt, n, sampling or SamplingParams(), stop_ids=(), stats=stats)
        for t in step
    ]
    return out, stats


def verify_and_ar_logits(model, ids: torch.Tensor, parents: list[int], prefix: int, chain_len: int = 3):
    """After a prefill of ids[:prefix]: the logits of a tree verify of the next len(parents) ids (not
    committed), and of AR steps over the first chain_len of them (the tree's nodes 0, 1, ... must be a
    chain from the root), for comparing a verify's rows with the AR steps."""
    state = model.new_state(64)
    feed(model, ids[:prefix], state, logits="none")
    layout = BlockLayout.from_parents(torch.tensor(parents))
    tree = model(ids[prefix : prefix + len(parents)], state, layout, commit=False).logits
    state = model.new_state(64)
    feed(model, ids[:prefix], state, logits="none")
    steps = torch.cat([feed(model, ids[i : i + 1], state).logits for i in range(prefix, prefix + chain_len)])
    return tree, steps


def feed(model, tokens: torch.Tensor, state, **kwargs):
    """A committing forward and the host's count of it (ModelState.advance), as Engine does."""
    out = model(tokens, state, **kwargs)
    state.advance(tokens.shape[0])
    return out
