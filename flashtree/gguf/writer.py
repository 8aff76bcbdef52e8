"""Write a GGUF file: typed metadata plus tensors, quantized on the way, streamed to disk.

GGUF puts the tensor table (names, shapes, types, offsets) before the data, but a tensor's size is only
known once it has been produced. To stream tensors without holding them in memory, `write_gguf` writes
each one to a side file as it arrives, then writes the header and tensor table with gguf-py's
`GGUFWriter` and appends the side file. Peak disk use is about twice the model size.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from gguf import GGUF_DEFAULT_ALIGNMENT, GGUFValueType, GGUFWriter
from tqdm import tqdm

from flashtree.errors import FlashtreeError
from flashtree.quant.formats import QT, block_bytes, block_size, check_supported, type_name
from flashtree.quant.pack import quantize

_CHUNK_VALUES = 1 << 24  # float values quantized and written per step
_COPY_BYTES = 64 << 20
_U32_MAX, _I32_MIN = 2**32 - 1, -(2**31)

TensorSource = tuple[str, "np.ndarray | torch.Tensor", int]


def _int_type(values: list[int], default: GGUFValueType) -> GGUFValueType:
    """`default` unless the values need a wider or signed type."""
    lo, hi = min(values), max(values)
    if lo < _I32_MIN or hi > _U32_MAX:
        return GGUFValueType.INT64 if lo < 0 else GGUFValueType.UINT64
    if lo < 0:
        return GGUFValueType.INT32
    if default == GGUFValueType.INT32 and hi > 2**31 - 1:
        return GGUFValueType.UINT32
    return default


def _item_type(items: list[Any], key: str) -> GGUFValueType:
    """Element type of a metadata array: strings, bools, INT32 ints (gguf-py's and llama.cpp's
    convention, e.g. tokenizer.ggml.token_type), or FLOAT32 numbers."""
    if all(isinstance(v, str) for v in items):
        return GGUFValueType.STRING
    if all(isinstance(v, bool) for v in items):
        return GGUFValueType.BOOL
    if all(isinstance(v, int) and not isinstance(v, bool) for v in items):
        return _int_type(items, GGUFValueType.INT32)
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in items):
        return GGUFValueType.FLOAT32
    raise FlashtreeError(f"metadata {key!r}: arrays must hold only strings, bools or numbers")


def _plain(value: Any) -> Any:
    """numpy scalars/arrays and tuples -> plain Python values."""
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    if isinstance(value, tuple):
        return list(value)
    return value


def typed_value(key: str, value: Any) -> tuple[Any, GGUFValueType, GGUFValueType | None]:
    """(value, type, array item type) for one metadata entry.

    Inferred: bool -> BOOL, int -> UINT32 (INT32 if negative, 64-bit if out of range), float -> FLOAT32,
    str -> STRING, list -> ARRAY. `(value, GGUFValueType.X)` forces the type (for a list: the item type).
    """
    forced = None
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], GGUFValueType):
        value, forced = value
    value = _plain(value)
    if isinstance(value, list):
        if not value:
            raise FlashtreeError(f"metadata {key!r}: empty arrays cannot be written")
        items = [_plain(v) for v in value]
        item_type = forced if forced not in (None, GGUFValueType.ARRAY) else _item_type(items, key)
        if item_type == GGUFValueType.FLOAT32:
            items = [float(v) for v in items]
        return items, GGUFValueType.ARRAY, item_type
    if forced is not None:
        return value, forced, None
    if isinstance(value, bool):
        return value, GGUFValueType.BOOL, None
    if isinstance(value, int):
        return value, _int_type([value], GGUFValueType.UINT32), None
    if isinstance(value, float):
        return value, GGUFValueType.FLOAT32, None
    if isinstance(value, str):
        return value, GGUFValueType.STRING, None
    raise FlashtreeError(f"metadata {key!r}: cannot store a {type(value).__name__} in GGUF")


def _packed_shape(array: np.ndarray, qtype: QT) -> tuple[int, ...]:
    """Torch-order value shape of already-packed bytes [..., row_bytes]."""
    n_bytes, n_values = block_bytes(qtype), block_size(qtype)
    if array.ndim == 0 or array.shape[-1] % n_bytes:
        raise FlashtreeError(f"packed rows of shape {array.shape} are not whole {type_name(qtype)} blocks")
    return (*array.shape[:-1], array.shape[-1] // n_bytes * n_values)


def _write_tensor(out: IO[bytes], array: np.ndarray | torch.Tensor, qtype: QT, bar: tqdm):
    """Write one tensor's bytes at the current position; returns (torch-order shape, n_bytes)."""
    if isinstance(array, torch.Tensor):
        array = array.detach()
        if array.dtype == torch.uint8:
            array = array.cpu().numpy()
    if isinstance(array, np.ndarray) and array.dtype == np.uint8:  # already packed
        shape = _packed_shape(array, qtype)
        data = np.ascontiguousarray(array)
        out.write(memoryview(data).cast("B"))
        bar.update(data.nbytes)
        return shape, data.nbytes
    is_float = (
        array.is_floating_point()
        if isinstance(array, torch.Tensor)
        else np.issubdtype(array.dtype, np.floating)
    )
    if not is_float:
        raise FlashtreeError(f"expected float values or packed uint8 bytes, got {array.dtype}")
    shape = tuple(array.shape)
    if not shape:
        raise FlashtreeError("0-d tensors cannot be written")
    rows = array.reshape(-1, shape[-1])
    n_bytes = 0
    step = max(1, _CHUNK_VALUES // max(rows.shape[1], 1))
    for start in range(0, rows.shape[0], step):
        packed = quantize(rows[start : start + step], qtype)  # (r, row_bytes) uint8
        out.write(memoryview(packed).cast("B"))
        n_bytes += packed.nbytes
        bar.update(packed.nbytes)
    return shape, n_bytes


def _pad(out: IO[bytes], n_bytes: int) -> None:
    out.write(bytes(-n_bytes % GGUF_DEFAULT_ALIGNMENT))


def _stream_tensors(writer: GGUFWriter, side: IO[bytes], tensors: Iterable[TensorSource], bar: tqdm) -> int:
    """Write every tensor, aligned, to `side` and register it with `writer`; returns the bytes written."""
    total = 0
    for name, array, qtype in tensors:
        try:
            check_supported(qtype)  # never write a file our own reader refuses
            qtype = QT(qtype)
            shape, n_bytes = _write_tensor(side, array, qtype, bar)
        except FlashtreeError as e:
            raise FlashtreeError(f"tensor {name!r}: {e}") from None
        if name in writer.tensors[0]:
            raise FlashtreeError(f"tensor {name!r} is written twice")
        if math.prod(shape) == 0:
            raise FlashtreeError(f"tensor {name!r} is empty (shape {shape})")
        writer.add_tensor_info(name, shape, np.dtype(np.float32), n_bytes, raw_dtype=qtype)
        _pad(side, n_bytes)
        total += n_bytes + (-n_bytes % GGUF_DEFAULT_ALIGNMENT)
    return total


def _append(dst: IO[bytes], src_path: Path, n_bytes: int, bar: tqdm) -> None:
    bar.reset(total=n_bytes)
    bar.set_description("assembling")
    with src_path.open("rb") as src:
        while chunk := src.read(_COPY_BYTES):
            dst.write(chunk)
            bar.update(len(chunk))


def write_gguf(
    path: str | Path,
    arch: str,
    metadata: dict[str, Any],
    tensors: Iterable[TensorSource],
    progress: bool = True,
) -> None:
    """Write a GGUF file with `general.architecture = arch`, `metadata`, and `tensors` in the given order.

    Each tensor is (name, values, qtype): float values (numpy or torch, torch-order shape) are quantized
    to `qtype`; uint8 values are already-packed rows [..., row_bytes] of `qtype`. `tensors` may be a
    generator: only one tensor (and one chunk of its packed bytes) is in memory at a time.
    """
    path = Path(path)
    # build the file next to its destination and rename it at the end: a failure never leaves a
    # half-written model, nor touches an existing file at `path`
    partial_path, side_path = (
        path.with_name(path.name + suffix) for suffix in (".partial", ".tensors.partial")
    )
    writer = GGUFWriter(partial_path, arch)
    for key, value in metadata.items():
        if key == "general.architecture":
            if value != arch:
                raise FlashtreeError(f"metadata general.architecture={value!r} contradicts arch={arch!r}")
            continue
        if key == "general.alignment" and value != GGUF_DEFAULT_ALIGNMENT:  # e.g. copied from another file
            raise FlashtreeError(
                f"metadata general.alignment={value!r}: only {GGUF_DEFAULT_ALIGNMENT} is written"
            )
        writer.add_key_value(key, *typed_value(key, value))
    try:
        with tqdm(desc="writing tensors", unit="B", unit_scale=True, disable=not progress) as bar:
            with side_path.open("wb") as side:
                data_bytes = _stream_tensors(writer, side, tensors, bar)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            out = writer.fout[0]
            _pad(out, out.tell())
            _append(out, side_path, data_bytes, bar)
            writer.close()
        partial_path.replace(path)
    except OSError as e:
        raise FlashtreeError(f"{path}: cannot write: {e.strerror or e}") from None
    finally:
        writer.close()
        partial_path.unlink(missing_ok=True)
        side_path.unlink(missing_ok=True)
