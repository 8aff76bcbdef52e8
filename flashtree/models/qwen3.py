"""qwen3 dense: GQA attention with per-head q/k RMSNorm, NeoX RoPE (no row permutation)."""

from __future__ import annotations

from flashtree.models.attention import Attention
from flashtree.models.config import ModelConfig
from flashtree.models.loader import Weights
from flashtree.models.model import DecoderModel


def attention(w: Weights, c: ModelConfig, prefix: str, output_gate: bool = False) -> Attention:
    """Attention with q/k norms, shared with qwen35's gated full-attention layers."""
    return Attention(
        qkv=w.merged([f"{prefix}.attn_{n}.weight" for n in ("q", "k", "v")]),
        o=w.linear(f"{prefix}.attn_output.weight"),
        n_heads=c.n_heads,
        n_kv_heads=c.n_kv_heads,
        head_dim=c.head_dim,
        eps=c.rms_eps,
        q_norm=w.vector(f"{prefix}.attn_q_norm.weight"),
        k_norm=w.vector(f"{prefix}.attn_k_norm.weight"),
        output_gate=output_gate,
    )


def build(c: ModelConfig, w: Weights) -> DecoderModel:
    layers = [w.layer(f"blk.{i}", attention(w, c, f"blk.{i}"), c) for i in range(c.n_layers)]
    return w.decoder(c, layers)
