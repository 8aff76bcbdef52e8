"""DFlash draft GGUFs in llama.cpp's layout (arch `dflash`; models/config.py says what it holds).

llama.cpp runs a draft only with its target's tokenizer inside it (it reads the mask token through the
draft's vocabulary, as its converter's `--target-model-dir` writes it): `target_tokenizer` takes the
tokenizer.* keys of the target, a GGUF file or a Hugging Face directory. flashtree itself never reads
them (a draft runs on its target's tokenizer), so a draft written without one still loads here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from flashtree.errors import FlashtreeError
from flashtree.gguf.reader import GGUFFile, open_gguf
from flashtree.gguf.writer import TensorSource, write_gguf
from flashtree.models.config import (
    DRAFT_GGUF_ARCHS,
    LLAMA_DRAFT_ARCH,
    LLAMA_DRAFT_TENSORS,
    MASK_TOKEN_KEY,
    DraftConfig,
    ModelConfig,
)

log = logging.getLogger(__name__)


def target_tokenizer(target: Path) -> dict:
    """The tokenizer.* metadata of a target: a GGUF file's keys as they are, or those of a Hugging Face
    directory's tokenizer.json (+ tokenizer_config.json), as `flashtree convert` writes them."""
    target = Path(target)
    if target.is_dir():
        from flashtree.convert.hf import read_config, tokenizer_metadata

        config = ModelConfig.from_hf_config(read_config(target), target / "config.json")
        meta = tokenizer_metadata(target, config.vocab)
        if not meta:
            raise FlashtreeError(f"{target}: no tokenizer.json to take the draft's tokenizer from")
        return meta
    g = open_gguf(target)
    meta = {k: v for k, v in g.metadata.items() if k.startswith("tokenizer.")}
    if "tokenizer.ggml.model" not in meta:
        raise FlashtreeError(f"{target}: no tokenizer in the file to take the draft's tokenizer from")
    return meta


def draft_metadata(cfg: DraftConfig, general: dict, tokenizer: dict | None) -> dict:
    """All of a draft GGUF's metadata: general.*, the `dflash.*` keys, the target's tokenizer (typed as
    its file types them) and the mask token."""
    if tokenizer is None:
        log.warning("no target tokenizer given: llama.cpp will not load this draft (flashtree will)")
    tokens = (tokenizer or {}).get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens) != cfg.vocab:
        raise FlashtreeError(f"the target tokenizer has {len(tokens)} tokens, the draft vocab {cfg.vocab}")
    tokenizer = {k: v for k, v in (tokenizer or {}).items() if k != MASK_TOKEN_KEY}
    return general | tokenizer | cfg.llama_metadata()


def write_draft(
    out: Path, cfg: DraftConfig, metadata: dict, tensors: Iterable[TensorSource], progress: bool = True
) -> None:
    """Write a draft GGUF in llama.cpp's layout from tensors under flashtree's names (convert.shapes)."""
    renamed = ((LLAMA_DRAFT_TENSORS.get(name, name), t, qtype) for name, t, qtype in tensors)
    write_gguf(out, LLAMA_DRAFT_ARCH, metadata, renamed, progress=progress)


def rewrite_draft(src: Path, out: Path, tokenizer: dict | None) -> None:
    """A draft GGUF of either layout written again in llama.cpp's, every tensor's bytes as they are."""
    with GGUFFile(src) as g:
        if g.arch not in DRAFT_GGUF_ARCHS:
            raise FlashtreeError(f"{src}: architecture {g.arch!r} is not a DFlash draft")
        cfg = ModelConfig.from_gguf(g)
        general = {k: v for k, v in g.metadata.items() if k.startswith("general.")}
        del general["general.architecture"]
        ours = {v: k for k, v in LLAMA_DRAFT_TENSORS.items()}
        raw = lambda n, t: g.raw(n).reshape(*t.shape[:-1], -1)  # noqa: E731 - (rows, bytes) to its shape
        tensors = ((ours.get(n, n), raw(n, t), t.qtype) for n, t in g.tensors.items())
        write_draft(out, cfg, draft_metadata(cfg, general, tokenizer), tensors, progress=False)
