"""qwen35 hybrid (Qwen3.5/3.6): gated full attention every `full_attention_interval`-th layer,
Gated DeltaNet elsewhere. GGUF already holds +1 in the zero-centred norms and -exp(A_log) in ssm_a."""

from __future__ import annotations

from flashtree.models.config import FULL, ModelConfig
from flashtree.models.deltanet import GatedDeltaNet
from flashtree.models.loader import Weights
from flashtree.models.model import DecoderModel
from flashtree.models.qwen3 import attention


def deltanet(w: Weights, c: ModelConfig, p: str) -> GatedDeltaNet:
    return GatedDeltaNet(
        in_proj=w.merged([f"{p}.{n}.weight" for n in ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha")]),
        out=w.linear(f"{p}.ssm_out.weight"),
        conv_weight=w.dense(f"{p}.ssm_conv1d.weight"),
        dt_bias=w.vector(f"{p}.ssm_dt.bias"),
        ssm_a=w.vector(f"{p}.ssm_a"),
        norm_weight=w.vector(f"{p}.ssm_norm.weight"),
        n_k_heads=c.linear_attn.n_k_heads,
        n_v_heads=c.linear_attn.n_v_heads,
        k_dim=c.linear_attn.head_k_dim,
        v_dim=c.linear_attn.head_v_dim,
        eps=c.rms_eps,
    )


def build(c: ModelConfig, w: Weights) -> DecoderModel:
    layers = []
    for i, kind in enumerate(c.layer_types):
        p = f"blk.{i}"
        mixer = attention(w, c, p, output_gate=True) if kind == FULL else deltanet(w, c, p)
        layers.append(w.layer(p, mixer, c, mlp_norm="post_attention_norm"))
    return w.decoder(c, layers)
