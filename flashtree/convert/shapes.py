"""The GGUF tensor layout a model config implies, and the named shapes `flashtree synth` writes.

`gguf_tensors(config)` lists the tensors llama.cpp's converter writes for a `ModelConfig` (metadata keys:
`ModelConfig.gguf_metadata`, flashtree/models/config.py); both `flashtree convert` (config read from a
Hugging Face config.json) and `flashtree synth` (a named shape below) write files through them, so the
two can never disagree.

Tensor shapes are in torch order (rows = output features, cols = input features); GGUF's `ne` is the
reverse. Architectures:
- `llama`: attn_q/k/v/output, ffn_norm, no q/k norms.
- `qwen3`: llama plus per-head attn_q_norm/attn_k_norm.
- `qwen35`: hybrid. Its FULL layers are gated full attention (attn_q holds [q | gate] per head), its
  LINEAR ones Gated DeltaNet layers (attn_qkv, attn_gate, ssm_*). Its second norm is called
  post_attention_norm.
- `dflash-draft`: a qwen3-style DFlash draft without embeddings or LM head (see flashtree/convert/hf.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from flashtree.errors import FlashtreeError
from flashtree.models.config import DRAFT_ARCH, LINEAR, LinearAttnConfig, ModelConfig, hybrid_layer_types


@dataclass(frozen=True)
class TensorSpec:
    """One GGUF tensor: its name, torch-order shape and block index (None outside blocks)."""

    name: str
    shape: tuple[int, ...]
    layer: int | None = None

    @property
    def base(self) -> str:
        """The name without its `blk.N.` prefix, e.g. 'attn_q.weight'."""
        return self.name if self.layer is None else self.name.split(".", 2)[2]


def gguf_tensors(c: ModelConfig) -> list[TensorSpec]:
    """Every tensor of the GGUF file of a model of config `c`, in the order it is written."""
    specs: list[TensorSpec] = []
    if c.arch == DRAFT_ARCH:
        specs += [
            TensorSpec("fc.weight", (c.hidden, len(c.target_layer_ids) * c.hidden)),
            TensorSpec("hidden_norm.weight", (c.hidden,)),
        ]
    else:
        specs.append(TensorSpec("token_embd.weight", (c.vocab, c.hidden)))
    for layer in range(c.n_layers):
        specs += [TensorSpec(f"blk.{layer}.{base}", shape, layer) for base, shape in _block(c, layer)]
    specs.append(TensorSpec("output_norm.weight", (c.hidden,)))
    if c.arch != DRAFT_ARCH and not c.tied_embeddings:
        specs.append(TensorSpec("output.weight", (c.vocab, c.hidden)))
    return specs


def _block(c: ModelConfig, layer: int) -> list[tuple[str, tuple[int, ...]]]:
    H, F = c.hidden, c.ffn
    mixer = _linear_attention(c.hidden, c.linear_attn) if c.layer_types[layer] == LINEAR else _attention(c)
    second_norm = "post_attention_norm" if c.arch == "qwen35" else "ffn_norm"
    return [
        ("attn_norm.weight", (H,)),
        *mixer,
        (f"{second_norm}.weight", (H,)),
        ("ffn_gate.weight", (F, H)),
        ("ffn_up.weight", (F, H)),
        ("ffn_down.weight", (H, F)),
    ]


def _attention(c: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    H, D = c.hidden, c.head_dim
    q_rows = c.n_heads * D * (2 if c.arch == "qwen35" else 1)  # qwen35: [q | gate] per head
    tensors = [
        ("attn_q.weight", (q_rows, H)),
        ("attn_k.weight", (c.n_kv_heads * D, H)),
        ("attn_v.weight", (c.n_kv_heads * D, H)),
        ("attn_output.weight", (H, c.n_heads * D)),
    ]
    if c.arch != "llama":
        tensors += [("attn_q_norm.weight", (D,)), ("attn_k_norm.weight", (D,))]
    return tensors


def _linear_attention(H: int, la: LinearAttnConfig) -> list[tuple[str, tuple[int, ...]]]:
    return [
        ("attn_qkv.weight", (la.conv_channels, H)),
        ("attn_gate.weight", (la.inner, H)),
        ("ssm_beta.weight", (la.n_v_heads, H)),
        ("ssm_alpha.weight", (la.n_v_heads, H)),
        ("ssm_conv1d.weight", (la.conv_channels, la.conv_kernel)),
        ("ssm_dt.bias", (la.n_v_heads,)),
        ("ssm_a", (la.n_v_heads,)),
        ("ssm_norm.weight", (la.head_v_dim,)),
        ("ssm_out.weight", (H, la.inner)),
    ]


_TINY = dict(
    n_layers=8, hidden=256, ffn=512, n_heads=4, n_kv_heads=2, head_dim=64, vocab=4096, context_length=4096
)

SHAPES: dict[str, ModelConfig] = {
    # Qwen3.5/3.6 27B text model (qwen35-gguf.md §1.1).
    "qwen3.6-27b": ModelConfig(
        arch="qwen35",
        n_layers=64,
        hidden=5120,
        ffn=17408,
        n_heads=24,
        n_kv_heads=4,
        head_dim=256,
        vocab=248320,
        context_length=262144,
        rope_theta=1e7,
        rms_eps=1e-6,
        rope_dim=64,
        rope_sections=(11, 11, 10, 0),
        layer_types=hybrid_layer_types(64, 4),
        linear_attn=LinearAttnConfig(16, 48, 128, 128),
    ),
    "qwen3-8b": ModelConfig(
        arch="qwen3",
        n_layers=36,
        hidden=4096,
        ffn=12288,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        vocab=151936,
        context_length=40960,
        rope_theta=1e6,
        rms_eps=1e-6,
    ),
    # SmolLM2-135M-Instruct (offline-data.md): tied embeddings.
    "smollm2-135m": ModelConfig(
        arch="llama",
        n_layers=30,
        hidden=576,
        ffn=1536,
        n_heads=9,
        n_kv_heads=3,
        head_dim=64,
        vocab=49152,
        context_length=8192,
        rope_theta=1e5,
        rms_eps=1e-5,
        tied_embeddings=True,
    ),
    # Tiny shapes for tests: 8 layers (enough for a DFlash draft's feature layers), every matrix row a
    # whole number of 256-value k-quant blocks, the Qwen3 tokenizer cut to 4096 ids.
    "tiny-llama": ModelConfig(arch="llama", rope_theta=1e4, rms_eps=1e-5, tied_embeddings=True, **_TINY),
    "tiny-qwen3": ModelConfig(arch="qwen3", rope_theta=1e6, rms_eps=1e-6, **_TINY),
    "tiny-qwen35": ModelConfig(
        arch="qwen35",
        rope_theta=1e7,
        rms_eps=1e-6,
        rope_dim=16,
        rope_sections=(3, 3, 2, 0),
        layer_types=hybrid_layer_types(8, 4),
        linear_attn=LinearAttnConfig(2, 4, 64, 64),
        **_TINY,
    ),
}
# The tokenizer synth writes into each shape's file (see synth.py)
SHAPE_TOKENIZERS = {
    "qwen3.6-27b": "qwen3",
    "qwen3-8b": "qwen3",
    "smollm2-135m": "smollm2",
    **dict.fromkeys(("tiny-llama", "tiny-qwen3", "tiny-qwen35"), "qwen3-tiny"),
}


def get_shape(name: str) -> ModelConfig:
    try:
        return SHAPES[name]
    except KeyError:
        raise FlashtreeError(f"unknown shape {name!r} (known: {', '.join(SHAPES)})") from None
