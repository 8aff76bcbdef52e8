"""GGML tensor types flashtree reads: block sizes, bytes per block, names.

Layouts (little-endian, QK_K = 256) follow gguf-py's `GGML_QUANT_SIZES`; see
docs/qwen35-gguf.md §3.2 for the byte layout of each block.
"""

from __future__ import annotations

import functools

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from flashtree.errors import FlashtreeError

QT = GGMLQuantizationType
QK_K = 256  # values per k-quant super-block

# Every type `dequantize` accepts, i.e. every tensor type a GGUF may hold for us to load it.
SUPPORTED_TYPES: frozenset[int] = frozenset(
    int(t)
    for t in (QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q5_K, QT.Q6_K)
)
FLOAT_TYPES: frozenset[int] = frozenset(int(t) for t in (QT.F32, QT.F16, QT.BF16))


@functools.cache
def _float_dtypes() -> dict:
    import torch

    return {QT.F32: torch.float32, QT.F16: torch.float16, QT.BF16: torch.bfloat16}


def __getattr__(name: str):
    """FLOAT_DTYPES ({float type: torch dtype}) on first use (PEP 562): the GGUF reader imports this module,
    and `flashtree inspect` or a listing of models should not wait a second for torch."""
    if name == "FLOAT_DTYPES":
        return _float_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def type_name(qtype: int) -> str:
    """'Q4_K' for 12; 'unknown (99)' for a number gguf-py does not know."""
    try:
        return QT(qtype).name
    except ValueError:
        return f"unknown ({qtype})"


def block_size(qtype: int) -> int:
    """Values per block (1 for plain float types)."""
    return GGML_QUANT_SIZES[QT(qtype)][0]


def block_bytes(qtype: int) -> int:
    """Bytes per block."""
    return GGML_QUANT_SIZES[QT(qtype)][1]


def row_bytes(qtype: int, n_cols: int) -> int:
    """Bytes of one row of `n_cols` values; the row must be a whole number of blocks."""
    size = block_size(qtype)
    if n_cols % size:
        raise FlashtreeError(f"{type_name(qtype)} rows must be a multiple of {size} values, got {n_cols}")
    return n_cols // size * block_bytes(qtype)


def check_supported(qtype: int) -> None:
    if qtype not in SUPPORTED_TYPES:
        names = ", ".join(type_name(t) for t in sorted(SUPPORTED_TYPES))
        raise FlashtreeError(f"unsupported tensor type {type_name(qtype)} (supported: {names})")
