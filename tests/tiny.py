"""Tiny random Hugging Face models of each target family, converted to GGUF by `flashtree convert`.

Every parameter is overwritten with non-trivial random values (norm weights, A_log, dt_bias, conv
included): default initializations (ones, zeros, equal heads) would hide a missing +1, a wrong
V-head order or a sign error.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from flashtree.convert.hf import convert_checkpoint

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. 12345 67890",
    "Speculative decoding drafts tokens and the target verifies them in one pass.",
    "Question: what is 7 * 6? Answer: 42. Explain step by step.",
] * 20


def _write_tokenizer(out: Path, vocab: int) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None}
    (out / "tokenizer_config.json").write_text(json.dumps(config))


def _randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g) * 1.5 - 1.0)
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif p.ndim == 1:  # norms: around 1 for plain, around 0 for zero-centred ones
                base = 0.0 if "qwen3_5" in type(model).__module__ and "linear_attn.norm" not in name else 1.0
                p.copy_(base + torch.randn(p.shape, generator=g) * 0.2)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.6 / p.shape[-1] ** 0.5))


def hf_model(family: str, seed: int = 0, vocab: int = 320, head_dim: int | None = None):
    """A tiny random transformers model of `family` (llama | qwen3 | qwen35), fp32, eval mode. head_dim:
    the attention heads' size where not the family's tiny default (32 for the quantized KV types)."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5)  # fmt: skip
    if family == "llama":
        cfg = tf.LlamaConfig(
            **common, num_hidden_layers=2, rope_theta=10000.0, tie_word_embeddings=seed % 2 == 0,
            head_dim=head_dim or 16,
        )  # fmt: skip
        model = tf.LlamaForCausalLM(cfg)
    elif family == "qwen3":
        cfg = tf.Qwen3Config(
            **common, num_hidden_layers=2, head_dim=head_dim or 24, rope_theta=1e6, tie_word_embeddings=False
        )
        model = tf.Qwen3ForCausalLM(cfg)
    elif family == "qwen35":
        cfg = tf.Qwen3_5TextConfig(
            **common, num_hidden_layers=4, head_dim=head_dim or 32, linear_num_key_heads=2,
            linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=12,
            linear_conv_kernel_dim=4,
            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        )  # fmt: skip
        model = tf.Qwen3_5ForCausalLM(cfg)
    else:
        raise ValueError(family)
    _randomize(model, seed)
    return model.eval()


@cache
def tiny_gguf(family: str, seed: int, root: Path, vocab: int = 320, head_dim: int | None = None) -> Path:
    """Convert hf_model(family, seed, vocab, head_dim) to an f32 GGUF under `root` (cached per test
    session). Vocabularies too small for a byte-level BPE get no tokenizer."""
    name = f"{family}-{seed}-{vocab}" + (f"-hd{head_dim}" if head_dim else "")
    src = root / name
    out = root / f"{name}.gguf"
    if not out.exists():
        model = hf_model(family, seed, vocab, head_dim)
        model.save_pretrained(src, safe_serialization=True)
        if vocab >= 300:
            _write_tokenizer(src, vocab)
        convert_checkpoint(src, out, "f32")
    return out
