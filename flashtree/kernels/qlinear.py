"""QuantLinear: a drop-in `Linear` whose weight stays GGUF-quantized (repacked once, see qmatmul.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashtree import kernels
from flashtree.errors import FlashtreeError
from flashtree.kernels import row_invariant
from flashtree.kernels.qmatmul import MatmulInput, packed_fields, quant_matmul, repack, unpack
from flashtree.kernels.tiles import ARITHMETICS, DEFAULT_KERNELS
from flashtree.quant.dequant import dequantize
from flashtree.quant.formats import type_name


class QuantLinear(nn.Module):
    """y = x @ W^T with W kept as quantized blocks, same interface as `Linear`. CUDA runs the Triton
    kernels in `arithmetic` (int8: x quantized to int8 per 32 values, bf16:
    the weights decoded to bf16; for up to 64 rows each row's result is bit-identical whatever the
    batch; a one-row input may come with its int8 quantization, qmatmul.MatmulInput); any other device
    dequantizes with the reference decoder on every call."""

    def __init__(self, raw: torch.Tensor | None, qtype: int, shape: tuple[int, int], device=None):
        """raw: the GGUF rows (out, row_bytes) uint8 on the layer's device, or None: fields allocated on
        `device` for a loader to fill (qmatmul.repack_into); shape: (out, in)."""
        super().__init__()
        self.qtype, self.out_features, self.in_features = int(qtype), int(shape[0]), int(shape[1])
        if raw is None:
            fields = packed_fields(qtype, self.out_features, self.in_features, device)
        else:
            fields = repack(raw, qtype, self.in_features)
        for i, field in enumerate(fields):
            self.register_buffer(f"field{i}", field, persistent=False)
        self.n_fields = len(fields)
        self.arithmetic = "int8"  # see use_arithmetic
        self.row_invariant = True  # decode rows on the CPU: models.layers.use_row_invariant
        self.kernels = DEFAULT_KERNELS  # tiles and K-splits: models.layers.use_kernels
        self._fragment: list[torch.Tensor] | None = None  # gluon_qmm's copy of the fields, on first use

    @property
    def fields(self) -> list[torch.Tensor]:
        return [getattr(self, f"field{i}") for i in range(self.n_fields)]

    def dense_weight(self, dtype: torch.dtype = torch.float32, rows: slice = slice(None)) -> torch.Tensor:
        """The (out, in) weight, or its `rows`, decoded by the reference dequantizer from the exact GGUF
        bytes."""
        raw = unpack(self.fields, self.qtype, self.in_features, rows)
        return dequantize(raw, self.qtype, (raw.shape[0], self.in_features), dtype)

    @property
    def takes_int8(self) -> bool:
        """Whether its one-row product quantizes its input to int8 first: a MatmulInput's `int8` then
        replaces that (the kernel making the input can quantize it too, kernels/fused.py)."""
        return self.arithmetic == "int8"

    def forward(self, x: torch.Tensor | MatmulInput) -> torch.Tensor:
        x, int8 = MatmulInput.of(x)
        x2 = x.reshape(-1, self.in_features)  # (M, in)
        if kernels.triton_kernels_for(x):
            shape = (self.out_features, self.in_features)
            if self.arithmetic == "bf16" and self.kernels.qmm_kernel == "gluon":
                from flashtree.kernels import gluon_qmm  # imports Triton's Gluon: only when chosen

                if gluon_qmm.supports(x2, self.qtype, self.in_features):
                    if self._fragment is None:
                        self._fragment = gluon_qmm.fragment_fields(self.fields, self.qtype)
                    y = gluon_qmm.matmul(x2, self._fragment, self.qtype, *shape, self.kernels)
                    return y.reshape(*x.shape[:-1], self.out_features)
            y = quant_matmul(x2, self.fields, self.qtype, *shape, self.arithmetic, int8, self.kernels)
        elif row_invariant.wanted(self.row_invariant, x2):
            y = row_invariant.linear(x2, self.dense_weight(x.dtype))
        else:
            y = F.linear(x2, self.dense_weight(x.dtype))
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, type={type_name(self.qtype)}"


def use_arithmetic(model: nn.Module, arithmetic: str) -> int:
    """Run every packed matrix of `model` in `arithmetic` (tiles.ARITHMETICS), before any CUDA graph
    captures them: one arithmetic for all keeps a verify row equal to the AR step's row. Returns how
    many matrices are packed."""
    if arithmetic not in ARITHMETICS:
        raise FlashtreeError(f"unknown arithmetic {arithmetic!r}: expected one of {', '.join(ARITHMETICS)}")
    packed = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for m in packed:
        m.arithmetic = arithmetic
    return len(packed)


def arithmetic_of(model: nn.Module) -> str | None:
    """The arithmetic `model`'s packed matrices run in, None when it has none."""
    found = {m.arithmetic for m in model.modules() if isinstance(m, QuantLinear)}
    assert len(found) <= 1, found
    return found.pop() if found else None
