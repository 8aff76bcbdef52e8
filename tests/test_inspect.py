"""`flashtree inspect` on small GGUFs written for the purpose: JSON content, bytes per token, tables."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from typer.testing import CliRunner

from flashtree.cli import app
from flashtree.convert.inspect import describe
from flashtree.gguf.reader import open_gguf
from flashtree.gguf.writer import write_gguf
from flashtree.quant.formats import row_bytes
from flashtree.quant.pack import random_blocks

HIDDEN, FFN, VOCAB, N_LAYERS = 256, 512, 300, 8  # + one MTP (nextn) block, index 8

TOKENIZER = {
    "tokenizer.ggml.model": "gpt2",
    "tokenizer.ggml.pre": "qwen35",
    "tokenizer.ggml.tokens": [f"t{i}" for i in range(VOCAB)],
    "tokenizer.ggml.token_type": [1] * VOCAB,
    "tokenizer.ggml.merges": ["t 1", "t 2"],
    "tokenizer.ggml.bos_token_id": 1,
    "tokenizer.ggml.eos_token_id": 2,
    "tokenizer.chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
}
QWEN35_KEYS = {
    "qwen35.block_count": N_LAYERS + 1,
    "qwen35.nextn_predict_layers": 1,
    "qwen35.context_length": 4096,
    "qwen35.embedding_length": HIDDEN,
    "qwen35.feed_forward_length": FFN,
    "qwen35.attention.head_count": 4,
    "qwen35.attention.head_count_kv": 2,
    "qwen35.attention.key_length": 64,
    "qwen35.attention.value_length": 64,
    "qwen35.attention.layer_norm_rms_epsilon": 1e-6,
    "qwen35.rope.freq_base": 1e7,
    "qwen35.rope.dimension_count": 16,
    "qwen35.full_attention_interval": 4,
    "qwen35.ssm.conv_kernel": 4,
    "qwen35.ssm.state_size": 32,
    "qwen35.ssm.group_count": 2,
    "qwen35.ssm.time_step_rank": 4,
    "qwen35.ssm.inner_size": 128,
    "general.file_type": 15,
    "general.name": "tiny hybrid",
}


def _layer(i: int) -> list[tuple[str, tuple[int, ...], QT]]:
    if (i + 1) % 4 == 0:
        mixer = [
            ("attn_q", (512, HIDDEN), QT.Q4_K),
            ("attn_v", (128, HIDDEN), QT.Q6_K),
            ("attn_q_norm", (64,), QT.F32),
        ]
    else:
        mixer = [
            ("attn_qkv", (256, HIDDEN), QT.Q6_K),
            ("ssm_conv1d", (256, 4), QT.F32),
            ("ssm_a", (4,), QT.F32),
        ]
    common = [
        ("attn_norm", (HIDDEN,), QT.F32),
        ("ffn_up", (FFN, HIDDEN), QT.Q4_K),
        ("ffn_down", (HIDDEN, FFN), QT.Q8_0),
    ]
    return [
        (f"blk.{i}.{base}" + ("" if base == "ssm_a" else ".weight"), shape, qt)
        for base, shape, qt in mixer + common
    ]


def _write(path, tied: bool) -> None:
    layout = [("token_embd.weight", (VOCAB, HIDDEN), QT.Q4_K)]
    for i in range(N_LAYERS + 1):
        layout += _layer(i)
    layout.append(("output_norm.weight", (HIDDEN,), QT.F32))
    if not tied:
        layout.append(("output.weight", (VOCAB, HIDDEN), QT.Q6_K))
    rng = np.random.default_rng(0)
    # contents do not matter here: random packed blocks are quick to make
    tensors = (
        (name, random_blocks(qtype, math.prod(shape[:-1]), shape[-1], rng).reshape(*shape[:-1], -1), qtype)
        for name, shape, qtype in layout
    )
    write_gguf(path, "qwen35", {**QWEN35_KEYS, **TOKENIZER}, tensors, progress=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("inspect")
    _write(root / "untied.gguf", tied=False)
    _write(root / "tied.gguf", tied=True)
    return root / "untied.gguf", root / "tied.gguf"


def _nbytes(qtype: QT, shape: tuple[int, ...]) -> int:
    return int(np.prod(shape[:-1])) * row_bytes(qtype, shape[-1])


def test_describe_reports_dimensions_pattern_tokenizer(files):
    info = describe(open_gguf(files[0]))
    assert (
        info["architecture"] == "qwen35" and info["name"] == "tiny hybrid" and info["file_type"] == "Q4_K_M"
    )
    assert info["dimensions"] == {
        "embedding": HIDDEN,
        "layers": N_LAYERS + 1,
        "heads": 4,
        "kv_heads": 2,
        "head_dim_k": 64,
        "head_dim_v": 64,
        "ffn": FFN,
        "context": 4096,
        "rope_dims": 16,
        "rope_freq_base": 1e7,
        "rms_eps": pytest.approx(1e-6),
        "vocab": VOCAB,
        "ssm": {"conv_kernel": 4, "state_size": 32, "group_count": 2, "time_step_rank": 4, "inner_size": 128},
    }
    # the MTP block (index 8) is not part of the trunk
    assert info["layer_pattern"] == {
        "kind": "hybrid",
        "full_attention_interval": 4,
        "full_attention_layers": [3, 7],
        "deltanet_layers": [0, 1, 2, 4, 5, 6],
    }
    assert info["tokenizer"] == {
        "model": "gpt2",
        "pre": "qwen35",
        "size": VOCAB,
        "merges": 2,
        "bos_id": 1,
        "eos_id": 2,
    }
    assert info["chat_template"] is True and info["tied_embeddings"] is False
    assert info["file_bytes"] == files[0].stat().st_size


def test_tensor_types_and_bytes_per_token(files):
    g = open_gguf(files[0])
    info = describe(g)
    n_blocks = N_LAYERS + 1
    q4k = (
        _nbytes(QT.Q4_K, (VOCAB, HIDDEN))
        + 2 * _nbytes(QT.Q4_K, (512, HIDDEN))
        + n_blocks * _nbytes(QT.Q4_K, (FFN, HIDDEN))
    )
    assert info["tensor_types"]["Q4_K"] == {"count": 1 + 2 + n_blocks, "bytes": q4k}
    assert info["tensor_types"]["Q8_0"] == {
        "count": n_blocks,
        "bytes": n_blocks * _nbytes(QT.Q8_0, (HIDDEN, FFN)),
    }
    assert sum(t["count"] for t in info["tensor_types"].values()) == info["n_tensors"] == len(g.tensors)
    assert list(info["tensor_types"]) == sorted(
        info["tensor_types"], key=lambda k: -info["tensor_types"][k]["bytes"]
    )
    assert info["parameters"] == sum(int(np.prod(t.shape)) for t in g.tensors.values())
    # every weight is read once per token, except the token_embd row lookup and the MTP block
    mtp = sum(t.nbytes for name, t in g.tensors.items() if name.startswith("blk.8."))
    total = sum(t.nbytes for t in g.tensors.values())
    assert mtp > 0
    assert info["bytes_per_token"] == total - g.tensors["token_embd.weight"].nbytes - mtp


def test_tied_embeddings_are_read_as_the_lm_head(files):
    g = open_gguf(files[1])
    info = describe(g)
    mtp = sum(t.nbytes for name, t in g.tensors.items() if name.startswith("blk.8."))
    assert info["tied_embeddings"] is True
    assert info["bytes_per_token"] == sum(t.nbytes for t in g.tensors.values()) - mtp


def test_cli_json_is_one_object_equal_to_describe(files):
    result = CliRunner().invoke(app, ["inspect", str(files[0]), "--json"])
    assert result.exit_code == 0, result.output
    assert result.stdout.count("\n") == 1
    assert json.loads(result.stdout) == json.loads(json.dumps(describe(open_gguf(files[0]))))


def test_cli_tables_for_humans(files):
    result = CliRunner().invoke(app, ["inspect", str(files[0])], terminal_width=200)
    assert result.exit_code == 0, result.output
    for text in (
        "qwen35 (tiny hybrid)",
        "6 DeltaNet + 2 full attention",
        "gpt2 / qwen35, 300 tokens",
        "bytes read per token",
        "Q4_K",
        "chat template",
        "│ 1e-06 ",  # rms_eps without float32 noise
    ):
        assert text in result.stdout, text


def test_plain_transformer_pattern(tmp_path):
    metadata = {"llama.block_count": 2, "llama.embedding_length": 64}
    tensors = [(f"blk.{i}.attn_q.weight", np.ones((64, 64), np.float32), QT.F16) for i in range(2)]
    write_gguf(tmp_path / "l.gguf", "llama", metadata, tensors, progress=False)
    info = describe(open_gguf(tmp_path / "l.gguf"))
    assert info["layer_pattern"] == {"kind": "attention", "layers": 2}
    assert info["tokenizer"] == {} and info["chat_template"] is False
    assert info["bytes_per_token"] == 2 * 64 * 64 * 2


def test_a_draft_shows_its_block_target_layers_and_mask_token():
    """The shipped draft: its DFlash values as the loader reads them, and a tokenizer line without '?'."""
    from flashtree.defaults import default_draft_path
    from flashtree.models.config import ModelConfig

    path = default_draft_path()
    with open_gguf(path) as g:
        info, cfg = describe(g), ModelConfig.from_gguf(g)
    assert info["draft"] == {
        "block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": list(cfg.target_layer_ids), "n_target_layers": cfg.n_target_layers,
    }  # fmt: skip
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (16, 49151, (1, 8, 14, 20, 27))
    rows = {}
    for line in CliRunner().invoke(app, ["inspect", str(path)]).output.splitlines():
        cells = [c.strip() for c in line.split("│") if c.strip()]
        if len(cells) == 2:
            rows[cells[0]] = cells[1]
    assert (rows["block size"], rows["mask token"]) == ("16", "id 49151 (of the target's vocabulary)")
    assert rows["target layers"].startswith("1, 8, 14, 20, 27") and "?" not in rows["tokenizer"]


def test_a_draft_without_a_tokenizer_says_it_uses_the_targets():
    from flashtree.convert.inspect import _tokenizer_text

    assert _tokenizer_text({}, draft=True) == "none: a draft uses its target's"
    assert _tokenizer_text({}, draft=False) == "none"
    assert (
        _tokenizer_text({"model": "gpt2", "pre": "smollm", "size": 5}, draft=True)
        == "gpt2 / smollm, 5 tokens"
    )
