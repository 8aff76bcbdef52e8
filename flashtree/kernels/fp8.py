"""fp8 (e4m3) matrices for the draft: y = x @ W^T with W and x rounded to fp8 per row, one library GEMM.

Why the draft: its output only proposes tokens and the target's verify decides what is emitted, so it
may round more than the target without changing an output token; in fp8 its weights are half the bytes.

Arithmetic: W (out, in) is rounded once, at load, to e4m3 with one fp32 scale per output row (amax / 448);
x (M, in) per row at every call the same way (`quantize_rows`: one Triton launch on the GPU); then
torch._scaled_mm (cuBLAS / CUTLASS on sm_89+, fp32 accumulation, bf16 out) multiplies them and applies
both scales (e4m3 keeps 3 mantissa bits). What it costs in accept length:
bench/results/cpu-draft-fp8-2026-12-05.

The Triton row quantizer writes the bytes torch's fp32 -> float8_e4m3fn cast writes (round to nearest,
ties to even), encoded in integer ops: Triton's interpreter mis-rounds its own fp8 casts at binade edges
(126.2 -> 64), and the CPU tests must check the encoding the GPU runs.
"""

from __future__ import annotations

import torch

from flashtree.errors import FlashtreeError
from flashtree.kernels import tl, triton
from flashtree.kernels.launch import pdl_options, wait_for_inputs

E4M3_MAX = 448.0
TINY = 1e-12  # amax floor: an all-zero row gets a finite scale and zero codes
ALIGN = 16  # in and out features must be multiples of this for the fp8 GEMM
_E4M3_MAX, _TINY = tl.constexpr(E4M3_MAX), tl.constexpr(TINY)  # as the kernels see them


def supported(device: torch.device) -> bool:
    """Whether fp8 matrices run on `device`: CUDA of compute capability 8.9+, or the CPU (torch's own
    fp8 GEMM: tests and replays)."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return device.type == "cpu"


# What of a draft is fp8: nothing; its own matrices (the LM head stays the target's, shared: no memory
# added, the 27B draft's 3.5 GB of bf16 matrices become 1.7 GB); or those and an fp8 copy of the LM head
# (its own 1.27 GB on the 27B, read by the fp8 GEMM instead of the target's packed kernel at 15 rows).
MODES = ("off", "matrices", "all")


def check_mode(mode: str, device: torch.device, source: str = "fp8 mode") -> str:
    """`mode` if it is one of MODES that runs on `device`, else a FlashtreeError naming `source`."""
    if mode not in MODES:
        raise FlashtreeError(f"{source} {mode!r}: expected one of {', '.join(MODES)}")
    if mode != "off" and not supported(device):
        raise FlashtreeError(
            f"{source} {mode}: fp8 matrices need a GPU of compute capability 8.9+, not {device}"
        )
    return mode


def fits(out_features: int, in_features: int) -> bool:
    return out_features % ALIGN == 0 and in_features % ALIGN == 0


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (codes (M, K) float8_e4m3fn, scales (M, 1) fp32): codes * scales ~ x."""
    x = x.float()
    # the quotients in fp64, rounded to fp32: the correctly rounded fp32 quotients the kernel's div_rn
    # makes (53 >= 2 * 24 + 2 bits: rounding twice changes nothing); torch's own fp32 division of a
    # number by a CPU tensor is off by an ulp at times (a reciprocal times the number), which moves
    # codes that sit near a rounding tie
    amax = x.abs().amax(dim=1, keepdim=True).clamp_min(TINY).double()
    inv, scales = (E4M3_MAX / amax).float(), (amax / E4M3_MAX).float()
    return (x * inv).to(torch.float8_e4m3fn), scales


@triton.jit
def _e4m3_bits(v):
    """The float8_e4m3fn byte of fp32 v (|v| <= 448), rounded to nearest, ties to even, as uint8 in
    int32. Normal values: the fp32 mantissa rounded to 3 bits, the exponent rebiased (127 -> 7); below
    2**-6 the subnormal steps of 2**-9 (a code of 8 is 2**-6, the first normal: the same byte)."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(v)
    r = a.to(tl.int32, bitcast=True)
    r = (r + 0x7FFFF + ((r >> 20) & 1)) & ~0xFFFFF  # round to 3 mantissa bits
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    sub = (a * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000  # rint(a * 2**9), 0..8
    code = tl.where(a < 0.015625, sub, tl.minimum(normal, 0x7E))  # 0x7E = 448, the largest finite
    return sign | code


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, scale_ptr, K, stride_x, BLOCK: tl.constexpr, N_BLOCKS: tl.constexpr, GDC: tl.constexpr
):
    """Row program_id(0): its amax, then its codes (as quantize_rows_reference)."""
    wait_for_inputs(GDC)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), tl.float32)
    for b in tl.static_range(N_BLOCKS):
        ok = b * BLOCK + cols < K
        x = tl.load(x_ptr + row * stride_x + b * BLOCK + cols, mask=ok, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    amax = tl.maximum(tl.max(amax, axis=0), _TINY)
    tl.store(scale_ptr + row, tl.math.div_rn(amax, _E4M3_MAX))
    inv = tl.math.div_rn(_E4M3_MAX, amax)
    for b in tl.static_range(N_BLOCKS):
        ok = b * BLOCK + cols < K
        x = tl.load(x_ptr + row * stride_x + b * BLOCK + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * K + b * BLOCK + cols, _e4m3_bits(x * inv).to(tl.uint8), mask=ok)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows_reference in one Triton launch (x: (M, K), unit stride along K)."""
    m, k = x.shape
    codes = torch.empty((m, k), dtype=torch.uint8, device=x.device)
    scales = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    block = min(triton.next_power_of_2(k), 4096)
    _quantize_rows_kernel[(m,)](
        x, codes, scales, k, x.stride(0), BLOCK=block, N_BLOCKS=triton.cdiv(k, block),
        num_warps=max(1, min(8, block // 512)), enable_fp_fusion=False, **pdl_options(x),
    )  # fmt: skip
    return codes.view(torch.float8_e4m3fn), scales


def fp8_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, kernel: bool) -> torch.Tensor:
    """x (M, K) @ W^T for W = codes (N, K) float8_e4m3fn * scales (N,) fp32, in x's dtype. kernel: x's
    rows quantized by the Triton kernel, else by torch."""
    x = x.contiguous()
    xq, sx = quantize_rows(x) if kernel else quantize_rows_reference(x)
    y = torch._scaled_mm(xq, codes.t(), scale_a=sx, scale_b=scales[None], out_dtype=torch.bfloat16)
    return y.to(x.dtype)
