"""llama (SmolLM2): plain GQA attention. llama.cpp stores Q/K rows permuted for its interleaved
RoPE; we undo that once at load (on dense or packed rows alike: quantized blocks never straddle rows)
and use rotate-half RoPE like Hugging Face."""

from __future__ import annotations

from functools import partial

import torch

from flashtree.models.attention import Attention
from flashtree.models.config import ModelConfig
from flashtree.models.loader import Weights
from flashtree.models.model import DecoderModel


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's convert-time `permute(w, n_heads)` on Q/K projection rows (w: (rows, ...))."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def build(c: ModelConfig, w: Weights) -> DecoderModel:
    layers = []
    for i in range(c.n_layers):
        p = f"blk.{i}"
        q, k, v = (f"{p}.attn_{n}.weight" for n in ("q", "k", "v"))
        unpermute = {
            q: partial(unpermute_rows, n_heads=c.n_heads),
            k: partial(unpermute_rows, n_heads=c.n_kv_heads),
        }
        attn = Attention(
            qkv=w.merged([q, k, v], reorder=unpermute),
            o=w.linear(f"{p}.attn_output.weight"),
            n_heads=c.n_heads,
            n_kv_heads=c.n_kv_heads,
            head_dim=c.head_dim,
            eps=c.rms_eps,
        )
        layers.append(w.layer(p, attn, c))
    return w.decoder(c, layers)
