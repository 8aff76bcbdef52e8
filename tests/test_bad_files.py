"""Broken GGUF files: each gives one FlashtreeError naming the file, and `flashtree inspect` exits non-zero
with a one-line `error:` message and no traceback. The same for a device the machine does not have and a
config.json with values out of range (tests/test_fuzz_gguf.py corrupts whole model files)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter
from typer.testing import CliRunner

from flashtree.cli import app
from flashtree.errors import FlashtreeError
from flashtree.gguf.reader import open_gguf
from flashtree.gguf.writer import write_gguf
from flashtree.models.config import ModelConfig
from flashtree.models.loader import resolve_device


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> bytes:
    """Bytes of a small valid GGUF: a few metadata keys and two tensors."""
    path = tmp_path_factory.mktemp("good") / "good.gguf"
    metadata = {"llama.block_count": 1, "tokenizer.ggml.tokens": ["a", "b", "c"]}
    tensors = [
        ("token_embd.weight", np.ones((3, 64), np.float32), QT.Q8_0),
        ("norm", np.ones(64, np.float32), QT.F32),
    ]
    write_gguf(path, "llama", metadata, tensors, progress=False)
    return path.read_bytes()


def _tensor_type_offset(data: bytes, name: str, n_dims: int) -> int:
    """Offset of the u32 type field in `name`'s tensor-info record: after name, n_dims and the dims."""
    encoded = name.encode()
    start = data.index(struct.pack("<Q", len(encoded)) + encoded)
    return start + 8 + len(encoded) + 4 + 8 * n_dims


def _kv_type_offset(data: bytes, key: str) -> int:
    encoded = key.encode()
    return data.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)


def _with(data: bytes, offset: int, packed: bytes) -> bytes:
    return data[:offset] + packed + data[offset + len(packed) :]


def _gguf_with_tensor_type(tmp_path, qtype: QT) -> bytes:
    """A GGUF holding one tensor of a type flashtree cannot decode, written by gguf-py itself."""
    path = tmp_path / "q2k.gguf"
    w = GGUFWriter(path, "llama")
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((2, 84), np.uint8), raw_dtype=qtype)  # 84 B = one Q2_K block
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def _random(n: int) -> bytes:
    return np.random.default_rng(0).bytes(n)


def _tokens_type_at(data: bytes) -> int:
    return _kv_type_offset(data, "tokenizer.ggml.tokens")


def _embd_type_at(data: bytes) -> int:
    return _tensor_type_offset(data, "token_embd.weight", 2)


def _norm_offset_at(data: bytes) -> int:
    """Offset of the u64 data offset in the `norm` tensor's record (it follows the u32 type)."""
    return _tensor_type_offset(data, "norm", 1) + 4


# case -> (build(good bytes, tmp dir) -> file bytes, or None for no file; regex the error must match)
BROKEN = {
    "missing": (lambda g, d: None, "file not found"),
    "empty": (lambda g, d: b"", "empty file"),
    "short": (lambda g, d: b"GG", "truncated file"),
    "wrong_magic": (lambda g, d: b"PK\x03\x04" + g[4:], "not a GGUF file"),
    "random_bytes": (lambda g, d: _random(4096), "not a GGUF file"),
    "bad_version": (lambda g, d: _with(g, 4, struct.pack("<I", 99)), "corrupted GGUF header.*version 99"),
    "truncated_header": (lambda g, d: g[:40], "truncated or corrupted header"),
    "truncated_in_tensor_table": (lambda g, d: g[: _embd_type_at(g) + 2], "truncated or corrupted header"),
    "truncated_tensor_data": (lambda g, d: g[:-100], "truncated file: tensor data needs"),
    "corrupted_after_magic": (lambda g, d: g[:8] + _random(len(g) - 8), "truncated or corrupted header"),
    "bad_value_type": (
        lambda g, d: _with(g, _tokens_type_at(g), struct.pack("<I", 77)),
        "corrupted GGUF header",
    ),
    "huge_array_length": (
        lambda g, d: _with(g, _tokens_type_at(g) + 8, struct.pack("<Q", 2**62)),
        "truncated or corrupted header",
    ),
    "unknown_tensor_type": (
        lambda g, d: _with(g, _embd_type_at(g), struct.pack("<I", 99)),
        r"'token_embd.weight' has unsupported type unknown \(99\)",
    ),
    "zero_dimensions": (
        lambda g, d: _with(g, _tensor_type_offset(g, "norm", 1) - 12, struct.pack("<I", 0)),
        "corrupted GGUF header.*tensor 'norm' has 0 dimensions",
    ),
    "unsupported_tensor_type": (
        lambda g, d: _gguf_with_tensor_type(d, QT.Q2_K),
        "'blk.0.ffn_up.weight' has unsupported type Q2_K",
    ),
    # the tensor table must lay the data out as writers do: in the file, no overlap, no gap, zero padding
    "tensor_offset_overflow": (
        lambda g, d: _with(g, _norm_offset_at(g), struct.pack("<Q", 2**64 - 32)),
        r"tensor 'norm': data offset 18446744073709551584 is past the end of the file",
    ),
    "misaligned_tensor_offset": (
        lambda g, d: _with(g, _norm_offset_at(g), struct.pack("<Q", 225)),
        "'norm': data offset 225 is not a multiple of the alignment 32",
    ),
    "overlapping_tensors": (
        lambda g, d: _with(g, _norm_offset_at(g), struct.pack("<Q", 0)),
        "tensor 'norm' overlaps tensor 'token_embd.weight'",
    ),
    "shrunk_tensor_type": (  # Q8_0 -> Q4_0: the embedding no longer fills its bytes
        lambda g, d: _with(g, _embd_type_at(g), struct.pack("<I", QT.Q4_0)),
        "non-zero padding after tensor 'token_embd.weight': a corrupted type or shape",
    ),
    "trailing_bytes": (lambda g, d: g + b"\x01" * 40, "40 bytes after the last tensor"),
    "invalid_utf8_key": (
        lambda g, d: g.replace(b"llama.block_count", b"llama.block_c\xffunt"),
        "corrupted GGUF header",
    ),
}


def _materialize(case: str, good: bytes, tmp_path):
    build, message = BROKEN[case]
    content = build(good, tmp_path)
    path = tmp_path / f"{case}.gguf"
    if content is not None:
        path.write_bytes(content)
    return path, message


@pytest.mark.parametrize("case", BROKEN)
def test_open_raises_one_line_flashtree_error_naming_the_file(case, good, tmp_path):
    path, message = _materialize(case, good, tmp_path)
    with pytest.raises(FlashtreeError, match=message) as caught:
        open_gguf(path)
    text = str(caught.value)
    assert text.startswith(f"{path}: ") and "\n" not in text


@pytest.mark.parametrize("case", BROKEN)
def test_inspect_exits_nonzero_with_a_one_line_error(case, good, tmp_path):
    path, _ = _materialize(case, good, tmp_path)
    result = CliRunner().invoke(app, ["inspect", str(path)])
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.startswith(f"error: {path}: ") and result.stderr.count("\n") == 1
    assert "Traceback" not in result.output


def test_a_corrupted_key_name_is_refused_not_dropped(good, tmp_path):
    """general.alignment with one byte flipped would silently fall back to the default alignment."""
    path = tmp_path / "key.gguf"
    path.write_bytes(good)
    g = open_gguf(path)
    assert g.metadata.path == path  # tokenizer errors name the file through it
    path.write_bytes(good.replace(b"llama.block_count", b"general.alignmenu"))
    with pytest.raises(FlashtreeError, match="'general.alignmenu' is one byte away from 'general.alignment'"):
        open_gguf(path)


def test_directory_is_not_a_gguf(tmp_path):
    with pytest.raises(FlashtreeError, match="is a directory"):
        open_gguf(tmp_path)


def test_the_good_file_opens(good, tmp_path):
    (tmp_path / "good.gguf").write_bytes(good)
    g = open_gguf(tmp_path / "good.gguf")
    assert g.tensor("token_embd.weight").shape == (3, 64) and g.get("llama.block_count") == 1


def test_a_device_the_machine_lacks_is_a_one_line_error(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(None) == resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(FlashtreeError, match="'cuda:1': this machine has no CUDA GPU"):
        resolve_device("cuda:1")
    with pytest.raises(FlashtreeError, match="unknown device 'gpu'"):
        resolve_device("gpu")
    args = ["train-draft", "--target", str(tmp_path / "t.gguf"), "--out", str(tmp_path), "--steps", "1"]
    result = CliRunner().invoke(app, [*args, "--device", "cuda"])
    assert result.exit_code == 1 and "error: device 'cuda': this machine has no CUDA GPU" in result.output
    assert "Traceback" not in result.output


LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320, "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5, "rope_theta": 1e4,
}  # fmt: skip


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(num_attention_heads=0), r"n_heads \(attention.head_count\) is 0, not an integer >= 1"),
        (dict(num_attention_heads=5), "5 attention heads do not split into 2 KV heads"),
        (
            dict(num_hidden_layers=10**9),
            r"n_layers \(block_count\) is 1000000000, not an integer in \[1, 1024\]",
        ),
        (dict(rms_norm_eps=float("nan")), r"rms_eps .* is nan, not a finite number"),
        (dict(rope_theta=0.0), r"rope_theta .* is 0.0, not a finite number in \(1, 1e\+12\]"),
        (dict(max_position_embeddings=0), r"context_length .* is 0"),
    ],
)
def test_a_config_json_with_values_out_of_range_is_one_error(change, message, tmp_path):
    with pytest.raises(FlashtreeError, match=message) as caught:
        ModelConfig.from_hf_config(LLAMA_CONFIG | change, tmp_path / "config.json")
    assert str(caught.value).startswith(f"{tmp_path / 'config.json'}: ")
    assert ModelConfig.from_hf_config(LLAMA_CONFIG, tmp_path / "config.json").n_heads == 4
