"""Building blocks shared by every model family: linear layers (merged ones too), RMSNorm, rotary embedding,
SwiGLU."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from flashtree import kernels
from flashtree.kernels import dense_matmul, fp8, fused, row_invariant
from flashtree.kernels.qlinear import use_arithmetic
from flashtree.kernels.qmatmul import MatmulInput, QuantizedActivations, new_activations
from flashtree.kernels.tiles import DEFAULT_KERNELS, KernelConfig


class Linear(nn.Module):
    """y = x @ W^T with a dense weight [out, in]. Quantized variants keep the same interface,
    so model code never branches on the weight format: x a tensor or a MatmulInput, and `takes_int8`
    (whether a MatmulInput's int8 form is used; QuantLinear's in the int8 arithmetic)."""

    takes_int8 = False

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.dense_kernel = True  # decode rows of fp32 weights on the GPU: see use_dense_kernel
        self.row_invariant = True  # decode rows on the CPU: see use_row_invariant
        self.kernels = DEFAULT_KERNELS  # its tiles: use_kernels

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def dense_weight(self, dtype: torch.dtype = torch.float32, rows: slice = slice(None)) -> torch.Tensor:
        """The (out, in) weight, or its `rows`, in `dtype` (no copy when it already is), as QuantLinear
        decodes it."""
        return self.weight[rows].to(dtype)

    def forward(self, x: torch.Tensor | MatmulInput | NormedInput) -> torch.Tensor:
        if isinstance(x, NormedInput):  # the norm made as the dense kernel loads x, else first
            if self.takes_dense_kernel(x.x):
                return self._dense(x.x, norm=x.norm)
            x = x.made()
        x = MatmulInput.of(x).x
        # decode/verify/draft rows of an fp32 model on the GPU: our batch-invariant kernel (a verify
        # row equals the AR step's bit for bit; kernels/dense_matmul.py)
        if self.takes_dense_kernel(x):
            return self._dense(x)
        if row_invariant.wanted(self.row_invariant, x):
            return row_invariant.linear(x, self.weight)
        return F.linear(x, self.weight)

    def takes_dense_kernel(self, x: torch.Tensor) -> bool:
        """Whether x's product runs our dense kernel (see forward), which also makes its input's norm
        (a NormedInput) or SwiGLU's activation (`swiglu`) as it loads it."""
        return self.dense_kernel and _fused_kernels(x) and dense_matmul.fits(x, self.weight)

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """(silu(gate) * up) @ W^T in the dense kernel's one launch (where takes_dense_kernel(gate))."""
        return self._dense(gate, up=up)

    def _dense(self, x: torch.Tensor, **prologue) -> torch.Tensor:
        """The dense kernel's product, with dense_linear's `up` or `norm` made as it loads x."""
        tiles = self.kernels.dense_tiles_for(*self.weight.shape)
        return dense_matmul.dense_linear(x, self.weight, tiles, **prologue)


class PackedEmbedding(nn.Module):
    """A token embedding kept as its GGUF rows (vocab, row_bytes) uint8, its looked-up rows decoded to
    `dtype` by the reference decoder: the same values as the decoded table's rows, bit for bit (decoding
    is row by row), for a fraction of its bytes (a 27B's 248k x 5k Q4_K table: 0.7 GB, 2.5 GB in bf16).
    Indexed like the dense table it replaces."""

    def __init__(self, rows: torch.Tensor, qtype: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("rows", rows, persistent=False)
        self.qtype, self.hidden, self.dtype = int(qtype), hidden, dtype

    @property
    def device(self) -> torch.device:
        return self.rows.device

    def __getitem__(self, tokens: torch.Tensor) -> torch.Tensor:
        from flashtree.quant.dequant import dequantize

        picked = self.rows[tokens]  # (..., row_bytes)
        return dequantize(picked, self.qtype, (*picked.shape[:-1], self.hidden), self.dtype)


def use_kernels(model: nn.Module, config: KernelConfig, speculative: bool) -> None:
    """Give every kernel-launching module of `model` (the model itself included) `config`, and pick the
    arithmetic and the dense kernel for this kind of engine, before any CUDA graph captures them."""
    for m in model.modules():
        if hasattr(m, "kernels"):
            m.kernels = config
    use_arithmetic(model, config.arithmetic_for(speculative))
    use_dense_kernel(model, config.dense_kernel_for(speculative))
    use_row_invariant(model, speculative)


def use_row_invariant(model: nn.Module, on: bool) -> None:
    """Compute the decode rows of `model`'s torch path (the CPU's) each as the AR step computes it (on:
    a speculating engine, whose verify rows must equal its AR step's; kernels/row_invariant.py), or by
    plain torch calls (faster): every linear and attention of `model`."""
    for m in model.modules():
        if hasattr(m, "row_invariant"):
            m.row_invariant = on


def use_dense_kernel(model: nn.Module, on: bool) -> int:
    """Compute the decode rows of `model`'s dense fp32 matrices on the GPU with our batch-invariant kernel
    (on) or with cuBLAS, before any CUDA graph captures them. Returns how many matrices are dense."""
    dense = [m for m in model.modules() if isinstance(m, Linear)]
    for m in dense:
        m.dense_kernel = on
    return len(dense)


class Fp8Linear(nn.Module):
    """y = x @ W^T with W kept in fp8 e4m3, one scale per row (kernels/fp8.py), same interface as Linear.
    For the draft only: its arithmetic decides how many tokens are accepted, never which."""

    takes_int8 = False
    CHUNK_ROWS = 8192  # rows rounded at a time: a 27B LM head would be 5 GB decoded to fp32 at once

    def __init__(self, weight: torch.Tensor | nn.Module, chunk_rows: int = CHUNK_ROWS):
        """weight: a dense (out, in) weight, or a module offering dense_weight(dtype, rows) (Linear,
        QuantLinear: an LM head shared with the target, rounded to fp8 chunk_rows rows at a time)."""
        super().__init__()
        rows_of = weight.dense_weight if isinstance(weight, nn.Module) else lambda _, rows: weight[rows]
        n_rows = weight.out_features if isinstance(weight, nn.Module) else weight.shape[0]
        first = rows_of(torch.float32, slice(0, 1))  # its width and device
        # filled in place, chunk by chunk: no second copy of the codes while they are made
        codes = torch.empty(n_rows, first.shape[1], dtype=torch.float8_e4m3fn, device=first.device)
        scales = torch.empty(n_rows, dtype=torch.float32, device=first.device)
        for r in range(0, n_rows, chunk_rows):
            c, s = fp8.quantize_rows_reference(rows_of(torch.float32, slice(r, r + chunk_rows)))
            codes[r : r + c.shape[0]], scales[r : r + c.shape[0]] = c, s[:, 0]
        self.register_buffer("codes", codes, persistent=False)
        self.register_buffer("scales", scales, persistent=False)

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    def dense_weight(self, dtype: torch.dtype = torch.float32, rows: slice = slice(None)) -> torch.Tensor:
        return (self.codes[rows].float() * self.scales[rows, None]).to(dtype)

    def forward(self, x: torch.Tensor | MatmulInput) -> torch.Tensor:
        x = MatmulInput.of(x).x
        x2 = x.reshape(-1, x.shape[-1])
        y = fp8.fp8_matmul(x2, self.codes, self.scales, kernel=_fused_kernels(x2))
        return y.reshape(*x.shape[:-1], self.out_features)


class LinearPart:
    """One matrix of a MergedLinear: rows `rows` of one of its groups. For code that reads weights (HF
    export, draft initialisation), it offers what a Linear of its own would."""

    def __init__(self, group: Linear, rows: slice):
        self.group, self.rows = group, rows

    @property
    def out_features(self) -> int:
        return self.rows.stop - self.rows.start

    @property
    def weight(self) -> torch.Tensor:
        """A view of the group's dense weight (dense groups only, like `Linear.weight`)."""
        return self.group.weight[self.rows]

    def dense_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.group.dense_weight(dtype, self.rows)


class MergedLinear(nn.Module):
    """Matrices that read the same input, y_i = x @ W_i^T, in as few matmuls as their storage allows: the
    rows of all dense ones form one matrix, packed ones one per GGUF type (blocks never straddle rows).
    Why: a decode step is bound by kernel launches, and a packed matmul also quantizes x on every call.
    Outputs come back one per matrix, in order; `parts` are the matrices one by one.

    Each output row is computed as before, except that a merged packed matrix may get fewer K-splits than
    a part alone (qmatmul.k_splits counts rows), so its fp32 sums can round differently; batch invariance
    holds as before."""

    def __init__(self, groups: list[nn.Module], part_groups: list[int], part_sizes: list[int]):
        """groups: the merged matrices; part i is the next part_sizes[i] rows of groups[part_groups[i]]."""
        super().__init__()
        self.groups = nn.ModuleList(groups)
        self.part_groups = part_groups
        filled = [0] * len(groups)
        self.parts = []
        for g, n in zip(part_groups, part_sizes, strict=True):
            self.parts.append(LinearPart(self.groups[g], slice(filled[g], filled[g] + n)))
            filled[g] += n
        assert filled == [group.out_features for group in groups]

    @staticmethod
    def from_rows(
        rows: list[torch.Tensor],
        kinds: list[int | None],
        build: Callable[[torch.Tensor, int | None], nn.Module],
    ) -> MergedLinear:
        """The matrices from their rows (dense weights, or GGUF rows (out, row_bytes) uint8), each with its
        kind (its GGUF type when packed, None when dense): the rows of one kind are concatenated in order,
        and build(rows, kind) makes their module."""
        order = list(dict.fromkeys(kinds))  # the kinds, in order of first appearance
        groups = []
        for kind in order:
            same = [r for r, k in zip(rows, kinds, strict=True) if k == kind]
            groups.append(build(same[0] if len(same) == 1 else torch.cat(same), kind))
        return MergedLinear(groups, [order.index(k) for k in kinds], [r.shape[0] for r in rows])

    @staticmethod
    def dense(
        weights: list[torch.Tensor], build: Callable[[torch.Tensor], nn.Module] = Linear
    ) -> MergedLinear:
        """Dense weights (out_i, in), all in one matmul (a Linear, or what `build` makes of their rows)."""
        return MergedLinear.from_rows(weights, [None] * len(weights), lambda rows, _: build(rows))

    @property
    def takes_int8(self) -> bool:
        """Whether every group uses a MatmulInput's int8 form (packed int8 matrices only)."""
        return all(group.takes_int8 for group in self.groups)

    def defers_norm(self, x: torch.Tensor) -> bool:
        """Whether the norm of its input x is best left to the matmul (a NormedInput): one dense-kernel
        group, which makes it as it loads x."""
        (group, *more) = self.groups
        return not more and isinstance(group, Linear) and group.takes_dense_kernel(x)

    def forward(self, x: torch.Tensor | MatmulInput | NormedInput) -> list[torch.Tensor]:
        if isinstance(x, NormedInput) and len(self.groups) > 1:
            x = x.made()  # once for all groups
        ys = [group(x) for group in self.groups]  # (..., group rows) each
        return [ys[g][..., part.rows] for g, part in zip(self.part_groups, self.parts, strict=True)]

    def extra_repr(self) -> str:
        return f"parts={[part.out_features for part in self.parts]}"


def _fused_kernels(x: torch.Tensor) -> bool:
    """Whether to run kernels/fused.py's one-launch versions: on the GPU, outside autograd (training
    differentiates the torch ops)."""
    return kernels.triton_kernels_for(x) and not torch.is_grad_enabled()


def _int8_for(int8: bool, x: torch.Tensor) -> QuantizedActivations | None:
    """Buffers for the int8 form of a producer's output (x's size) when the matmul it goes to takes one
    (`int8`: its takes_int8) and the producer can make it: one token (x's first dim), on the fused path."""
    if int8 and x.shape[0] == 1 and _fused_kernels(x):
        return new_activations(x.numel(), 1, x.device)
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain RMSNorm in fp32 (GGUF files already carry the +1 of zero-centred norms), in x's dtype.
    torch's op is bit-identical to the formula on the CPU."""
    if _fused_kernels(x):
        return fused.rms_norm(x, weight, eps)
    return F.rms_norm(x.float(), weight.shape, weight.float(), eps).to(x.dtype)


class NormedInput(NamedTuple):
    """rms_norm(x [+ norm.residual]) * norm.weight as a matmul's input, not made yet: a Linear on the dense
    kernel makes it as it loads x (kernels/dense_matmul.py), anything else calls `made()` first. With a
    residual, x + residual lands in norm.total when the input is made, so `total` is read only after the
    matmul. Why: small fp32 models' decode steps are launch-bound, and this saves each norm's launch."""

    x: torch.Tensor
    norm: dense_matmul.Norm

    def made(self) -> MatmulInput:
        """The input made by the norm's own launch (x + residual stored to norm.total)."""
        weight, eps, residual, total = self.norm
        if residual is None:
            return MatmulInput(rms_norm(self.x, weight, eps))
        h, normed = add_rms_norm(self.x, residual, weight, eps)
        total.copy_(h)
        return normed


def input_tensor(x: torch.Tensor | MatmulInput | NormedInput) -> torch.Tensor:
    """The tensor behind a layer's input: its rows, dtype and device are the input's."""
    return x.x if isinstance(x, (MatmulInput, NormedInput)) else x


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    int8: bool = False,
    defer: bool = False,
) -> tuple[torch.Tensor, MatmulInput | NormedInput]:
    """(h, rms_norm(h)) for h = x + residual: the residual stream and the next block's input (for a matmul
    that takes the int8 form when `int8`, see _int8_for). defer: the input as a NormedInput for a matmul
    that makes it (MergedLinear.defers_norm); h is then written by that matmul."""
    if defer:
        total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        return total, NormedInput(x, dense_matmul.Norm(weight, eps, residual, total))
    if _fused_kernels(x):
        act = _int8_for(int8, x)
        h, normed = fused.rms_norm(x, weight, eps, residual=residual, int8=act)
        return h, MatmulInput(normed, act)
    h = x + residual
    return h, MatmulInput(rms_norm(h, weight, eps))


def gated_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    gate: torch.Tensor,
    out_dtype: torch.dtype,
    int8: bool = False,
) -> MatmulInput:
    """rms_norm(x) * silu(gate) in fp32 of x (T, heads, dim) per head (gate viewed as x's shape), as
    (T, heads * dim) in out_dtype: a matmul's input (int8: see _int8_for)."""
    t = x.shape[0]
    if _fused_kernels(x):
        act = _int8_for(int8, x)
        out = fused.rms_norm(x, weight, eps, gate=gate, out_dtype=out_dtype, int8=act)
        return MatmulInput(out.reshape(t, -1), act)
    normed = F.rms_norm(x.float(), weight.shape, weight.float(), eps)
    silu = row_invariant.elementwise(F.silu, gate.float().view(x.shape))
    return MatmulInput((normed * silu).to(out_dtype).reshape(t, -1))


def silu_mul(gate: torch.Tensor, up: torch.Tensor, int8: bool = False) -> MatmulInput:
    """SwiGLU's activation, silu(gate) * up, in their dtype: a matmul's input (int8: see _int8_for)."""
    if _fused_kernels(gate):
        n = gate.shape[-1]
        rows = gate.reshape(-1, n)
        act = _int8_for(int8, rows)
        return MatmulInput(fused.gate_mul(rows, up.reshape(-1, n), "silu", act).reshape(gate.shape), act)
    return MatmulInput(row_invariant.elementwise(F.silu, gate) * up)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor, int8: bool = False) -> MatmulInput:
    """x * sigmoid(gate) in x's dtype: x (T, heads * dim), gate (T, heads, dim) (a strided head view);
    qwen3.5's attention output gate, a matmul's input (int8: see _int8_for)."""
    if _fused_kernels(x):
        act = _int8_for(int8, x)
        return MatmulInput(fused.gate_mul(gate, x, "sigmoid", act), act)
    return MatmulInput(x * row_invariant.elementwise(torch.sigmoid, gate.reshape(x.shape)))


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    @property
    def args(self) -> tuple[torch.Tensor, float]:
        return self.weight, self.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def matmul_input(
        self, x: torch.Tensor, int8: bool = False, defer: bool = False
    ) -> MatmulInput | NormedInput:
        """The norm of x as a matmul's input (int8: see _int8_for; defer: see add_rms_norm)."""
        if defer:
            return NormedInput(x, dense_matmul.Norm(self.weight, self.eps))
        act = _int8_for(int8, x)
        if act is None:
            return MatmulInput(self(x))
        return MatmulInput(fused.rms_norm(x, self.weight, self.eps, int8=act), act)


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


def rotary_kernel_fits(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether the Triton rotary kernels compute apply_rotary's bits for x: inference on the GPU, x and
    cos of one dtype (else torch promotes), fp32 or bf16, unit stride along head_dim."""
    kernel_dtypes = cos.dtype == x.dtype in (torch.float32, torch.bfloat16)
    return kernels.triton_kernels_for(x) and not x.requires_grad and kernel_dtypes and x.stride(-1) == 1


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, head_dim); cos/sin: (T, rot). Dims past `rot` pass through unchanged. On the GPU
    (inference) one Triton launch computes the same bits (kernels/rotary.py)."""
    if rotary_kernel_fits(x, cos):
        from flashtree.kernels.rotary import rotary

        return rotary(x, cos, sin)
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    x1, x2 = xr.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    out = xr * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat([out, xp], dim=-1) if xp.shape[-1] else out


def grouped_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Softmax attention with grouped-query heads: q (B, nh, T, hd), keys and values (B, n_kv, S, hd),
    mask (B, T, S) or (T, S) bool (True: attend), or None -> (B, nh, T, hd). The nh / n_kv query heads
    that share a KV head become rows of one attention problem, so SDPA sees no grouping. Why: SDPA's
    fused kernels take a mask but not grouped heads (at the draft's fp32), so torch fell back to its math
    path (bench/results/h200-step-2026-12-03), and transformers' batched decoding repeated the KV heads."""
    *lead, n_heads, t, hd = q.shape
    n_kv = keys.shape[-3]
    group = n_heads // n_kv
    if mask is not None:  # row r = g * T + i of a KV head's problem is query row i of its head g
        *mask_lead, _, s = mask.shape
        mask = mask.unsqueeze(-3).expand(*mask_lead, group, t, s).reshape(*mask_lead, 1, group * t, s)
    rows = q.reshape(*lead, n_kv, group * t, hd)
    out = F.scaled_dot_product_attention(rows, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(*lead, n_heads, t, hd)  # CUDA kernels may hand back a strided layout


class SwiGLU(nn.Module):
    def __init__(self, gate_up: MergedLinear, down: Linear):
        super().__init__()
        self.gate_up, self.down = gate_up, down
        self.gate, self.up = gate_up.parts

    @property
    def takes_int8(self) -> bool:
        """Whether its input projection uses a MatmulInput's int8 form."""
        return self.gate_up.takes_int8

    def forward(self, x: torch.Tensor | MatmulInput) -> torch.Tensor:
        gate, up = self.gate_up(x)
        if isinstance(self.down, Linear) and self.down.takes_dense_kernel(gate):  # one launch, not two
            return self.down.swiglu(gate, up)
        return self.down(silu_mul(gate, up, self.down.takes_int8))
