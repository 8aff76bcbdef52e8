"""Building blocks shared by every model family: linear layers, RMSNorm, rotary embedding, SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x @ W^T with a dense weight [out, in]. Quantized variants keep the same interface,
    so model code never branches on the weight format."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def dense_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The (out, in) weight in `dtype` (no copy when it already is), as QuantLinear decodes it."""
        return self.weight.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain RMSNorm in fp32 (GGUF files already carry the +1 of zero-centred norms). torch's op is
    one fused kernel on CUDA (six launches otherwise) and bit-identical to the formula on the CPU."""
    return F.rms_norm(x.float(), weight.shape, weight.float(), eps).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Rotary(nn.Module):
    """NeoX-style (rotate-half) rotary embedding on the first `rot_dim` dims of each head."""

    def __init__(self, rot_dim: int, theta: float, freq_factors: torch.Tensor | None = None):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
        if freq_factors is not None:  # llama3-style long-context scaling stored as rope_freqs
            inv_freq = inv_freq / freq_factors.float()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rot_dim = rot_dim

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (T, rot/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (T, rot)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, head_dim); cos/sin: (T, rot). Dims past `rot` pass through unchanged."""
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    x1, x2 = xr.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    out = xr * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat([out, xp], dim=-1) if xp.shape[-1] else out


class SwiGLU(nn.Module):
    def __init__(self, gate: Linear, up: Linear, down: Linear):
        super().__init__()
        self.gate, self.up, self.down = gate, up, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))
