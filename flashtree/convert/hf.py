"""`flashtree convert`: Hugging Face checkpoints (config.json + *.safetensors) to GGUF.

Target models are written in the layout llama.cpp's converter produces (config.json is read by
`ModelConfig.from_hf_config`, models/config.py; names and shapes come from `gguf_tensors` in shapes.py,
metadata from `ModelConfig.gguf_metadata`):
- `LlamaForCausalLM` -> `llama`: attn_q/attn_k rows permuted for llama.cpp's RoPE (`rope_permute`).
- `Qwen3ForCausalLM` -> `qwen3`: weights as they are (its RMSNorm weights are plain, not zero-centred).
- `Qwen3_5ForCausalLM` / `Qwen3_5ForConditionalGeneration` (text part; vision tower and MTP head are
  skipped) -> `qwen35`: +1 baked into the zero-centred norms (all but ssm_norm), ssm_a = -exp(A_log),
  conv1d squeezed to [channels, kernel], and the V heads of every linear-attention tensor reordered from
  grouped-by-K-head to tiled (`tile_v_heads`), so GGUF V head j pairs with K head j % n_k_heads.
The tokenizer (tokenizer.json, tokenizer_config.json with its chat template) goes into tokenizer.* keys.
Matrices are written as f32/f16/bf16/q8_0/q4_k_m per `recipe_types`; 1-D tensors stay F32.

DFlash drafts (z-lab format, config `architectures: ["DFlashDraftModel"]`, dflash.md §2) -> llama.cpp's
arch `dflash` (convert/draft.py; the keys in models/config.py), as its convert_hf_to_gguf.py writes them:
a qwen3-style body written as it is (no permutation, no +1), without embeddings or LM head (the draft uses
the target's), with the target's tokenizer when `target` gives it (a GGUF file or a Hugging Face dir):
  tensors  fc.weight [H, n_features*H] (ne reversed), enc.output_norm.weight [H] (hidden_norm),
           output_norm.weight [H] (from `norm`), blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output,
           attn_q_norm, attn_k_norm, ffn_norm, ffn_gate, ffn_up, ffn_down}.weight
  metadata dflash.{vocab_size, block_count, context_length, embedding_length, feed_forward_length,
           attention.head_count, attention.head_count_kv, attention.key_length, attention.value_length,
           attention.layer_norm_rms_epsilon, rope.freq_base, rope.dimension_count, block_size,
           target_layers (z-lab's target_layer_ids + 1)}, tokenizer.ggml.mask_token_id, and with sliding
           layers dflash.attention.sliding_window + dflash.attention.sliding_window_pattern (bools).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from flashtree.convert.draft import draft_metadata, rewrite_draft, target_tokenizer, write_draft
from flashtree.convert.shapes import TensorSpec, gguf_tensors
from flashtree.errors import FlashtreeError
from flashtree.gguf.hf_tokenizer import gguf_tokenizer_metadata
from flashtree.gguf.writer import write_gguf
from flashtree.models.config import DRAFT_ARCH, LinearAttnConfig, ModelConfig
from flashtree.quant.recipe import FILE_TYPES, RECIPES, recipe_types

log = logging.getLogger(__name__)

GGML_QUANT_VERSION = 2  # written by llama.cpp into every file as general.quantization_version

# GGUF base name -> Hugging Face name inside the model (after the `model.` / `layers.N.` prefixes)
HF_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "hidden_norm.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# qwen35 norms stored zero-centred (Qwen3_5RMSNorm scales by 1 + w); the gated ssm_norm is plain
ZERO_CENTRED_NORMS = frozenset(
    {
        "attn_norm.weight",
        "post_attention_norm.weight",
        "attn_q_norm.weight",
        "attn_k_norm.weight",
        "output_norm.weight",
    }
)


def hf_name(spec: TensorSpec, prefix: str) -> str:
    """Checkpoint name of a GGUF tensor; `prefix` is 'model.', 'model.language_model.' or '' (drafts)."""
    if spec.name == "output.weight":
        return "lm_head.weight"
    layer = "" if spec.layer is None else f"layers.{spec.layer}."
    return prefix + layer + HF_NAMES[spec.base]


def hf_shape(spec: TensorSpec) -> tuple[int, ...]:
    """Shape of the checkpoint tensor: as in GGUF, except conv1d which HF keeps as [channels, 1, kernel]."""
    if spec.base == "ssm_conv1d.weight":
        return (spec.shape[0], 1, spec.shape[1])
    return spec.shape


# --- config.json ------------------------------------------------------------------------------------


def read_config(src: Path) -> dict:
    if not src.is_dir():
        raise FlashtreeError(f"{src}: not a directory (expected a Hugging Face checkpoint directory)")
    path = src / "config.json"
    if not path.is_file():
        raise FlashtreeError(f"{src}: no config.json, not a Hugging Face checkpoint directory")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FlashtreeError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise FlashtreeError(f"{path}: expected a JSON object")
    return config


# --- safetensors ------------------------------------------------------------------------------------


class Checkpoint:
    """Lazy, tensor-by-tensor access to the *.safetensors files of a directory (sharded or not)."""

    def __init__(self, src: Path):
        files = sorted(src.glob("*.safetensors"))
        if not files:
            raise FlashtreeError(f"{src}: no *.safetensors files")
        self.src = src
        self.file_of: dict[str, Path] = {}
        for file in files:
            with self._open(file) as handle:
                self.file_of |= dict.fromkeys(handle.keys(), file)

    def _open(self, file: Path):
        try:
            return safe_open(file, framework="pt")
        except (SafetensorError, OSError) as e:
            raise FlashtreeError(f"{file}: not a readable safetensors file ({e})") from None

    def prefix(self, arch: str) -> str:
        """Name prefix of the language model: drafts have none, multimodal Qwen3.5 nests it."""
        if arch == DRAFT_ARCH:
            return ""
        nested = any(name.startswith("model.language_model.") for name in self.file_of)
        return "model.language_model." if nested else "model."

    def shape(self, name: str) -> tuple[int, ...]:
        with self._open(self.file_of[name]) as handle:
            return tuple(handle.get_slice(name).get_shape())

    def load(self, name: str) -> torch.Tensor:
        with self._open(self.file_of[name]) as handle:
            return handle.get_tensor(name)

    def check(self, specs: list[TensorSpec], prefix: str) -> None:
        """Every tensor is present with the expected shape, before anything is written."""
        for spec in specs:
            name = hf_name(spec, prefix)
            if name not in self.file_of:
                raise FlashtreeError(f"{self.src}: missing tensor {name!r}")
            if self.shape(name) != hf_shape(spec):
                raise FlashtreeError(
                    f"{self.file_of[name]}: tensor {name!r} has shape {list(self.shape(name))}, "
                    f"config.json implies {list(hf_shape(spec))}"
                )


# --- tensor transforms ------------------------------------------------------------------------------


def rope_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Hugging Face's rotate-half rows -> llama.cpp's interleaved pairs (llama.cpp `permute`).

    Within each head of D rows, rows i and i + D/2 (a RoPE pair in HF) become rows 2i and 2i + 1.
    """
    return w.unflatten(0, (n_heads, 2, -1)).transpose(1, 2).reshape(w.shape)  # (heads, D/2, 2, in)


def tile_v_heads(x: torch.Tensor, dim: int, n_k_heads: int, head_dim: int) -> torch.Tensor:
    """V heads grouped by K head (HF: head kh*r + i) -> tiled (GGUF: head i*n_k_heads + kh) along `dim`."""
    grouped = x.unflatten(dim, (n_k_heads, -1, head_dim))  # (..., n_k, r, head_dim, ...)
    return grouped.transpose(dim, dim + 1).reshape(x.shape)


def _tile_qwen35_v_heads(base: str, x: torch.Tensor, la: LinearAttnConfig) -> torch.Tensor:
    if base in ("attn_qkv.weight", "ssm_conv1d.weight"):  # only the V rows/channels, after [q | k]
        qk = 2 * la.n_k_heads * la.head_k_dim
        return torch.cat([x[:qk], tile_v_heads(x[qk:], 0, la.n_k_heads, la.head_v_dim)])
    if base == "attn_gate.weight":
        return tile_v_heads(x, 0, la.n_k_heads, la.head_v_dim)
    if base in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_dt.bias", "ssm_a"):
        return tile_v_heads(x, 0, la.n_k_heads, 1)
    if base == "ssm_out.weight":  # input columns
        return tile_v_heads(x, 1, la.n_k_heads, la.head_v_dim)
    return x


def _qwen35_tensor(base: str, x: torch.Tensor, la: LinearAttnConfig) -> torch.Tensor:
    if base in ZERO_CENTRED_NORMS:
        return x + 1
    if base == "ssm_a":
        x = -torch.exp(x)
    elif base == "ssm_conv1d.weight":
        x = x.squeeze(1)  # (channels, 1, kernel) -> (channels, kernel)
    if la.n_v_heads != la.n_k_heads:
        x = _tile_qwen35_v_heads(base, x, la)
    return x


def to_gguf(spec: TensorSpec, x: torch.Tensor, shape: ModelConfig) -> torch.Tensor:
    """The GGUF tensor (float32) for checkpoint tensor `x`."""
    x = x.float()  # transforms in f32: +1 on a bf16 norm would round away its low bits
    if shape.arch == "llama" and spec.base == "attn_q.weight":
        return rope_permute(x, shape.n_heads)
    if shape.arch == "llama" and spec.base == "attn_k.weight":
        return rope_permute(x, shape.n_kv_heads)
    if shape.arch == "qwen35":
        return _qwen35_tensor(spec.base, x, shape.linear_attn)
    return x


# --- convert ----------------------------------------------------------------------------------------


def tokenizer_metadata(src: Path, vocab: int) -> dict:
    tokenizer_json, tokenizer_config = src / "tokenizer.json", src / "tokenizer_config.json"
    if not tokenizer_json.is_file():
        log.warning("%s: no tokenizer.json, the GGUF will have no tokenizer", src)
        return {}
    config = tokenizer_config if tokenizer_config.is_file() else None
    return gguf_tokenizer_metadata(tokenizer_json, config, vocab_size=vocab, model_config=src / "config.json")


def check_type(type: str) -> None:
    if type not in FILE_TYPES:
        raise FlashtreeError(f"unknown type {type!r} (choose from {', '.join(RECIPES)})")


def general_metadata(name: str, type: str) -> dict:
    return {
        "general.name": name,
        "general.file_type": FILE_TYPES[type],
        "general.quantization_version": GGML_QUANT_VERSION,
    }


def convert_checkpoint(src: Path, out: Path, type: str, target: Path | None = None) -> None:
    """Convert the Hugging Face checkpoint (or DFlash draft) in directory `src` to GGUF file `out`; a
    draft's tokenizer comes from `target` (its own tokenizer.json when it has one and target is None).
    A draft GGUF `src` (flashtree's older layout) is rewritten in llama.cpp's, its tensors as they are."""
    src, out = Path(src), Path(out)
    if src.is_file():
        tokenizer = None if target is None else target_tokenizer(target)
        out.parent.mkdir(parents=True, exist_ok=True)
        return rewrite_draft(src, out, tokenizer)
    check_type(type)
    shape = ModelConfig.from_hf_config(read_config(src), src / "config.json")
    checkpoint = Checkpoint(src)
    prefix = checkpoint.prefix(shape.arch)
    specs = gguf_tensors(shape)
    checkpoint.check(specs, prefix)
    qtypes = recipe_types(type, [(s.name, s.shape) for s in specs], shape.n_layers)
    general = general_metadata(src.name, type)
    tensors = (
        (s.name, to_gguf(s, checkpoint.load(hf_name(s, prefix)), shape), qtypes[s.name]) for s in specs
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    if shape.arch == DRAFT_ARCH:
        source = target if target is not None else (src if (src / "tokenizer.json").is_file() else None)
        tokenizer = None if source is None else target_tokenizer(source)
        write_draft(out, shape, draft_metadata(shape, general, tokenizer), tensors)
    else:
        metadata = general | shape.gguf_metadata() | tokenizer_metadata(src, shape.vocab)
        write_gguf(out, shape.arch, metadata, tensors)
