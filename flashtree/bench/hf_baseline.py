"""The peer row of `flashtree bench --baseline hf`: Hugging Face transformers greedy decoding on the
same dequantized weights as our loaded target.

`hf_model_from` rebuilds a transformers model (LlamaForCausalLM, Qwen3ForCausalLM, Qwen3_5ForCausalLM)
from a `DecoderModel`, undoing what our loading did to the GGUF tensors:
- llama: Q/K rows were already un-permuted at load, so the tensors map one to one;
- qwen3: one to one, q/k norms included;
- qwen35: the zero-centred norms carry +1 that Qwen3_5RMSNorm adds itself (subtract it), ssm_a is
  -exp(A_log), and the GGUF tiles V heads over K heads where HF groups them (inverse of the
  converter's `tile_v_heads`).
Dense tensors are handed over without a copy where no transform is needed, in the target's dtype;
quantized layers (the CUDA QuantLinear) are decoded from their blocks by `dense_weight`.
"""

from __future__ import annotations

import time

import torch

from flashtree.engine.generate import GenerationStats
from flashtree.errors import FlashtreeError
from flashtree.models.attention import Attention
from flashtree.models.deltanet import GatedDeltaNet
from flashtree.models.model import DecoderModel


def group_v_heads(x: torch.Tensor, dim: int, n_k_heads: int, head_dim: int) -> torch.Tensor:
    """V heads tiled over K heads (GGUF: head i*n_k_heads + kh) -> grouped by K head (HF: kh*r + i)."""
    tiled = x.unflatten(dim, (-1, n_k_heads, head_dim))  # (..., r, n_k, head_dim, ...)
    return tiled.transpose(dim, dim + 1).reshape(x.shape)


def _attention(a: Attention, norm_offset: float, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    tensors = {
        "q_proj.weight": a.q.dense_weight(dtype),  # qwen35: per head [q_h | gate_h], as HF packs it too
        "k_proj.weight": a.k.dense_weight(dtype),
        "v_proj.weight": a.v.dense_weight(dtype),
        "o_proj.weight": a.o.dense_weight(dtype),
    }
    if a.q_norm is not None:
        tensors |= {"q_norm.weight": a.q_norm - norm_offset, "k_norm.weight": a.k_norm - norm_offset}
    return {f"self_attn.{k}": v for k, v in tensors.items()}


def _deltanet(m: GatedDeltaNet, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    nk, kd, vd = m.n_k_heads, m.k_dim, m.v_dim

    def heads(x: torch.Tensor, head_dim: int, dim: int = 0) -> torch.Tensor:
        return group_v_heads(x, dim, nk, head_dim)

    def qkv(x: torch.Tensor) -> torch.Tensor:  # only the V rows/channels, after [q | k], are tiled
        return torch.cat([x[: 2 * nk * kd], heads(x[2 * nk * kd :], vd)])

    tensors = {
        "in_proj_qkv.weight": qkv(m.qkv.dense_weight(dtype)),
        "conv1d.weight": qkv(m.conv_weight).unsqueeze(1),  # (channels, 1, kernel)
        "in_proj_z.weight": heads(m.z.dense_weight(dtype), vd),
        "in_proj_b.weight": heads(m.beta.dense_weight(dtype), 1),
        "in_proj_a.weight": heads(m.alpha.dense_weight(dtype), 1),
        "dt_bias": heads(m.dt_bias, 1),
        "A_log": heads(torch.log(-m.ssm_a), 1),
        "norm.weight": m.norm_weight,  # the gated norm is plain in both
        "out_proj.weight": heads(m.out.dense_weight(dtype), vd, dim=1),
    }
    return {f"linear_attn.{k}": v for k, v in tensors.items()}


def hf_state_dict(target: DecoderModel) -> dict[str, torch.Tensor]:
    """The transformers state dict of `target`'s weights, in its dtype."""
    offset = 1.0 if target.config.arch == "qwen35" else 0.0
    dtype = target.dtype
    state = {
        "model.embed_tokens.weight": target.embedding,
        "model.norm.weight": target.norm.weight - offset,
        "lm_head.weight": target.lm_head.dense_weight(dtype),
    }
    for i, layer in enumerate(target.layers):
        m = layer.mixer
        mixer = _attention(m, offset, dtype) if isinstance(m, Attention) else _deltanet(m, dtype)
        tensors = {
            "input_layernorm.weight": layer.mixer_norm.weight - offset,
            "post_attention_layernorm.weight": layer.mlp_norm.weight - offset,
            "mlp.gate_proj.weight": layer.mlp.gate.dense_weight(dtype),
            "mlp.up_proj.weight": layer.mlp.up.dense_weight(dtype),
            "mlp.down_proj.weight": layer.mlp.down.dense_weight(dtype),
            **mixer,
        }
        state |= {f"model.layers.{i}.{k}": v for k, v in tensors.items()}
    return {k: v.detach().to(dtype) for k, v in state.items()}


def hf_config(target: DecoderModel):
    """(transformers model class, its config) for `target`'s architecture."""
    import transformers as tf

    c = target.config
    common = dict(
        vocab_size=c.vocab,
        hidden_size=c.hidden,
        intermediate_size=c.ffn,
        num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.context_length,
        rms_norm_eps=c.rms_eps,
        tie_word_embeddings=c.tied_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
    )
    if c.arch == "llama":
        return tf.LlamaForCausalLM, tf.LlamaConfig(**common)
    if c.arch == "qwen3":
        return tf.Qwen3ForCausalLM, tf.Qwen3Config(**common)
    if c.arch == "qwen35":
        common["rope_parameters"]["partial_rotary_factor"] = c.rope_dim / c.head_dim
        config = tf.Qwen3_5TextConfig(
            **common,
            layer_types=list(c.layer_types),  # Hugging Face's names
            linear_num_key_heads=c.linear_attn.n_k_heads,
            linear_num_value_heads=c.linear_attn.n_v_heads,
            linear_key_head_dim=c.linear_attn.head_k_dim,
            linear_value_head_dim=c.linear_attn.head_v_dim,
            linear_conv_kernel_dim=c.linear_attn.conv_kernel,
        )
        return tf.Qwen3_5ForCausalLM, config
    raise FlashtreeError(f"--baseline hf: no transformers model for architecture {c.arch!r}")


def hf_model_from(target: DecoderModel):
    """A transformers causal LM (eval mode, on the target's device) computing with `target`'s weights."""
    try:
        cls, config = hf_config(target)
    except ImportError as e:
        raise FlashtreeError(f"--baseline hf needs transformers (pip install transformers): {e}") from None
    with torch.device("meta"):  # no random init: every weight comes from the target
        model = cls(config)
    model.load_state_dict(hf_state_dict(target), strict=True, assign=True)
    # RoPE frequencies are non-persistent buffers: take ours (they include any rope_freqs scaling).
    inv_freq = target.rotary.inv_freq
    for module in model.modules():
        if hasattr(module, "inv_freq"):
            module.inv_freq = inv_freq.clone()
            if hasattr(module, "original_inv_freq"):
                module.original_inv_freq = inv_freq.clone()
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise FlashtreeError(f"--baseline hf: no weights for {', '.join(left[:5])}")
    return model.eval()


class _TokenClock:
    """A transformers streamer that timestamps the prompt (first `put`) and every new token."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        value.tolist()  # wait for the device, so the timestamp is when the token exists
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFBaseline:
    """Greedy decoding with transformers' `generate`: a static KV cache (and its auto-compile) on GPU."""

    mode = "hf"

    def __init__(self, target: DecoderModel, stop_ids, max_ctx: int):
        self.model = hf_model_from(target)
        self.stop_ids = sorted(stop_ids)
        self.max_ctx = max_ctx
        # transformers keeps a static cache as large as the largest call so far: after a warm-up on the
        # longest prompt, later prompts neither reallocate it nor recompile the decode step.
        self.static = target.device.type == "cuda"

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], GenerationStats]:
        ids = torch.tensor([prompt_ids], device=self.model.device)
        budget = min(max_tokens, self.max_ctx - len(prompt_ids))
        clock = _TokenClock()
        t0 = time.perf_counter()
        out = self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=budget,
            do_sample=False,
            eos_token_id=self.stop_ids,
            pad_token_id=self.stop_ids[0] if self.stop_ids else 0,
            streamer=clock,
            cache_implementation="static" if self.static else None,
        )
        tokens = out[0, len(prompt_ids) :].tolist()
        stats = GenerationStats(self.mode, n_prompt=len(prompt_ids), n_generated=len(tokens))
        first, last = clock.times[1], clock.times[-1]  # times[0] is the prompt
        stats.prefill_s, stats.decode_s = first - t0, last - first
        for _ in tokens[1:]:
            stats.record_step(1)
        return tokens, stats
