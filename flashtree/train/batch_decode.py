"""Batched decoding of thousands of prompts at once: the responses the draft trainer learns from.

Why not transformers' `generate`: its dynamic cache copies every layer's whole KV cache at each step,
grouped-query attention repeats K/V heads, and finished rows keep running until the longest one ends
(bench/results/h200-batch-decode-2026-12-03). This loop runs the same transformers modules (their
projections, norms, MLPs and RoPE frequencies; RoPE itself is ours, layers.apply_rotary) with
- one preallocated KV cache per layer, written in place, attention reading only the slots filled so far;
- grouped-query attention without repeating K/V (models.layers.grouped_attention);
- finished rows dropped from the batch (cache included) once they are a quarter of it.
It serves attention-only decoders (llama, qwen3); `supports` says whether a model is one.
"""

from __future__ import annotations

import torch

from flashtree.config import SamplingParams
from flashtree.engine.sampling import filter_logits
from flashtree.models.layers import apply_rotary, grouped_attention

SLOT_ALIGN = 16  # attention reads cache slots in multiples of this (aligned masks for the fused kernels)


def supports(hf_model) -> bool:
    """Every decoder layer is plain softmax attention (no linear attention / DeltaNet layers)."""
    return all(hasattr(layer, "self_attn") for layer in hf_model.model.layers)


class _Batch:
    """The rows still decoding: their KV caches (one (rows, kv_heads, slots, head_dim) pair per layer),
    which slots hold real tokens (not left padding) and each row's index in the original batch."""

    def __init__(self, hf_model, n_rows: int, n_slots: int, device, dtype):
        c = hf_model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        shape = (n_rows, c.num_key_value_heads, n_slots, head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in hf_model.model.layers]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in hf_model.model.layers]
        self.real = torch.zeros(n_rows, n_slots, dtype=torch.bool, device=device)
        self.rows = torch.arange(n_rows, device=device)
        self.filled = 0  # slots written so far (the same for every row: prompts are left-padded)

    def keep(self, active: torch.Tensor) -> None:
        """Drop the rows where `active` is False."""
        idx = active.nonzero().squeeze(1)
        self.keys = [k.index_select(0, idx) for k in self.keys]
        self.values = [v.index_select(0, idx) for v in self.values]
        self.real, self.rows = self.real[idx], self.rows[idx]


def _attention(attn, x, cos, sin, batch: _Batch, layer: int, mask) -> torch.Tensor:
    b, t, _ = x.shape
    head_dim = attn.head_dim
    q = attn.q_proj(x).view(b, t, -1, head_dim)
    k = attn.k_proj(x).view(b, t, -1, head_dim)
    if hasattr(attn, "q_norm"):  # qwen3: per-head norms before RoPE
        q, k = attn.q_norm(q), attn.k_norm(k)
    rope = [c.reshape(b * t, head_dim) for c in (cos, sin)]  # transformers' cos/sin: (b, t, head_dim)
    q, k = (apply_rotary(y.reshape(b * t, -1, head_dim), *rope).view(b, t, -1, head_dim) for y in (q, k))
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    v = attn.v_proj(x).view(b, t, -1, head_dim).transpose(1, 2)
    first, end = batch.filled, batch.filled + t
    batch.keys[layer][:, :, first:end] = k
    batch.values[layer][:, :, first:end] = v
    read = mask.shape[-1]
    keys, values = batch.keys[layer][:, :, :read], batch.values[layer][:, :, :read]
    out = grouped_attention(q, keys, values, mask, attn.scaling)  # (b, heads, t, d)
    return attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def _forward(hf_model, ids: torch.Tensor, positions: torch.Tensor, batch: _Batch) -> torch.Tensor:
    """Run tokens `ids` (b, t) into the next t slots; the logits of each row's last token (b, V)."""
    model = hf_model.model
    t = ids.shape[1]
    first = batch.filled
    read = -(-(first + t) // SLOT_ALIGN) * SLOT_ALIGN
    slots = torch.arange(read, device=ids.device)
    query_slots = torch.arange(first, first + t, device=ids.device)
    # A token sees the real tokens at or before its slot, and always itself (a padding slot too: its
    # row must not be empty, or attention would put NaN into the cache).
    sees = (slots[None, None] <= query_slots[None, :, None]) & batch.real[:, None, :read]
    sees |= slots[None, None] == query_slots[None, :, None]
    x = model.embed_tokens(ids)
    cos, sin = model.rotary_emb(x, positions)
    for i, layer in enumerate(model.layers):
        x = x + _attention(layer.self_attn, layer.input_layernorm(x), cos, sin, batch, i, sees)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    batch.filled += t
    return hf_model.lm_head(model.norm(x[:, -1]))


def _choose(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    if params.greedy:
        return logits.argmax(-1)
    probs = filter_logits(logits, params).softmax(-1)
    return torch.multinomial(probs, 1).squeeze(1)  # torch's generator: rows draw independently


@torch.no_grad()
def decode_batch(
    hf_model,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_ids: list[int],
    params: SamplingParams,
    compact_at: float = 0.25,
) -> list[list[int]]:
    """Each prompt's response: up to and including its first stop token, or max_new_tokens tokens."""
    device = hf_model.device
    dtype = hf_model.model.embed_tokens.weight.dtype
    n, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((n, width), stop_ids[0], dtype=torch.long)
    real = torch.zeros(n, width, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        real[i, width - len(p) :] = True
    ids, real = ids.to(device), real.to(device)
    n_slots = -(-(width + max_new_tokens) // SLOT_ALIGN) * SLOT_ALIGN
    batch = _Batch(hf_model, n, n_slots, device, dtype)
    batch.real[:, :width] = real
    positions = (real.long().cumsum(1) - 1).clamp(min=0)
    logits = _forward(hf_model, ids, positions, batch)
    next_pos = positions[:, -1] + 1
    stops = torch.tensor(stop_ids, device=device)
    out = torch.full((n, max_new_tokens), -1, dtype=torch.long, device=device)
    alive = torch.ones(n, dtype=torch.bool, device=device)  # no stop token yet
    for step in range(max_new_tokens):
        token = _choose(logits.float(), params)
        out[batch.rows, step] = token  # rows past their stop write on: cut below
        alive &= ~torch.isin(token, stops)
        if step == max_new_tokens - 1 or not bool(alive.any()):
            break
        if int(alive.sum()) <= (1 - compact_at) * alive.numel():
            batch.keep(alive)
            token, next_pos, alive = token[alive], next_pos[alive], alive[alive]
        batch.real[:, batch.filled] = True
        logits = _forward(hf_model, token[:, None], next_pos[:, None], batch)
        next_pos = next_pos + 1
    return [cut_at_stop([t for t in row if t >= 0], stop_ids) for row in out.tolist()]


def cut_at_stop(tokens: list[int], stop_ids: list[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: i + 1]
    return tokens
