"""`flashtree convert`: tiny random Hugging Face models -> GGUF, read back with gguf-py's GGUFReader.

Every expected GGUF tensor is rebuilt here from the HF tensor with index formulas written independently
of the converter (RoPE row pairs, V-head order), and compared exactly in f32.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize
from safetensors.torch import load_file, save_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from typer.testing import CliRunner

from flashtree.cli import app
from flashtree.convert.hf import convert_checkpoint
from flashtree.convert.synth import tiny_qwen_tokenizer_dir
from flashtree.errors import FlashtreeError

U32, I32, F32, STR = GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.FLOAT32, GGUFValueType.STRING
VOCAB = 1024  # the Qwen3 tokenizer cut to 1024 ids keeps the quantized embeddings small
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter: default inits (ones, zeros, equal heads) would hide layout bugs."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=generator))


def save_hf(model: torch.nn.Module, path) -> dict[str, torch.Tensor]:
    model.save_pretrained(path)
    tokenizer = tiny_qwen_tokenizer_dir(VOCAB)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, path / name)
    return load_file(path / "model.safetensors")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    config = LlamaConfig(
        **COMMON,
        num_hidden_layers=2,
        head_dim=64,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    randomize(model, 1)
    path = tmp_path_factory.mktemp("llama-tiny")
    return path, save_hf(model, path)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    config = Qwen3Config(
        **COMMON,
        num_hidden_layers=2,
        head_dim=128,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    model = Qwen3ForCausalLM(config)
    randomize(model, 2)
    path = tmp_path_factory.mktemp("qwen3-tiny")
    return path, save_hf(model, path)


QWEN35_GDN = dict(n_k=2, n_v=6, dk=32, dv=128)  # 3 V heads per K head, like the 27B (16 -> 48)


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    config = Qwen3_5TextConfig(
        **COMMON,
        num_hidden_layers=4,
        head_dim=64,
        rms_norm_eps=1e-6,
        full_attention_interval=2,
        linear_num_key_heads=2,
        linear_num_value_heads=6,
        linear_key_head_dim=32,
        linear_value_head_dim=128,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
        },
    )
    model = Qwen3_5ForCausalLM(config)
    randomize(model, 3)
    path = tmp_path_factory.mktemp("qwen35-tiny")
    return path, save_hf(model, path)


def read_gguf(path):
    """(metadata {key: (value, [types])}, tensors {name: ReaderTensor})."""
    reader = GGUFReader(path)
    meta = {
        k: (f.contents(), [GGUFValueType(t) for t in f.types])
        for k, f in reader.fields.items()
        if not k.startswith("GGUF.")
    }
    return meta, {t.name: t for t in reader.tensors}


def values(t) -> torch.Tensor:
    """Dequantized tensor in torch order, by gguf-py's numpy reference."""
    torch_shape = tuple(reversed([int(n) for n in t.shape]))
    return torch.from_numpy(np.array(dequantize(t.data, t.tensor_type)).reshape(torch_shape))


def convert(src, tmp_path, type="f32"):
    out = tmp_path / f"{src.name}-{type}.gguf"
    convert_checkpoint(src, out, type)
    return read_gguf(out)


def check_metadata(meta, expected: dict) -> None:
    """The model keys are exactly `expected` (value, type); general.* and tokenizer.* are checked too."""
    model_keys = {k for k in meta if not k.startswith(("general.", "tokenizer."))}
    assert model_keys == set(expected)
    for key, (value, vtype) in expected.items():
        got, types = meta[key]
        if vtype == GGUFValueType.ARRAY:
            assert got == value and types == [GGUFValueType.ARRAY, I32], key
        else:
            assert types == [vtype], key
            assert got == pytest.approx(value, rel=1e-6) if vtype == F32 else got == value, key


def model_keys(arch, layers, ctx=2048, **extra) -> dict:
    keys = {
        "vocab_size": (VOCAB, U32),
        "block_count": (layers, U32),
        "context_length": (ctx, U32),
        "embedding_length": (256, U32),
        "feed_forward_length": (512, U32),
        "attention.head_count": (4, U32),
        "attention.head_count_kv": (2, U32),
    } | extra
    return {f"{arch}.{k}": v for k, v in keys.items()}


def check_general_and_tokenizer(meta, name, file_type) -> None:
    assert meta["general.architecture"][0] in ("llama", "qwen3", "qwen35")
    assert meta["general.name"] == (name, [STR])
    assert meta["general.file_type"] == (file_type, [U32])
    assert meta["general.quantization_version"] == (2, [U32])
    assert meta["tokenizer.ggml.model"][0] == "gpt2"
    assert len(meta["tokenizer.ggml.tokens"][0]) == VOCAB
    assert "<|im_start|>" in meta["tokenizer.chat_template"][0]


# --- exact f32 layouts ------------------------------------------------------------------------------


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's permute: GGUF row h*D + 2i + s holds HF row h*D + s*D/2 + i."""
    D = w.shape[0] // n_heads
    index = [h * D + s * D // 2 + i for h in range(n_heads) for i in range(D // 2) for s in range(2)]
    out = torch.empty_like(w)
    out[index] = w
    return out


def test_llama_f32_layout(llama, tmp_path):
    src, hf = llama
    meta, tensors = convert(src, tmp_path)
    assert meta["general.architecture"][0] == "llama"
    check_general_and_tokenizer(meta, src.name, 0)
    check_metadata(
        meta,
        model_keys(
            "llama",
            2,
            **{
                "attention.key_length": (64, U32),
                "attention.value_length": (64, U32),
                "attention.layer_norm_rms_epsilon": (1e-5, F32),
                "rope.freq_base": (1e4, F32),
                "rope.dimension_count": (64, U32),
            },
        ),
    )
    names = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{n}.weight"
        for i in range(2)
        for n in (
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_norm",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        )
    }
    assert set(tensors) == names  # tied: no output.weight
    for name, t in tensors.items():
        assert QT(t.tensor_type) == QT.F32, name
    assert torch.equal(
        unpermute_rows(values(tensors["blk.1.attn_q.weight"]), 4),
        hf["model.layers.1.self_attn.q_proj.weight"],
    )
    assert torch.equal(
        unpermute_rows(values(tensors["blk.1.attn_k.weight"]), 2),
        hf["model.layers.1.self_attn.k_proj.weight"],
    )
    assert not torch.equal(
        values(tensors["blk.1.attn_q.weight"]), hf["model.layers.1.self_attn.q_proj.weight"]
    )
    plain = {
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "ffn_down": "mlp.down_proj",
    }
    for gguf_name, hf_name in plain.items():
        assert torch.equal(
            values(tensors[f"blk.0.{gguf_name}.weight"]), hf[f"model.layers.0.{hf_name}.weight"]
        )
    assert torch.equal(values(tensors["token_embd.weight"]), hf["model.embed_tokens.weight"])


def test_qwen3_f32_layout(qwen3, tmp_path):
    src, hf = qwen3
    meta, tensors = convert(src, tmp_path)
    assert meta["general.architecture"][0] == "qwen3"
    check_general_and_tokenizer(meta, src.name, 0)
    check_metadata(
        meta,
        model_keys(
            "qwen3",
            2,
            **{
                "attention.key_length": (128, U32),
                "attention.value_length": (128, U32),
                "attention.layer_norm_rms_epsilon": (1e-6, F32),
                "rope.freq_base": (1e6, F32),
                "rope.dimension_count": (128, U32),
            },
        ),
    )
    assert tensors["blk.0.attn_q.weight"].shape.tolist() == [256, 512]  # ne: [in, out], head_dim 128
    pairs = {"output.weight": "lm_head.weight", "output_norm.weight": "model.norm.weight"} | {
        f"blk.{i}.{g}.weight": f"model.layers.{i}.{h}.weight"
        for i in range(2)
        for g, h in {
            "attn_q": "self_attn.q_proj",
            "attn_k": "self_attn.k_proj",
            "attn_q_norm": "self_attn.q_norm",
            "attn_k_norm": "self_attn.k_norm",
            "attn_norm": "input_layernorm",
            "ffn_norm": "post_attention_layernorm",
            "ffn_gate": "mlp.gate_proj",
            "ffn_up": "mlp.up_proj",
        }.items()
    }
    for gguf_name, hf_name in pairs.items():
        # Qwen3's RMSNorm is plain (weight init 1): no +1, and q/k keep HF's row order
        assert torch.equal(values(tensors[gguf_name]), hf[hf_name]), gguf_name


def hf_v_head(j: int, n_k: int, n_v: int) -> int:
    """HF groups V heads by K head (kh*r + i uses K head kh); GGUF tiles them (head j: K head j % n_k)."""
    return (j % n_k) * (n_v // n_k) + j // n_k


def v_rows(head_dim: int, offset: int = 0) -> list[int]:
    g = QWEN35_GDN
    return [
        offset + hf_v_head(j, g["n_k"], g["n_v"]) * head_dim + d
        for j in range(g["n_v"])
        for d in range(head_dim)
    ]


def expected_qwen35(hf: dict[str, torch.Tensor], prefix: str, layer: int) -> dict[str, torch.Tensor]:
    g = QWEN35_GDN
    p = f"{prefix}layers.{layer}."
    out = {
        "attn_norm.weight": hf[p + "input_layernorm.weight"] + 1,
        "post_attention_norm.weight": hf[p + "post_attention_layernorm.weight"] + 1,
        "ffn_down.weight": hf[p + "mlp.down_proj.weight"],
    }
    if layer % 2 == 1:  # full attention (interval 2): q keeps its per-head [q | gate] rows
        return out | {
            "attn_q.weight": hf[p + "self_attn.q_proj.weight"],
            "attn_k.weight": hf[p + "self_attn.k_proj.weight"],
            "attn_q_norm.weight": hf[p + "self_attn.q_norm.weight"] + 1,
            "attn_k_norm.weight": hf[p + "self_attn.k_norm.weight"] + 1,
        }
    la = p + "linear_attn."
    qk = 2 * g["n_k"] * g["dk"]
    conv = hf[la + "conv1d.weight"][:, 0, :]
    return out | {
        "attn_qkv.weight": hf[la + "in_proj_qkv.weight"][list(range(qk)) + v_rows(g["dv"], qk)],
        "ssm_conv1d.weight": conv[list(range(qk)) + v_rows(g["dv"], qk)],
        "attn_gate.weight": hf[la + "in_proj_z.weight"][v_rows(g["dv"])],
        "ssm_beta.weight": hf[la + "in_proj_b.weight"][v_rows(1)],
        "ssm_alpha.weight": hf[la + "in_proj_a.weight"][v_rows(1)],
        "ssm_dt.bias": hf[la + "dt_bias"][v_rows(1)],
        "ssm_a": -torch.exp(hf[la + "A_log"][v_rows(1)]),
        "ssm_norm.weight": hf[la + "norm.weight"],  # gated norm: plain weight, no +1
        "ssm_out.weight": hf[la + "out_proj.weight"][:, v_rows(g["dv"])],
    }


QWEN35_KEYS = model_keys(
    "qwen35",
    4,
    **{
        "attention.key_length": (64, U32),
        "attention.value_length": (64, U32),
        "attention.layer_norm_rms_epsilon": (1e-6, F32),
        "rope.freq_base": (1e7, F32),
        "rope.dimension_count": (16, U32),
        "rope.dimension_sections": ([3, 3, 2, 0], GGUFValueType.ARRAY),
        "full_attention_interval": (2, U32),
        "ssm.conv_kernel": (4, U32),
        "ssm.state_size": (32, U32),
        "ssm.group_count": (2, U32),
        "ssm.time_step_rank": (6, U32),
        "ssm.inner_size": (768, U32),
    },
)


def check_qwen35(meta, tensors, hf, prefix):
    assert meta["general.architecture"][0] == "qwen35"
    check_metadata(meta, QWEN35_KEYS)
    assert torch.equal(values(tensors["output_norm.weight"]), hf[prefix + "norm.weight"] + 1)
    assert torch.equal(values(tensors["output.weight"]), hf["lm_head.weight"])
    assert tensors["blk.0.ssm_conv1d.weight"].shape.tolist() == [4, 2 * 2 * 32 + 768]
    for layer in range(4):
        for base, expected in expected_qwen35(hf, prefix, layer).items():
            assert torch.equal(values(tensors[f"blk.{layer}.{base}"]), expected), (layer, base)
    n_per_layer = [len([n for n in tensors if n.startswith(f"blk.{i}.")]) for i in range(4)]
    assert n_per_layer == [14, 11, 14, 11]  # GDN: 9 mixer tensors; gated attention: 6; plus 5 norm/MLP


def test_qwen35_f32_layout(qwen35, tmp_path):
    src, hf = qwen35
    meta, tensors = convert(src, tmp_path)
    check_general_and_tokenizer(meta, src.name, 0)
    check_qwen35(meta, tensors, hf, "model.")


def test_qwen35_conditional_generation_checkpoint(qwen35, tmp_path):
    """The multimodal checkpoint: text config nested, language model under model.language_model.,
    vision tower and MTP head present but skipped."""
    src, hf = qwen35
    nested = tmp_path / "qwen35-vl"
    nested.mkdir()
    text_config = json.loads((src / "config.json").read_text())
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text_config,
        "vision_config": {"depth": 1},
        "tie_word_embeddings": False,
    }
    (nested / "config.json").write_text(json.dumps(config))
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in hf.items()}
    extra = {
        "model.visual.patch_embed.proj.weight": torch.zeros(8, 3),
        "mtp.fc.weight": torch.zeros(256, 512),
    }
    save_file(dict(list(renamed.items())[:40]) | extra, nested / "model-00001-of-00002.safetensors")
    save_file(dict(list(renamed.items())[40:]), nested / "model-00002-of-00002.safetensors")
    meta, tensors = convert(nested, tmp_path)
    check_qwen35(meta, tensors, hf, "model.")
    assert not any("mtp" in n or "visual" in n or "nextn" in n for n in tensors)


# --- other output types -----------------------------------------------------------------------------

# Bound on the rms of (dequantized - f32) relative to the tensor's rms, per GGML type. Measured on
# Gaussian weights: F16 2e-4, BF16 1.7e-3, Q8_0 5.4e-3, Q6_K 0.018, Q4_K 0.072.
RMS_TOLERANCE = {QT.F16: 5e-4, QT.BF16: 4e-3, QT.Q8_0: 0.01, QT.Q6_K: 0.035, QT.Q4_K: 0.12}


@pytest.mark.parametrize("type,file_type", [("f16", 1), ("bf16", 32), ("q8_0", 7), ("q4_k_m", 15)])
def test_qwen35_types(qwen35, tmp_path, type, file_type):
    src, _ = qwen35
    _, reference = convert(src, tmp_path, "f32")
    meta, tensors = convert(src, tmp_path, type)
    assert meta["general.file_type"] == (file_type, [U32])
    assert list(tensors) == list(reference)
    kinds = {}
    for name, t in tensors.items():
        qtype, expected = QT(t.tensor_type), values(reference[name])
        if expected.ndim == 1 or "ssm_conv1d" in name:
            assert qtype == QT.F32, name  # norms, ssm_a, dt bias and the conv stay F32 in every type
            assert torch.equal(values(t), expected), name
            continue
        kinds.setdefault(qtype, []).append(name)
        rms = expected.pow(2).mean().sqrt()
        assert (values(t) - expected).pow(2).mean().sqrt() <= RMS_TOLERANCE[qtype] * rms, (name, qtype.name)
    plain = {"f16": QT.F16, "bf16": QT.BF16, "q8_0": QT.Q8_0}
    if type in plain:
        assert set(kinds) == {plain[type]}
        return
    # llama.cpp's Q4_K_M: output Q6_K; attn_qkv and ffn_down Q6_K on use_more_bits layers (here 2 and 3
    # of 4 layers / the 2nd of 2 attn_qkv), else Q4_K
    assert tensors["output.weight"].tensor_type == QT.Q6_K
    assert [QT(tensors[f"blk.{i}.ffn_down.weight"].tensor_type) for i in range(4)] == [QT.Q4_K] * 2 + [
        QT.Q6_K
    ] * 2
    assert [QT(tensors[f"blk.{i}.attn_qkv.weight"].tensor_type) for i in (0, 2)] == [QT.Q4_K, QT.Q6_K]
    for name in ("token_embd.weight", "blk.1.attn_q.weight", "blk.1.attn_v.weight", "blk.0.ssm_out.weight"):
        assert tensors[name].tensor_type == QT.Q4_K, name


# --- DFlash drafts ----------------------------------------------------------------------------------

DRAFT_CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "model_type": "qwen3",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1e6,
    "max_position_embeddings": 4096,
    "vocab_size": VOCAB,
    "tie_word_embeddings": False,
    "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window": 2048,
    "block_size": 16,
    "num_target_layers": 8,
    "dflash_config": {"mask_token_id": VOCAB - 1, "target_layer_ids": [1, 5]},
}


def zlab_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    w = lambda *shape: torch.randn(shape, generator=g).to(torch.bfloat16)  # noqa: E731
    n = lambda size: torch.randn(size, generator=g)  # noqa: E731 - norms stay F32 in z-lab files
    tensors = {"fc.weight": w(256, 512), "hidden_norm.weight": n(256), "norm.weight": n(256)}
    for i in range(2):
        p = f"layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": n(256),
            p + "post_attention_layernorm.weight": n(256),
            p + "self_attn.q_proj.weight": w(256, 256),
            p + "self_attn.k_proj.weight": w(128, 256),
            p + "self_attn.v_proj.weight": w(128, 256),
            p + "self_attn.o_proj.weight": w(256, 256),
            p + "self_attn.q_norm.weight": n(64),
            p + "self_attn.k_norm.weight": n(64),
            p + "mlp.gate_proj.weight": w(512, 256),
            p + "mlp.up_proj.weight": w(512, 256),
            p + "mlp.down_proj.weight": w(256, 512),
        }
    return tensors


def test_dflash_draft(tmp_path):
    """llama.cpp's layout (its convert_hf_to_gguf.py DFlashModel): arch `dflash`, target_layers = z-lab's
    target_layer_ids + 1, the mask token as tokenizer.ggml.mask_token_id, sliding layers as a bool
    pattern, hidden_norm as enc.output_norm; no tokenizer without a target to take it from."""
    src = tmp_path / "draft"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(DRAFT_CONFIG))
    hf = zlab_tensors()
    save_file(hf, src / "model.safetensors")
    meta, tensors = convert(src, tmp_path)
    assert meta["general.architecture"] == ("dflash", [STR])
    a = "dflash."
    expected = {
        "vocab_size": (VOCAB, U32),
        "block_count": (2, U32),
        "context_length": (4096, U32),
        "embedding_length": (256, U32),
        "feed_forward_length": (512, U32),
        "attention.head_count": (4, U32),
        "attention.head_count_kv": (2, U32),
        "attention.key_length": (64, U32),
        "attention.value_length": (64, U32),
        "attention.layer_norm_rms_epsilon": (1e-6, F32),
        "rope.freq_base": (1e6, F32),
        "rope.dimension_count": (64, U32),
        "block_size": (16, U32),
        "target_layers": ([2, 6], GGUFValueType.ARRAY),
        "attention.sliding_window": (2048, U32),
    }
    pattern = a + "attention.sliding_window_pattern"
    check_metadata({k: v for k, v in meta.items() if k != pattern}, {a + k: v for k, v in expected.items()})
    assert meta[pattern] == ([True, False], [GGUFValueType.ARRAY, GGUFValueType.BOOL])
    assert [k for k in meta if k.startswith("tokenizer.")] == ["tokenizer.ggml.mask_token_id"]
    assert meta["tokenizer.ggml.mask_token_id"] == (VOCAB - 1, [U32])
    renames = {
        "fc.weight": "fc.weight",
        "enc.output_norm.weight": "hidden_norm.weight",
        "output_norm.weight": "norm.weight",
    }
    renames |= {
        f"blk.{i}.{g}.weight": f"layers.{i}.{h}.weight"
        for i in range(2)
        for g, h in {
            "attn_norm": "input_layernorm",
            "ffn_norm": "post_attention_layernorm",
            "attn_q": "self_attn.q_proj",
            "attn_k": "self_attn.k_proj",
            "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj",
            "attn_q_norm": "self_attn.q_norm",
            "attn_k_norm": "self_attn.k_norm",
            "ffn_gate": "mlp.gate_proj",
            "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj",
        }.items()
    }
    assert set(tensors) == set(renames)
    for gguf_name, hf_name in renames.items():  # no permutation, no +1
        assert torch.equal(values(tensors[gguf_name]), hf[hf_name].float()), gguf_name
    assert tensors["fc.weight"].shape.tolist() == [512, 256]


# --- bad inputs -------------------------------------------------------------------------------------


def error_of(src, tmp_path, type="f32") -> str:
    with pytest.raises(FlashtreeError) as info:
        convert_checkpoint(src, tmp_path / "out.gguf", type)
    message = str(info.value)
    assert "\n" not in message
    assert not (tmp_path / "out.gguf").exists()
    return message


def test_missing_config(tmp_path):
    src = tmp_path / "empty"
    src.mkdir()
    assert error_of(src, tmp_path) == f"{src}: no config.json, not a Hugging Face checkpoint directory"


def test_unknown_architecture(tmp_path):
    src = tmp_path / "gpt2"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    assert "unsupported architecture GPT2LMHeadModel" in error_of(src, tmp_path)


def test_unknown_type(llama, tmp_path):
    assert "unknown type 'q3_k'" in error_of(llama[0], tmp_path, "q3_k")


def test_quantized_checkpoint(llama, tmp_path):
    src = tmp_path / "fp8"
    shutil.copytree(llama[0], src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"quantization_config": {"quant_method": "fp8"}}))
    assert "quantized checkpoints are not supported" in error_of(src, tmp_path)


def test_missing_tensor(llama, tmp_path):
    src = tmp_path / "broken"
    shutil.copytree(llama[0], src)
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, src / "model.safetensors")
    assert error_of(src, tmp_path) == f"{src}: missing tensor 'model.layers.1.mlp.up_proj.weight'"


def test_wrong_tensor_shape(llama, tmp_path):
    src = tmp_path / "reshaped"
    shutil.copytree(llama[0], src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"intermediate_size": 768}))
    assert (
        "'model.layers.0.mlp.gate_proj.weight' has shape [512, 256], config.json implies [768, 256]"
        in error_of(src, tmp_path)
    )


def test_cli_error_is_one_line(tmp_path):
    result = CliRunner().invoke(app, ["convert", str(tmp_path), str(tmp_path / "out.gguf"), "--type", "f16"])
    assert result.exit_code == 1
    assert (
        result.output.strip() == f"error: {tmp_path}: no config.json, not a Hugging Face checkpoint directory"
    )
    assert "Traceback" not in result.output
