"""GGUF -> DecoderModel. Each family says which GGUF tensors make which block; this module holds
what they share: strict weight access and the arch registry."""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from flashtree.errors import FlashtreeError
from flashtree.gguf.reader import GGUFFile, open_gguf
from flashtree.models.layers import Linear, RMSNorm, SwiGLU

ARCHITECTURES = {"llama": "llama", "qwen3": "qwen3", "qwen35": "qwen35"}  # GGUF arch -> family module


class Weights:
    """Strict access to a GGUF's tensors, dequantized to the compute dtype on the target device."""

    def __init__(self, gguf: GGUFFile, device: torch.device | str, dtype: torch.dtype):
        self.gguf, self.device, self.dtype = gguf, torch.device(device), dtype

    def dense(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.gguf.tensor(name, dtype=dtype or self.dtype, device=self.device)

    def linear(self, name: str) -> Linear:
        return Linear(self.dense(name))

    def vector(self, name: str) -> torch.Tensor:
        """1-D parameters (norm weights, DeltaNet decay terms) stay fp32."""
        return self.dense(name, torch.float32)

    def norm(self, name: str, eps: float) -> RMSNorm:
        return RMSNorm(self.vector(name), eps)

    def swiglu(self, prefix: str) -> SwiGLU:
        return SwiGLU(
            self.linear(f"{prefix}.ffn_gate.weight"),
            self.linear(f"{prefix}.ffn_up.weight"),
            self.linear(f"{prefix}.ffn_down.weight"),
        )

    def lm_head(self, embedding: torch.Tensor) -> Linear:
        """Untied `output.weight`, or the token embedding itself when tied."""
        return self.linear("output.weight") if self.gguf.has("output.weight") else Linear(embedding)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on the GPU; fp32 on the CPU, where bf16 matmuls are slower and tests want exactness."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_target(path: str | Path, device: str | torch.device | None = None, dtype: torch.dtype | None = None):
    """Open a GGUF target and build its model on `device`. Returns (DecoderModel, GGUFFile)."""
    gguf = open_gguf(path)
    family = ARCHITECTURES.get(gguf.arch)
    if family is None:
        raise FlashtreeError(
            f"{gguf.path}: unsupported architecture {gguf.arch!r} (supported: {', '.join(ARCHITECTURES)})"
        )
    device = torch.device(device) if device is not None else default_device()
    module = importlib.import_module(f"flashtree.models.{family}")
    return module.build(gguf, Weights(gguf, device, dtype or default_dtype(device))), gguf
