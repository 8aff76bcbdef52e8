"""Open a GGUF file: metadata as plain Python, a tensor table, memory-mapped data, torch dequantization.

gguf-py's `GGUFReader` parses the header and tensor table and maps the data. It was written for
well-formed files: on a truncated or corrupted one it raises assorted exceptions, or loops for a long time
over a garbage array length. `_CheckedReader` bounds-checks every read and checks that the tensor table
lays the data out as writers do (each tensor inside the file, aligned, no overlap, no gap, zero padding),
so that no corrupted offset, shape or type makes a tensor read other bytes; `GGUFFile` turns each failure
into one `FlashtreeError` naming the file. The key/value section is parsed by `_KVParser` instead: gguf-py
builds several numpy views per array item, which takes ~20 s for a 250k-token vocabulary.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField

from flashtree.errors import FlashtreeError
from flashtree.quant.formats import SUPPORTED_TYPES, block_size, row_bytes, type_name

if TYPE_CHECKING:
    import torch

_MISSING: Any = object()
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset
_MAX_DIMS = 4  # GGML_MAX_DIMS


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: int  # gguf.GGMLQuantizationType value
    shape: tuple[int, ...]  # torch order = reversed GGUF ne
    nbytes: int


class Metadata(dict):
    """A GGUF's key/values as plain Python values, and the file they came from (`path`, for messages)."""

    def __init__(self, values: dict[str, Any], path: Path | None = None):
        super().__init__(values)
        self.path = path


def check_key_names(metadata: dict[str, Any], known: Iterable[str], source: Path | str | None) -> None:
    """Refuse a key that is one byte away from a key flashtree reads and the file lacks: a corrupted key
    name, which would otherwise drop a value silently (its default would be used instead)."""
    known = set(known)
    missing: dict[int, list[bytes]] = {}
    for key in known - metadata.keys():
        missing.setdefault(len(key.encode()), []).append(key.encode())
    for key in metadata.keys() - known:
        encoded = key.encode()
        for near in missing.get(len(encoded), ()):
            if sum(a != b for a, b in zip(encoded, near, strict=True)) == 1:
                prefix = f"{source}: " if source else ""
                raise FlashtreeError(
                    f"{prefix}metadata key {key!r} is one byte away from {near.decode()!r}, which is missing:"
                    " a corrupted key name"
                )


class _PastEnd(Exception):
    """A read that would go past the end of the file."""

    def __init__(self, offset: int, size: int, in_tensor_data: bool = False):
        super().__init__(offset, size)
        self.offset, self.size, self.in_tensor_data = offset, size, in_tensor_data


class _Unsupported(Exception):
    """A well-formed file that flashtree cannot use; the message says why."""


class _Corrupt(Exception):
    """A header whose values contradict one another; the message says which."""


_SCALARS = {
    GGUFValueType.UINT8: struct.Struct("<B"),
    GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"),
    GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: struct.Struct("<I"),
    GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"),
    GGUFValueType.BOOL: struct.Struct("<?"),
    GGUFValueType.UINT64: struct.Struct("<Q"),
    GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}


class _KVParser:
    """Reads little-endian GGUF values as plain Python, checking every length against the file size."""

    def __init__(self, buf: memoryview, offset: int):
        self.buf, self.offset = buf, offset

    def _take(self, n_bytes: int) -> int:
        """Advance past n_bytes; returns where they start."""
        start, end = self.offset, self.offset + n_bytes
        if end > len(self.buf):
            raise _PastEnd(end, len(self.buf))
        self.offset = end
        return start

    def scalar(self, vtype: GGUFValueType) -> Any:
        fmt = _SCALARS[vtype]
        return fmt.unpack_from(self.buf, self._take(fmt.size))[0]

    def string(self) -> str:
        n_bytes = self.scalar(GGUFValueType.UINT64)
        start = self._take(n_bytes)
        return str(self.buf[start : start + n_bytes], "utf-8")

    def value(self, vtype: int) -> Any:
        vtype = GGUFValueType(vtype)  # ValueError for a type number GGUF does not define
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            return self.array()
        return self.scalar(vtype)

    def array(self) -> list[Any]:
        item_type = GGUFValueType(self.scalar(GGUFValueType.UINT32))
        count = self.scalar(GGUFValueType.UINT64)
        if item_type in _SCALARS:  # fixed-size items: one vectorized read
            dtype = np.dtype(_SCALARS[item_type].format)
            start = self._take(count * dtype.itemsize)
            return np.frombuffer(self.buf, dtype, count, start).tolist()
        if count * 8 > len(self.buf) - self.offset:  # strings and arrays start with an 8-byte length
            raise _PastEnd(self.offset + count * 8, len(self.buf))
        if item_type == GGUFValueType.STRING:
            return [self.string() for _ in range(count)]
        return [self.value(item_type) for _ in range(count)]


class _CheckedReader(GGUFReader):
    """GGUFReader that refuses reads past the end of the file and counts that cannot fit in it.

    Overrides gguf-py's private helpers (`_get`, `_build_fields`, `_build_tensor_info`, `_build_tensors`),
    which have kept their signatures across gguf 0.1x releases.
    """

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > len(self.data):
            raise _PastEnd(end, len(self.data))
        return super()._get(offset, dtype, count, override_order)

    def _check_count(self, offset: int, count: int, min_item_bytes: int) -> None:
        if int(count) * min_item_bytes > len(self.data) - offset:
            raise _PastEnd(offset + int(count) * min_item_bytes, len(self.data))

    def _build_fields(self, offs: int, count: int) -> int:
        """Parse the key/values into `self.kv` (plain Python values); returns the offset after them."""
        if self.byte_order != "I":
            raise _Unsupported("big-endian GGUF files are not supported")
        self._check_count(offs, count, 8 + 4 + 1)  # key length, value type, at least one value byte
        parser = _KVParser(memoryview(self.data), offs)
        self.kv: dict[str, Any] = {}
        for _ in range(count):
            key = parser.string()
            if key in self.kv:
                raise ValueError(f"duplicate key {key!r}")
            self.kv[key] = parser.value(parser.scalar(GGUFValueType.UINT32))
        # gguf-py would read this from its own fields, which we no longer build
        self.alignment = self.kv.get("general.alignment", self.alignment)
        if (
            not isinstance(self.alignment, int)
            or self.alignment <= 0
            or self.alignment & (self.alignment - 1)
        ):
            raise ValueError(f"general.alignment {self.alignment!r} is not a power of two")
        return parser.offset

    def _build_tensor_info(self, offs: int, count: int) -> tuple[int, list[ReaderField]]:
        self._check_count(offs, count, _MIN_TENSOR_INFO_BYTES)
        return super()._build_tensor_info(offs, count)

    def _build_tensors(self, start_offs: int, fields: list[ReaderField]) -> None:
        """Check every tensor's record and byte range (Python ints: gguf-py's uint64 sums wrap) before
        gguf-py maps them."""
        spans = sorted(_tensor_span(field, start_offs, self.alignment) for field in fields)
        _check_spans(spans, start_offs, self.alignment, self.data)
        try:
            super()._build_tensors(start_offs, fields)
        except _PastEnd as e:
            raise _PastEnd(e.offset, e.size, in_tensor_data=True) from None


def _tensor_span(field: ReaderField, data_start: int, alignment: int) -> tuple[int, int, str]:
    """(start, end, name): where one tensor-table record puts its data in the file."""
    name = str(bytes(field.parts[1]), "utf-8")
    n_dims, dims = int(field.parts[2][0]), [int(d) for d in field.parts[3]]
    qtype, offset = int(field.parts[4][0]), int(field.parts[5][0])
    if not 1 <= n_dims <= _MAX_DIMS:
        raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
    if qtype not in SUPPORTED_TYPES:
        raise _Unsupported(f"tensor {name!r} has unsupported type {type_name(qtype)}")
    if min(dims) < 1:
        raise _Corrupt(f"tensor {name!r} has a dimension of 0 (shape {dims[::-1]})")
    if dims[0] % block_size(qtype):
        raise _Corrupt(f"tensor {name!r}: {type_name(qtype)} rows of {dims[0]} values are not whole blocks")
    if offset % alignment:
        raise _Corrupt(
            f"tensor {name!r}: data offset {offset} is not a multiple of the alignment {alignment}"
        )
    start = data_start + offset
    return start, start + math.prod(dims[1:]) * row_bytes(qtype, dims[0]), name


def _check_spans(
    spans: list[tuple[int, int, str]], data_start: int, alignment: int, data: np.ndarray
) -> None:
    """Tensors (sorted by start) must lie in the file and follow one another as writers lay them out:
    each at the first aligned offset after the previous one, zeros in between and after the last. An
    overlap, a gap or non-zero padding means a corrupted offset, shape or type."""
    for start, end, name in spans:
        if start > len(data):
            offset = start - data_start
            raise _Corrupt(
                f"tensor {name!r}: data offset {offset} is past the end of the file ({len(data)} bytes)"
            )
        if end > len(data):  # the first tensor that does not fit begins inside the file: a cut-off download
            raise _PastEnd(end, len(data), in_tensor_data=True)
    expected, previous = data_start, "the start of the data section"
    for start, end, name in spans:
        if start < expected:
            raise _Corrupt(f"tensor {name!r} overlaps {previous} (data offset {start - data_start})")
        if start > expected:
            gap = start - expected
            raise _Corrupt(
                f"{gap} unused bytes between {previous} and tensor {name!r}: a corrupted offset or size"
            )
        expected, previous = end + -end % alignment, f"tensor {name!r}"
        if data[end:expected].any():
            raise _Corrupt(f"non-zero padding after tensor {name!r}: a corrupted type or shape")
    if spans and len(data) > expected:
        raise _Corrupt(
            f"{len(data) - expected} bytes after the last tensor: a corrupted type, shape or offset"
        )


def _open_reader(path: Path) -> GGUFReader:
    """Parse the file, translating every way it can fail into a FlashtreeError naming it."""
    if not path.exists():
        raise FlashtreeError(f"{path}: file not found")
    if path.is_dir():
        raise FlashtreeError(f"{path}: is a directory, not a GGUF file")
    size = path.stat().st_size
    if size == 0:
        raise FlashtreeError(f"{path}: empty file, not a GGUF file")
    with path.open("rb") as f:
        magic = f.read(4)
    if len(magic) < 4 and b"GGUF".startswith(magic):
        raise FlashtreeError(f"{path}: truncated file: {size} bytes, shorter than the GGUF header")
    if magic != b"GGUF":
        raise FlashtreeError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    try:
        # copy-on-write mapping: torch gets writable arrays without warnings, the file is never modified
        return _CheckedReader(path, mode="c")
    except _PastEnd as e:
        problem = "truncated file: tensor data" if e.in_tensor_data else "truncated or corrupted header: it"
        raise FlashtreeError(f"{path}: {problem} needs {e.offset} bytes but the file has {e.size}") from None
    except _Unsupported as e:
        raise FlashtreeError(f"{path}: {e}") from None
    except _Corrupt as e:
        raise FlashtreeError(f"{path}: corrupted GGUF header: {e}") from None
    except OSError as e:
        raise FlashtreeError(f"{path}: cannot read: {e.strerror or e}") from None
    except Exception as e:  # whatever else gguf-py raises while parsing means the bytes are not valid GGUF
        raise FlashtreeError(f"{path}: corrupted GGUF header ({type(e).__name__}: {e})") from None


class GGUFFile:
    """A memory-mapped GGUF: `metadata`, `tensors` (file order) and dequantized `tensor(name)`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._reader = _open_reader(self.path)
        self.metadata = Metadata(self._reader.kv, self.path)
        check_key_names(self.metadata, ("general.architecture", "general.alignment"), self.path)
        self.tensors: dict[str, TensorInfo] = {
            t.name: TensorInfo(t.name, int(t.tensor_type), tuple(reversed(t.shape.tolist())), int(t.n_bytes))
            for t in self._reader.tensors
        }
        self._offsets = {t.name: int(t.data_offset) for t in self._reader.tensors}
        self.arch: str = self.get("general.architecture")
        if not isinstance(self.arch, str):
            raise FlashtreeError(f"{self.path}: general.architecture is not a string")

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """Metadata value of `key`; without a default a missing key is a FlashtreeError."""
        if key in self.metadata:
            return self.metadata[key]
        if default is _MISSING:
            raise FlashtreeError(f"{self.path}: missing metadata key {key!r}")
        return default

    def arch_get(self, suffix: str, default: Any = _MISSING) -> Any:
        """`get(f"{arch}.{suffix}")`, e.g. arch_get("block_count")."""
        return self.get(f"{self.arch}.{suffix}", default)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        if self._reader is None:
            raise FlashtreeError(f"{self.path}: file is closed")
        if name not in self.tensors:
            raise FlashtreeError(f"{self.path}: missing tensor {name!r}")
        return self.tensors[name]

    def raw(self, name: str) -> np.ndarray:
        """The packed bytes of tensor `name`: a uint8 memmap view (rows, bytes_per_row), nothing copied."""
        info = self.info(name)
        offset = self._offsets[name]
        n_rows = math.prod(info.shape[:-1])
        bytes_per_row = row_bytes(info.qtype, info.shape[-1])
        return self._reader.data[offset : offset + info.nbytes].reshape(n_rows, bytes_per_row)

    def tensor(
        self, name: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
    ) -> torch.Tensor:
        """Tensor `name` dequantized to `dtype` (default float32) on `device` (the packed bytes are moved,
        then decoded). torch is imported here: reading a header (inspect, models) does without it."""
        import torch

        from flashtree.quant.dequant import dequantize

        dtype = torch.float32 if dtype is None else dtype
        info = self.info(name)
        raw = torch.from_numpy(self.raw(name)).to(device)  # (rows, bytes_per_row) uint8
        return dequantize(raw, info.qtype, info.shape, dtype)

    def close(self) -> None:
        """Drop the mapping; views returned by raw() keep their own reference and stay valid."""
        self._reader = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, arch={self.arch!r}, tensors={len(self.tensors)})"


def open_gguf(path: str | Path) -> GGUFFile:
    return GGUFFile(path)
