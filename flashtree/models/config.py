"""Target model settings, parsed once from GGUF metadata; nothing downstream reads raw metadata."""

from __future__ import annotations

from dataclasses import dataclass

from flashtree.errors import FlashtreeError
from flashtree.gguf.reader import GGUFFile

ATTENTION, DELTANET = "attention", "deltanet"


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    name: str
    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    context_length: int
    rms_eps: float
    rope_theta: float
    rope_dim: int  # rotary dims per head (partial rotary when < head_dim)
    tied_embeddings: bool
    layer_types: tuple[str, ...]  # ATTENTION or DELTANET per layer
    ssm_kernel: int = 0
    ssm_k_heads: int = 0
    ssm_v_heads: int = 0
    ssm_k_dim: int = 0
    ssm_v_dim: int = 0

    @property
    def n_attention_layers(self) -> int:
        return sum(t == ATTENTION for t in self.layer_types)

    @staticmethod
    def from_gguf(g: GGUFFile) -> ModelConfig:
        n_heads = int(g.arch_get("attention.head_count"))
        hidden = int(g.arch_get("embedding_length"))
        head_dim = int(g.arch_get("attention.key_length", hidden // n_heads))
        n_layers = int(g.arch_get("block_count")) - int(g.arch_get("nextn_predict_layers", 0))
        vocab = g.tensors["token_embd.weight"].shape[0] if g.has("token_embd.weight") else 0
        if not vocab:
            raise FlashtreeError(f"{g.path}: missing tensor 'token_embd.weight'")
        common = dict(
            arch=g.arch,
            name=str(g.get("general.name", g.path.stem)),
            n_layers=n_layers,
            hidden=hidden,
            ffn=int(g.arch_get("feed_forward_length")),
            n_heads=n_heads,
            n_kv_heads=int(g.arch_get("attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            vocab=vocab,
            context_length=int(g.arch_get("context_length", 4096)),
            rms_eps=float(g.arch_get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(g.arch_get("rope.freq_base", 10000.0)),
            rope_dim=int(g.arch_get("rope.dimension_count", head_dim)),
            tied_embeddings=not g.has("output.weight"),
        )
        if g.arch != "qwen35":
            return ModelConfig(**common, layer_types=(ATTENTION,) * n_layers)
        interval = int(g.arch_get("full_attention_interval", 4))
        layer_types = tuple(ATTENTION if (i + 1) % interval == 0 else DELTANET for i in range(n_layers))
        v_heads = int(g.arch_get("ssm.time_step_rank"))
        return ModelConfig(
            **common,
            layer_types=layer_types,
            ssm_kernel=int(g.arch_get("ssm.conv_kernel")),
            ssm_k_heads=int(g.arch_get("ssm.group_count")),
            ssm_v_heads=v_heads,
            ssm_k_dim=int(g.arch_get("ssm.state_size")),
            ssm_v_dim=int(g.arch_get("ssm.inner_size")) // v_heads,
        )
