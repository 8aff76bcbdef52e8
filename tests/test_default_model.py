"""The embedded default target (real SmolLM2-135M-Instruct) against transformers on the same weights.

The transformers model is built independently of our loader: gguf-py reads and dequantizes the
GGUF, and llama.cpp's Q/K row permutation is undone here with its own formula.
"""

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from flashtree.defaults import default_target_path
from flashtree.engine.generate import Engine
from flashtree.gguf.tokenizer import Tokenizer
from flashtree.models.loader import load_target

N_NEW = 24


def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's convert-time `permute`, which stores each head's rows as (half, pair)."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def hf_smollm2():
    import transformers as tf

    reader = GGUFReader(default_target_path())
    meta = {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("GGUF.")}
    weights = {t.name: dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
               for t in reader.tensors}  # fmt: skip
    heads, kv_heads = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    cfg = tf.LlamaConfig(
        vocab_size=weights["token_embd.weight"].shape[0], hidden_size=meta["llama.embedding_length"],
        intermediate_size=meta["llama.feed_forward_length"], num_hidden_layers=meta["llama.block_count"],
        num_attention_heads=heads, num_key_value_heads=kv_heads,
        rms_norm_eps=meta["llama.attention.layer_norm_rms_epsilon"], rope_theta=meta["llama.rope.freq_base"],
        max_position_embeddings=meta["llama.context_length"], tie_word_embeddings=True,
    )  # fmt: skip
    names = {
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    }  # fmt: skip
    state = {
        "model.embed_tokens.weight": weights["token_embd.weight"],
        "model.norm.weight": weights["output_norm.weight"],
    }
    for i in range(cfg.num_hidden_layers):
        for g, h in names.items():
            w = weights[f"blk.{i}.{g}.weight"]
            if g in ("attn_q", "attn_k"):
                w = unpermute(w, heads if g == "attn_q" else kv_heads)
            state[f"model.layers.{i}.{h}.weight"] = w
    model = tf.LlamaForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(
        {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in state.items()}, strict=False
    )
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    model.tie_weights()
    return model.eval()


@pytest.fixture(scope="module")
def engine():
    target, gguf = load_target(default_target_path(), device="cpu", dtype=torch.float32)
    return Engine(target, Tokenizer.from_gguf_metadata(gguf.metadata), max_ctx=512)


@pytest.mark.parametrize("chat", [True, False], ids=["chat-template", "raw"])
@pytest.mark.parametrize("prompt", ["What is the capital of France?", "def fibonacci(n):"])
def test_default_model_greedy_equals_transformers(engine, hf_smollm2, prompt, chat):
    ids = engine.encode(prompt, chat=chat)
    ours = [t for step in engine.generate(ids, N_NEW) for t in step]
    eos = sorted(engine.tokenizer.stop_ids)
    with torch.no_grad():
        out = hf_smollm2.generate(
            torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False, eos_token_id=eos, pad_token_id=eos[0]
        )
    ref = out[0, len(ids) :].tolist()
    assert ours == ref
    if chat and "France" in prompt:
        assert "Paris" in engine.tokenizer.decode(ours)
