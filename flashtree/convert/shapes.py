"""Model shapes and the GGUF layout they imply: tensor names, tensor shapes, metadata keys.

A `ModelShape` holds the geometry of one model. `gguf_tensors()` and `gguf_metadata()` turn it into the
layout llama.cpp's converter writes for that architecture; both `flashtree convert` (shape read from a
Hugging Face config) and `flashtree synth` (a named shape below) write files through them, so the two
can never disagree.

Tensor shapes are in torch order (rows = output features, cols = input features); GGUF's `ne` is the
reverse. Architectures:
- `llama`: attn_q/k/v/output, ffn_norm, no q/k norms.
- `qwen3`: llama plus per-head attn_q_norm/attn_k_norm.
- `qwen35`: hybrid. Layer i is full attention iff (i+1) % full_attention_interval == 0 (gated: attn_q
  holds [q | gate] per head); the others are Gated DeltaNet layers (attn_qkv, attn_gate, ssm_*).
  Its second norm is called post_attention_norm.
- `dflash-draft`: a qwen3-style DFlash draft without embeddings or LM head (see flashtree/convert/hf.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from flashtree.errors import FlashtreeError

ARCHS = ("llama", "qwen3", "qwen35", "dflash-draft")


@dataclass(frozen=True)
class LinearAttnShape:
    """Gated DeltaNet geometry of the qwen35 linear-attention layers."""

    n_k_heads: int
    n_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4

    @property
    def inner(self) -> int:
        """Width of the value/gate stream: n_v_heads * head_v_dim."""
        return self.n_v_heads * self.head_v_dim

    @property
    def conv_channels(self) -> int:
        """Channels of the causal conv: [q | k | v] of in_proj_qkv."""
        return 2 * self.n_k_heads * self.head_k_dim + self.inner


@dataclass(frozen=True)
class DFlashShape:
    """What a DFlash draft adds to its qwen3-style body (dflash.md §2.1)."""

    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    n_target_layers: int
    layer_types: tuple[str, ...] | None = None  # per draft layer: full_attention | sliding_attention
    sliding_window: int | None = None


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


@dataclass(frozen=True)
class ModelShape:
    arch: str
    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    context: int
    rope_theta: float
    rms_eps: float
    tied_embeddings: bool = False
    rope_dim: int | None = None  # rotated dims per head; None = head_dim
    rope_sections: tuple[int, ...] = ()  # qwen35 M-RoPE sections, padded to 4
    full_attention_interval: int | None = None  # qwen35 only
    linear_attn: LinearAttnShape | None = None  # qwen35 only
    dflash: DFlashShape | None = None  # dflash-draft only
    tokenizer: str | None = None  # synth: which tokenizer goes into the metadata (see synth.py)

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise FlashtreeError(f"unknown architecture {self.arch!r} (supported: {', '.join(ARCHS)})")
        if self.n_heads % self.n_kv_heads:
            raise FlashtreeError(
                f"{self.n_heads} attention heads do not split into {self.n_kv_heads} KV heads"
            )
        if self.arch == "qwen35" and (self.linear_attn is None or not self.full_attention_interval):
            raise FlashtreeError(
                "a qwen35 shape needs linear-attention geometry and a full_attention_interval"
            )
        if self.arch == "dflash-draft" and self.dflash is None:
            raise FlashtreeError("a dflash-draft shape needs its DFlash settings")

    def is_full_attention(self, layer: int) -> bool:
        if self.arch != "qwen35":
            return True
        return (layer + 1) % self.full_attention_interval == 0

    def gguf_tensors(self) -> list[TensorSpec]:
        """Every tensor of the GGUF file, in the order it is written."""
        specs: list[TensorSpec] = []
        if self.arch == "dflash-draft":
            n_features = len(self.dflash.target_layer_ids)
            specs += [
                TensorSpec("fc.weight", (self.hidden, n_features * self.hidden)),
                TensorSpec("hidden_norm.weight", (self.hidden,)),
            ]
        else:
            specs.append(TensorSpec("token_embd.weight", (self.vocab, self.hidden)))
        for layer in range(self.n_layers):
            specs += [TensorSpec(f"blk.{layer}.{base}", shape, layer) for base, shape in self._block(layer)]
        specs.append(TensorSpec("output_norm.weight", (self.hidden,)))
        if self.arch != "dflash-draft" and not self.tied_embeddings:
            specs.append(TensorSpec("output.weight", (self.vocab, self.hidden)))
        return specs

    def _block(self, layer: int) -> list[tuple[str, tuple[int, ...]]]:
        H, F = self.hidden, self.ffn
        mixer = self._attention() if self.is_full_attention(layer) else self._linear_attention()
        second_norm = "post_attention_norm" if self.arch == "qwen35" else "ffn_norm"
        return [
            ("attn_norm.weight", (H,)),
            *mixer,
            (f"{second_norm}.weight", (H,)),
            ("ffn_gate.weight", (F, H)),
            ("ffn_up.weight", (F, H)),
            ("ffn_down.weight", (H, F)),
        ]

    def _attention(self) -> list[tuple[str, tuple[int, ...]]]:
        H, D = self.hidden, self.head_dim
        q_rows = self.n_heads * D * (2 if self.arch == "qwen35" else 1)  # qwen35: [q | gate] per head
        tensors = [
            ("attn_q.weight", (q_rows, H)),
            ("attn_k.weight", (self.n_kv_heads * D, H)),
            ("attn_v.weight", (self.n_kv_heads * D, H)),
            ("attn_output.weight", (H, self.n_heads * D)),
        ]
        if self.arch != "llama":
            tensors += [("attn_q_norm.weight", (D,)), ("attn_k_norm.weight", (D,))]
        return tensors

    def _linear_attention(self) -> list[tuple[str, tuple[int, ...]]]:
        H, la = self.hidden, self.linear_attn
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

    def gguf_metadata(self) -> dict:
        """The `{arch}.*` keys (no general.* or tokenizer.* keys). Ints are counts (UINT32 in GGUF)."""
        a = self.arch
        meta = {
            f"{a}.vocab_size": self.vocab,
            f"{a}.block_count": self.n_layers,
            f"{a}.context_length": self.context,
            f"{a}.embedding_length": self.hidden,
            f"{a}.feed_forward_length": self.ffn,
            f"{a}.attention.head_count": self.n_heads,
            f"{a}.attention.head_count_kv": self.n_kv_heads,
            f"{a}.attention.key_length": self.head_dim,
            f"{a}.attention.value_length": self.head_dim,
            f"{a}.attention.layer_norm_rms_epsilon": float(self.rms_eps),
            f"{a}.rope.freq_base": float(self.rope_theta),
            f"{a}.rope.dimension_count": self.rope_dim or self.head_dim,
        }
        if a == "qwen35":
            la = self.linear_attn
            meta |= {
                f"{a}.rope.dimension_sections": list(self.rope_sections),
                f"{a}.full_attention_interval": self.full_attention_interval,
                f"{a}.ssm.conv_kernel": la.conv_kernel,
                f"{a}.ssm.state_size": la.head_k_dim,
                f"{a}.ssm.group_count": la.n_k_heads,
                f"{a}.ssm.time_step_rank": la.n_v_heads,
                f"{a}.ssm.inner_size": la.inner,
            }
        if a == "dflash-draft":
            meta |= self._dflash_metadata()
        return meta

    def _dflash_metadata(self) -> dict:
        d, a = self.dflash, self.arch
        meta = {
            f"{a}.dflash.block_size": d.block_size,
            f"{a}.dflash.mask_token_id": d.mask_token_id,
            f"{a}.dflash.target_layer_ids": list(d.target_layer_ids),
            f"{a}.dflash.n_target_layers": d.n_target_layers,
        }
        if d.layer_types is not None:
            meta[f"{a}.layer_types"] = list(d.layer_types)
        if d.sliding_window is not None:
            meta[f"{a}.attention.sliding_window"] = d.sliding_window
        return meta


def default_target_layer_ids(n_target_layers: int, n_draft_layers: int) -> tuple[int, ...]:
    """Target layers a DFlash draft reads features from, spread over 1 … L-3 (dflash.md §2.1).

    Clamped to the target's layers, which only matters for toy targets of fewer than 4 layers.
    """
    if n_draft_layers == 1:
        return (n_target_layers // 2,)
    step = (n_target_layers - 4) / (n_draft_layers - 1)
    return tuple(min(max(round(1 + i * step), 0), n_target_layers - 1) for i in range(n_draft_layers))


_TINY = dict(
    n_layers=8,
    hidden=256,
    ffn=512,
    n_heads=4,
    n_kv_heads=2,
    head_dim=64,
    vocab=4096,
    context=4096,
    tokenizer="qwen3-tiny",
)

SHAPES: dict[str, ModelShape] = {
    # Qwen3.5/3.6 27B text model (qwen35-gguf.md §1.1).
    "qwen3.6-27b": ModelShape(
        arch="qwen35",
        n_layers=64,
        hidden=5120,
        ffn=17408,
        n_heads=24,
        n_kv_heads=4,
        head_dim=256,
        vocab=248320,
        context=262144,
        rope_theta=1e7,
        rms_eps=1e-6,
        rope_dim=64,
        rope_sections=(11, 11, 10, 0),
        full_attention_interval=4,
        linear_attn=LinearAttnShape(16, 48, 128, 128),
        tokenizer="qwen3",
    ),
    "qwen3-8b": ModelShape(
        arch="qwen3",
        n_layers=36,
        hidden=4096,
        ffn=12288,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        vocab=151936,
        context=40960,
        rope_theta=1e6,
        rms_eps=1e-6,
        tokenizer="qwen3",
    ),
    # SmolLM2-135M-Instruct (offline-data.md): tied embeddings.
    "smollm2-135m": ModelShape(
        arch="llama",
        n_layers=30,
        hidden=576,
        ffn=1536,
        n_heads=9,
        n_kv_heads=3,
        head_dim=64,
        vocab=49152,
        context=8192,
        rope_theta=1e5,
        rms_eps=1e-5,
        tied_embeddings=True,
        tokenizer="smollm2",
    ),
    # Tiny shapes for tests: 8 layers (enough for a DFlash draft's feature layers), every matrix row a
    # whole number of 256-value k-quant blocks, the Qwen3 tokenizer cut to 4096 ids.
    "tiny-llama": ModelShape(arch="llama", rope_theta=1e4, rms_eps=1e-5, tied_embeddings=True, **_TINY),
    "tiny-qwen3": ModelShape(arch="qwen3", rope_theta=1e6, rms_eps=1e-6, **_TINY),
    "tiny-qwen35": ModelShape(
        arch="qwen35",
        rope_theta=1e7,
        rms_eps=1e-6,
        rope_dim=16,
        rope_sections=(3, 3, 2, 0),
        full_attention_interval=4,
        linear_attn=LinearAttnShape(2, 4, 64, 64),
        **_TINY,
    ),
}


def get_shape(name: str) -> ModelShape:
    try:
        return SHAPES[name]
    except KeyError:
        raise FlashtreeError(f"unknown shape {name!r} (known: {', '.join(SHAPES)})") from None
