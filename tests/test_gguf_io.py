"""write_gguf -> GGUFFile round trips, checked independently with gguf-py's own GGUFReader."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf import quants as ref

import flashtree.gguf.writer as writer_module
from flashtree.errors import FlashtreeError
from flashtree.gguf.reader import GGUFFile, TensorInfo, open_gguf
from flashtree.gguf.writer import write_gguf
from flashtree.quant.formats import SUPPORTED_TYPES, row_bytes, type_name
from flashtree.quant.pack import quantize, random_blocks

V = GGUFValueType

# key -> (value given to write_gguf, value read back, GGUF type(s) on disk)
METADATA = {
    "test.count": (7, 7, [V.UINT32]),
    "test.negative": (-7, -7, [V.INT32]),
    "test.huge": (2**40, 2**40, [V.UINT64]),
    "test.float": (0.25, 0.25, [V.FLOAT32]),
    "test.flag": (True, True, [V.BOOL]),
    "test.name": ("héllo ✓", "héllo ✓", [V.STRING]),
    "test.strings": (["a", "", "ü"], ["a", "", "ü"], [V.ARRAY, V.STRING]),
    "test.ints": ([1, -2, 3], [1, -2, 3], [V.ARRAY, V.INT32]),
    "test.floats": ([0.5, -1.0, 2], [0.5, -1.0, 2.0], [V.ARRAY, V.FLOAT32]),
    "test.bools": ([True, False], [True, False], [V.ARRAY, V.BOOL]),
    "test.numpy": (np.arange(3, dtype=np.int64), [0, 1, 2], [V.ARRAY, V.INT32]),
    "test.i8": ((-3, V.INT8), -3, [V.INT8]),
    "test.u16": ((60000, V.UINT16), 60000, [V.UINT16]),
    "test.i64": ((-(2**40), V.INT64), -(2**40), [V.INT64]),
    "test.f64": ((0.1, V.FLOAT64), 0.1, [V.FLOAT64]),
    "test.u8s": (([1, 2, 255], V.UINT8), [1, 2, 255], [V.ARRAY, V.UINT8]),
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """One file with every metadata type and a tensor of every supported type (plus 1-D and 3-D ones)."""
    path = tmp_path_factory.mktemp("gguf") / "all.gguf"
    rng = np.random.default_rng(0)
    tensors = []
    for qtype in sorted(QT(t) for t in SUPPORTED_TYPES):
        if qtype in (QT.Q5_0, QT.Q5_1):  # also exercise already-packed bytes
            tensors.append((f"packed.{qtype.name}", random_blocks(qtype, 4, 512, rng), qtype))
        tensors.append(
            (
                f"float.{qtype.name}",
                torch.randn(4, 512, generator=torch.Generator().manual_seed(int(qtype))),
                qtype,
            )
        )
    tensors += [
        ("norm.weight", np.linspace(-1, 1, 96, dtype=np.float32), QT.F32),
        ("cube.weight", torch.randn(2, 3, 256, dtype=torch.bfloat16), QT.Q8_0),
    ]
    metadata = {key: given for key, (given, _, _) in METADATA.items()}
    write_gguf(path, "testarch", metadata, iter(tensors), progress=False)  # a one-shot generator
    return path, tensors


def expected_packed(array, qtype) -> np.ndarray:
    return array if isinstance(array, np.ndarray) and array.dtype == np.uint8 else quantize(array, qtype)


def test_metadata_round_trips_with_the_intended_gguf_types(written):
    path, _ = written
    g = open_gguf(path)
    assert g.arch == "testarch" and g.get("general.architecture") == "testarch"
    assert list(g.metadata) == ["general.architecture", *METADATA]
    on_disk = GGUFReader(path).fields
    for key, (_, back, types) in METADATA.items():
        assert g.metadata[key] == back, key
        assert on_disk[key].types == types, key
    assert g.metadata["test.f64"] == 0.1 and isinstance(g.metadata["test.flag"], bool)
    # our key/value parser agrees with gguf-py's on every entry
    assert g.metadata == {
        key: field.contents() for key, field in on_disk.items() if not key.startswith("GGUF.")
    }


def test_files_with_custom_alignment_written_by_gguf_py(tmp_path):
    path = tmp_path / "aligned.gguf"
    w = GGUFWriter(path, "llama")
    w.add_custom_alignment(256)
    w.add_tensor("a", np.arange(3, dtype=np.float32))
    w.add_tensor(
        "b", ref.quantize(np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32), QT.Q8_0), raw_dtype=QT.Q8_0
    )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = open_gguf(path)
    assert g.get("general.alignment") == 256
    np.testing.assert_array_equal(g.tensor("a").numpy(), [0, 1, 2])
    expected = ref.dequantize(np.asarray(GGUFReader(path).tensors[1].data), QT.Q8_0)
    np.testing.assert_array_equal(g.tensor("b").numpy(), expected)


def test_tensors_round_trip_in_order_with_shapes_types_and_bytes(written):
    path, tensors = written
    g = open_gguf(path)
    assert list(g.tensors) == [name for name, _, _ in tensors]
    plain = {t.name: t for t in GGUFReader(path).tensors}
    for name, array, qtype in tensors:
        packed = expected_packed(array, qtype)
        shape = tuple(array.shape) if packed is not array else (4, 512)
        info = g.tensors[name]
        assert info == TensorInfo(name, int(qtype), shape, packed.nbytes)
        assert g.has(name)
        raw = g.raw(name)
        assert raw.dtype == np.uint8 and raw.shape == (int(np.prod(shape[:-1])), row_bytes(qtype, shape[-1]))
        np.testing.assert_array_equal(raw, packed.reshape(raw.shape))
        # independent decode of the same bytes by gguf-py: equal to ours bit for bit
        expected = ref.dequantize(np.asarray(plain[name].data).view(np.uint8).reshape(raw.shape), qtype)
        np.testing.assert_array_equal(g.tensor(name).numpy(), expected.reshape(shape))


def test_tensor_dtype_and_device(written):
    g = open_gguf(written[0])
    full = g.tensor("float.Q4_K")
    half = g.tensor("float.Q4_K", dtype=torch.bfloat16, device="cpu")
    assert half.dtype == torch.bfloat16 and torch.equal(half, full.to(torch.bfloat16))


def test_float_sources_survive_within_their_precision(written):
    g = open_gguf(written[0])
    tensors = {name: array for name, array, _ in written[1]}
    assert torch.equal(g.tensor("float.F32"), tensors["float.F32"])
    np.testing.assert_array_equal(g.tensor("norm.weight").numpy(), tensors["norm.weight"])
    # F16/BF16 store the float32 source rounded to nearest even, exactly what torch's casts do
    assert torch.equal(g.tensor("float.F16"), tensors["float.F16"].half().float())
    assert torch.equal(g.tensor("float.BF16"), tensors["float.BF16"].bfloat16().float())


def test_missing_keys_and_tensors_name_the_file(written):
    g = open_gguf(written[0])
    assert g.get("nope", 3) == 3 and g.arch_get("nope", None) is None
    with pytest.raises(FlashtreeError, match=r"all\.gguf: missing metadata key 'testarch\.block_count'"):
        g.arch_get("block_count")
    with pytest.raises(FlashtreeError, match=r"all\.gguf: missing tensor 'output\.weight'"):
        g.tensor("output.weight")
    assert not g.has("output.weight")
    g.close()
    with pytest.raises(FlashtreeError, match="closed"):
        g.raw("norm.weight")


def test_large_tensors_are_quantized_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_module, "_CHUNK_VALUES", 3 * 256)  # several chunks, the last one short
    x = torch.randn(10, 256)
    write_gguf(tmp_path / "c.gguf", "llama", {}, [("w", x, QT.Q4_K)], progress=False)
    np.testing.assert_array_equal(GGUFFile(tmp_path / "c.gguf").raw("w"), quantize(x, QT.Q4_K))


@pytest.mark.parametrize(
    ("metadata", "tensors", "message"),
    [
        ({"k": []}, [], "metadata 'k': empty arrays"),
        ({"k": [1, "a"]}, [], "metadata 'k': arrays must hold"),
        ({"k": {"a": 1}}, [], "metadata 'k': cannot store a dict"),
        ({"general.architecture": "qwen3"}, [], "contradicts arch='llama'"),
        ({"general.alignment": 64}, [], "only 32 is written"),
        ({}, [("w", np.zeros((2, 100), np.uint8), QT.Q4_K)], "tensor 'w': packed rows"),
        ({}, [("w", np.zeros((2, 84), np.uint8), QT.Q2_K)], "tensor 'w': unsupported tensor type Q2_K"),
        (
            {},
            [("w", np.zeros((2, 100), np.float32), QT.Q4_K)],
            "tensor 'w': Q4_K rows must be a multiple of 256",
        ),
        ({}, [("w", np.zeros(4, np.int32), QT.F32)], "tensor 'w': expected float values"),
        ({}, [("w", np.zeros(4, np.float32), QT.F32)] * 2, "tensor 'w' is written twice"),
    ],
)
def test_write_errors_are_flashtree_errors_and_leave_no_files(tmp_path, metadata, tensors, message):
    with pytest.raises(FlashtreeError, match=message):
        write_gguf(tmp_path / "bad.gguf", "llama", metadata, tensors, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_keeps_an_existing_file(tmp_path):
    path = tmp_path / "keep.gguf"
    path.write_bytes(b"old model")
    with pytest.raises(FlashtreeError, match="tensor 'w'"):
        write_gguf(path, "llama", {}, [("w", np.zeros(4, np.int32), QT.F32)], progress=False)
    assert path.read_bytes() == b"old model" and list(tmp_path.iterdir()) == [path]


def test_unwritable_destination(tmp_path):
    with pytest.raises(FlashtreeError, match="cannot write"):
        write_gguf(tmp_path / "missing-dir" / "x.gguf", "llama", {}, [], progress=False)


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.Q8_0], ids=type_name)
def test_random_blocks_written_as_packed_bytes_read_back_identically(tmp_path, qtype):
    blocks = random_blocks(qtype, 8, 512, np.random.default_rng(5))
    write_gguf(tmp_path / "r.gguf", "llama", {}, [("w", blocks, qtype)], progress=False)
    g = open_gguf(tmp_path / "r.gguf")
    assert g.tensors["w"].shape == (8, 512)
    np.testing.assert_array_equal(g.raw("w"), blocks)
