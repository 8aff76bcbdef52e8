"""Which GGML type each tensor gets for a whole-model recipe (`--type f32|f16|bf16|q8_0|q4_k_m`).

`q4_k_m_types` follows llama.cpp's llama-quant.cpp for LLAMA_FTYPE_MOSTLY_Q4_K_M without an imatrix
(docs/qwen35-gguf.md §3.1): default Q4_K; output.weight (or token_embd when the embeddings are tied) Q6_K;
"attn_v-like" tensors (attn_v, attn_qkv, attn_kv_b) and ffn_down Q6_K on the `use_more_bits` layers;
only 2-D+ `*.weight` tensors that are not norms or ssm_conv1d are quantized; a row length that is not a
multiple of 256 falls back to Q5_0 (for Q4_K) or Q8_0 (for Q6_K), and to F16 if not a multiple of 32.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from flashtree.errors import FlashtreeError
from flashtree.quant.formats import QT, block_size

Shape = tuple[int, ...]

# llama.cpp's general.file_type (enum llama_ftype) for each recipe
FILE_TYPES: dict[str, int] = {"f32": 0, "f16": 1, "q8_0": 7, "q4_k_m": 15, "bf16": 32}
RECIPES = tuple(FILE_TYPES)

_FALLBACK = {QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0}  # k-quant -> 32-value type
_ATTN_V_LIKE = ("attn_v.weight", "attn_qkv.weight", "attn_kv_b.weight")
_LAYER = re.compile(r"blk\.(\d+)\.")


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's pick of layers that get more bits: first and last eighth, every third one between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def quantizable(name: str, shape: Shape) -> bool:
    """Whether llama.cpp would quantize this tensor; everything else keeps its source type (F32 here)."""
    return (
        len(shape) >= 2
        and name.endswith("weight")
        and "_norm.weight" not in name
        and "ssm_conv1d" not in name
        and "ffn_gate_inp.weight" not in name
    )


def _fit_row(qtype: QT, n_cols: int) -> QT:
    """The type itself, or llama.cpp's fallback when a row is not a whole number of its blocks."""
    if n_cols % block_size(qtype) == 0:
        return qtype
    fallback = _FALLBACK.get(qtype, QT.F16)
    return fallback if n_cols % block_size(fallback) == 0 else QT.F16


def _llama_order(item: tuple[str, Shape]) -> tuple[int, str]:
    """llama.cpp's weight order (weight_name_comparer): by block number (-1 outside blocks), then by name."""
    layer = _LAYER.match(item[0])
    return (int(layer.group(1)) if layer else -1, item[0])


def q4_k_m_types(names_and_shapes: Sequence[tuple[str, Shape]], n_layers: int) -> dict[str, int]:
    """GGML type per tensor for Q4_K_M. Shapes are in torch order (the row length is shape[-1]).

    llama.cpp counts the attn_v-like and ffn_down tensors as it meets them in its own weight order, and
    that running count (not the layer number) picks the Q6_K ones; the result is in the given order.
    """
    names = [name for name, _ in names_and_shapes]
    tied = "output.weight" not in names  # then token_embd doubles as the LM head
    n_attn_v = sum(name.endswith(_ATTN_V_LIKE) for name in names)
    i_attn_v = i_ffn_down = 0
    types: dict[str, int] = {}
    for name, shape in sorted(names_and_shapes, key=_llama_order):
        if not quantizable(name, shape):
            types[name] = int(QT.F32)
            continue
        qtype = QT.Q4_K
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            qtype = QT.Q6_K if shape[-1] % 256 == 0 else QT.Q8_0
        elif name.endswith(_ATTN_V_LIKE):
            qtype = QT.Q6_K if use_more_bits(i_attn_v, n_attn_v) else QT.Q4_K
            i_attn_v += 1
        elif "ffn_down" in name:
            qtype = QT.Q6_K if use_more_bits(i_ffn_down, n_layers) else QT.Q4_K
            i_ffn_down += 1
        types[name] = int(_fit_row(qtype, shape[-1]))
    return {name: types[name] for name in names}


def recipe_types(recipe: str, names_and_shapes: Sequence[tuple[str, Shape]], n_layers: int) -> dict[str, int]:
    """GGML type per tensor for `recipe` (f32, f16, bf16, q8_0, q4_k_m); 1-D, norms and conv stay F32."""
    if recipe == "q4_k_m":
        return q4_k_m_types(names_and_shapes, n_layers)
    plain = {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16, "q8_0": QT.Q8_0}
    if recipe not in plain:
        raise FlashtreeError(f"unknown type {recipe!r} (choose from {', '.join(RECIPES)})")
    return {
        name: int(_fit_row(plain[recipe], shape[-1]) if quantizable(name, shape) else QT.F32)
        for name, shape in names_and_shapes
    }
