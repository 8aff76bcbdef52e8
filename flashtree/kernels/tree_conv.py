"""Gated DeltaNet's causal depthwise conv + SiLU along each token's ancestry, one Triton launch.

One program per (token, channel tile) sums the kernel's taps in a fixed order in fp32, so a token's
output does not depend on how many tokens share the launch (the AR step and the verify rows compute
it the same way, see deltanet.l2_normalize), in one kernel where torch needs one per tap and op.
The torch reference is `GatedDeltaNet.causal_conv`'s CPU path; tests compare the two under
TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashtree.kernels.launch import pdl_options, wait_for_inputs


@triton.jit
def _tree_conv_silu_kernel(
    src_ptr, idx_ptr, w_ptr, out_ptr, C, KERNEL: tl.constexpr, BC: tl.constexpr, GDC: tl.constexpr
):
    wait_for_inputs(GDC)
    t = tl.program_id(0)
    offs = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = offs < C
    acc = tl.zeros([BC], dtype=tl.float32)
    for j in tl.static_range(KERNEL):
        row = tl.load(idx_ptr + t * KERNEL + j)
        x = tl.load(src_ptr + row * C + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs * KERNEL + j, mask=mask, other=0.0).to(tl.float32)
        acc += x * w
    tl.store(out_ptr + t * C + offs, acc * tl.sigmoid(acc), mask=mask)


def tree_conv_silu(src: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, block_c: int = 256):
    """SiLU(sum_j src[index[t, j]] * weight[:, j]) in fp32: src (rows, C) = [conv state | block tokens],
    index (T, kernel) each token's window oldest first, weight (C, kernel). Returns (T, C) fp32."""
    t, kernel = index.shape
    c = src.shape[1]
    out = torch.empty(t, c, dtype=torch.float32, device=src.device)
    bc = min(block_c, triton.next_power_of_2(c))
    _tree_conv_silu_kernel[(t, triton.cdiv(c, bc))](
        src.contiguous(), index.contiguous(), weight.contiguous(), out, c, KERNEL=kernel, BC=bc,
        **pdl_options(out),
    )  # fmt: skip
    return out
