"""llama (SmolLM2): plain GQA attention. llama.cpp stores Q/K rows permuted for its interleaved
RoPE; we undo that once at load and use rotate-half RoPE like Hugging Face."""

from __future__ import annotations

import torch

from flashtree.gguf.reader import GGUFFile
from flashtree.models.attention import Attention
from flashtree.models.config import ModelConfig
from flashtree.models.layers import Linear
from flashtree.models.loader import Weights
from flashtree.models.model import DecoderModel


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's convert-time `permute(w, n_heads)` on Q/K projection rows."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def build(gguf: GGUFFile, w: Weights) -> DecoderModel:
    c = ModelConfig.from_gguf(gguf)
    layers = []
    for i in range(c.n_layers):
        p = f"blk.{i}"
        attn = Attention(
            q=Linear(unpermute_rows(w.dense(f"{p}.attn_q.weight"), c.n_heads)),
            k=Linear(unpermute_rows(w.dense(f"{p}.attn_k.weight"), c.n_kv_heads)),
            v=w.linear(f"{p}.attn_v.weight"),
            o=w.linear(f"{p}.attn_output.weight"),
            n_heads=c.n_heads,
            n_kv_heads=c.n_kv_heads,
            head_dim=c.head_dim,
            eps=c.rms_eps,
        )
        layers.append(w.layer(p, attn, c))
    return w.decoder(c, layers)
