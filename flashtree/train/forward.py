"""The draft's training forward: many blocks per sequence in one pass, with DFlashDraft's own modules.

At inference a block anchored at position p sees the context K/V of positions < p and its own B
tokens in both directions (DFlashDraft.propose). Training runs N such blocks per sequence at once:
queries are the N * B block tokens, keys are [S context positions | N * B block tokens], and a mask
gives each block exactly what it would see at inference (loss.block_attention_mask). The layer
weights, norms and rotary tables are DFlashDraft's, so training and inference compute the same thing.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from flashtree.convert.draft import draft_metadata, write_draft
from flashtree.convert.hf import general_metadata, hf_name
from flashtree.convert.shapes import gguf_tensors
from flashtree.errors import FlashtreeError
from flashtree.models.attention import Attention
from flashtree.models.config import DraftConfig
from flashtree.models.dflash import DFlashDraft, DraftLayer
from flashtree.models.layers import apply_rotary, rms_norm
from flashtree.models.model import DecoderModel
from flashtree.quant.formats import QT

INIT_STD = 0.02  # random init of every matrix, as SpecForge's drafts (dflash.md §5)


def new_draft(
    shape: DraftConfig,
    target: DecoderModel,
    seed: int,
    from_target: bool = True,
    init: DFlashDraft | None = None,
) -> DFlashDraft:
    """An fp32 draft of `shape` next to `target`, with trainable parameters. From `init`, a trained
    draft of the same shape, when given (training goes on from it); else, with `from_target`, every
    tensor whose shape agrees starts as the target's (target_init_tensors); the rest, and all of them
    without either, start random (matrices) or as the identity (norms)."""
    generator = torch.Generator().manual_seed(seed)
    if init is not None:
        compared = [f.name for f in fields(shape) if f.compare]  # not its name
        differ = [f"{n} {getattr(init.config, n)} (want {getattr(shape, n)})"
                  for n in compared if getattr(init.config, n) != getattr(shape, n)]  # fmt: skip
        if differ:
            raise FlashtreeError(
                f"the draft to start from does not have the shape asked for: {', '.join(differ)}"
            )
        start = {name: t for name, t in draft_tensors(init).items() if t is not None}
    elif from_target:
        start = target_init_tensors(target, shape.n_layers, shape.target_layer_ids)
    else:
        start = {}
    tensors = {}
    for spec in gguf_tensors(shape):
        if spec.name in start and tuple(start[spec.name].shape) == tuple(spec.shape):
            tensors[spec.name] = start[spec.name].detach().float().cpu().clone()
        elif len(spec.shape) == 1:
            tensors[spec.name] = torch.ones(spec.shape)
        else:
            tensors[spec.name] = INIT_STD * torch.randn(spec.shape, generator=generator)
    tensors = {k: v.to(target.device) for k, v in tensors.items()}
    return DFlashDraft(shape, tensors, target).requires_grad_(True)


def target_init_tensors(
    target: DecoderModel, n_layers: int, target_layer_ids: tuple[int, ...]
) -> dict[str, torch.Tensor]:
    """Target weights under the draft's tensor names: draft layer i from the target's layer
    L - n_layers + i, the output norm from the target's. The top layers already turn hidden states into
    next-token states read by the shared LM head, so a draft starting there learns far faster than a
    random one. fc starts by passing the last captured layer's features through (the state those top
    layers read); the other captured layers' weights start at zero and are learned."""
    hidden = target.config.hidden
    n_captured = len(target_layer_ids)
    fc = torch.zeros(hidden, n_captured * hidden)
    fc[:, -hidden:] = torch.eye(hidden)
    tensors = {"output_norm.weight": target.norm.weight, "fc.weight": fc}
    for i, layer in enumerate(target.layers[-n_layers:]):
        parts = {
            "attn_norm": layer.mixer_norm.weight, "ffn_norm": layer.mlp_norm.weight,
            "ffn_gate": layer.mlp.gate.dense_weight(), "ffn_up": layer.mlp.up.dense_weight(),
            "ffn_down": layer.mlp.down.dense_weight(),
        }  # fmt: skip
        mixer = layer.mixer
        if isinstance(mixer, Attention):  # a gated (qwen35) q has another shape and stays random
            parts |= {
                "attn_q": mixer.q.dense_weight(), "attn_k": mixer.k.dense_weight(),
                "attn_v": mixer.v.dense_weight(), "attn_output": mixer.o.dense_weight(),
            }  # fmt: skip
            if mixer.q_norm is not None:
                parts |= {"attn_q_norm": mixer.q_norm, "attn_k_norm": mixer.k_norm}
        tensors |= {f"blk.{i}.{name}.weight": t for name, t in parts.items()}
    return tensors


def draft_tensors(draft: DFlashDraft) -> dict[str, torch.Tensor]:
    """The draft's weights under their GGUF names (the names DFlashDraft is built from)."""
    tensors = {
        "fc.weight": draft.fc.weight,
        "hidden_norm.weight": draft.hidden_norm.weight,
        "output_norm.weight": draft.norm.weight,
    }
    for i, layer in enumerate(draft.layers):
        parts = {
            "attn_norm": layer.attn_norm.weight, "ffn_norm": layer.mlp_norm.weight,
            "attn_q": layer.q.weight, "attn_k": layer.k.weight, "attn_v": layer.v.weight,
            "attn_output": layer.o.weight, "attn_q_norm": layer.q_norm, "attn_k_norm": layer.k_norm,
            "ffn_gate": layer.mlp.gate.weight, "ffn_up": layer.mlp.up.weight,
            "ffn_down": layer.mlp.down.weight,
        }  # fmt: skip
        tensors |= {f"blk.{i}.{name}.weight": t for name, t in parts.items()}
    return tensors


def save_draft(draft: DFlashDraft, out_dir: Path, tokenizer: dict | None = None) -> None:
    """Write the z-lab format: config.json + model.safetensors (matrices bf16, norms fp32); given the
    target's `tokenizer` metadata, also draft.gguf: the same tensors in llama.cpp's layout."""
    tensors = draft_tensors(draft)
    out = {}
    for spec in gguf_tensors(draft.config):
        t = tensors[spec.name].detach().cpu()
        out[spec.name] = t.float() if t.ndim == 1 else t.to(torch.bfloat16)
    out_dir.mkdir(parents=True, exist_ok=True)
    zlab = {hf_name(spec, ""): out[spec.name].contiguous() for spec in gguf_tensors(draft.config)}
    save_file(zlab, out_dir / "model.safetensors")
    config = json.dumps(draft.config.hf_config(), indent=2)
    (out_dir / "config.json").write_text(config + "\n", encoding="utf-8")
    if tokenizer is not None:
        metadata = draft_metadata(draft.config, general_metadata(out_dir.name, "bf16"), tokenizer)
        gguf = ((name, t, QT.F32 if t.ndim == 1 else QT.BF16) for name, t in out.items())
        write_draft(out_dir / "draft.gguf", draft.config, metadata, gguf, progress=False)


def draft_hidden(
    draft: DFlashDraft,
    features: torch.Tensor,  # (b, S, n_feat * H) target features of every position
    block_ids: torch.Tensor,  # (b, N * B) [anchor token, MASK x (B - 1)] per block
    block_pos: torch.Tensor,  # (b, N * B) absolute positions of the block tokens
    mask: torch.Tensor,  # (b, N * B, S + N * B) bool: which keys each block token sees
) -> torch.Tensor:
    """Final-normed draft states of every block token: (b, N * B, H)."""
    b, s, _ = features.shape
    ctx_pos = torch.arange(s, device=features.device).expand(b, s)
    fused = draft.hidden_norm(draft.fc(features.to(draft.dtype)))  # (b, S, H)
    x = draft.target.embed(block_ids).to(draft.dtype)  # (b, Q, H)
    ctx_rope = draft.rotary.cos_sin(ctx_pos.reshape(-1), x.dtype)
    block_rope = draft.rotary.cos_sin(block_pos.reshape(-1), x.dtype)
    for layer in draft.layers:
        layer_mask = mask
        if layer.window is not None:  # sliding layers see the last `window` context positions
            recent = block_pos[:, :, None] - ctx_pos[:, None, :] < layer.window  # (b, Q, S)
            layer_mask = mask & torch.cat(
                [recent, recent.new_ones(b, block_pos.shape[1], block_pos.shape[1])], 2
            )
        x = _layer(layer, x, fused, ctx_rope, block_rope, layer_mask)
    return draft.norm(x)


def _layer(layer: DraftLayer, x, fused, ctx_rope, block_rope, mask) -> torch.Tensor:
    """DraftLayer.forward for a batch of sequences, each with its own context and several blocks."""
    b, q_len, hidden = x.shape
    s = fused.shape[1]
    nh, hd = layer.n_heads, layer.head_dim
    xn = layer.attn_norm(x)
    q = rms_norm(layer.q(xn).view(b * q_len, nh, hd), layer.q_norm, layer.eps)
    q = apply_rotary(q, *block_rope).view(b, q_len, nh, hd)
    ctx_k, ctx_v = layer.keys_values(fused.reshape(b * s, hidden), *ctx_rope)  # (b * S, n_kv, hd)
    blk_k, blk_v = layer.keys_values(xn.reshape(b * q_len, hidden), *block_rope)
    keys = torch.cat([ctx_k.view(b, s, -1, hd), blk_k.view(b, q_len, -1, hd)], dim=1)  # (b, S + Q, n_kv, hd)
    values = torch.cat([ctx_v.view(b, s, -1, hd), blk_v.view(b, q_len, -1, hd)], dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),  # (b, nh, Q, hd)
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask[:, None],  # (b, 1, Q, S + Q)
        scale=hd**-0.5,
        enable_gqa=True,
    )
    h = x + layer.o(out.transpose(1, 2).reshape(b, q_len, nh * hd))
    return h + layer.mlp(layer.mlp_norm(h))
