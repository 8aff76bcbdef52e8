"""Gated DeltaNet's causal depthwise conv + SiLU along each token's ancestry, one Triton launch.

One program per (token, channel tile) sums the kernel's taps in a fixed order in fp32, so a token's
output does not depend on how many tokens share the launch (the AR step and the verify rows compute
it the same way, see deltanet.l2_normalize), in one kernel where torch needs one per tap and op.
Compiled without fp fusion, so that its variants (with and without WINDOWS) round each tap alike.
The torch reference is `GatedDeltaNet.causal_conv`'s CPU path; tests compare the two under
TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch

from flashtree.kernels import tl, triton
from flashtree.kernels.launch import pdl_options, wait_for_inputs


@triton.jit
def _tree_conv_silu_kernel(
    state_ptr, new_ptr, idx_ptr, w_ptr, out_ptr, windows_ptr, C, stride_new, KERNEL: tl.constexpr,
    BC: tl.constexpr, WINDOWS: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """Token t, channels of tile program_id(1): window row r is state row r (r < KERNEL - 1) or new row
    r - (KERNEL - 1). With WINDOWS, the window's last KERNEL - 1 rows are stored as they are loaded:
    row j - 1 of windows[t] after row j - 1 of the source was read, so windows may be the state itself
    for one token (its row j - 1 is never read again)."""
    wait_for_inputs(GDC)
    t = tl.program_id(0)
    offs = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = offs < C
    acc = tl.zeros([BC], dtype=tl.float32)
    for j in tl.static_range(KERNEL):
        row = tl.load(idx_ptr + t * KERNEL + j) + offs * 0  # the same row for every channel
        from_state = row < KERNEL - 1
        old = tl.load(state_ptr + row * C + offs, mask=mask & from_state, other=0.0)
        new_at = new_ptr + (row - (KERNEL - 1)) * stride_new + offs
        new = tl.load(new_at, mask=mask & (row >= KERNEL - 1), other=0.0)
        x = tl.where(from_state, old, new)
        if WINDOWS and j > 0:
            tl.store(windows_ptr + (t * (KERNEL - 1) + j - 1) * C + offs, x, mask=mask)
        w = tl.load(w_ptr + offs * KERNEL + j, mask=mask, other=0.0).to(tl.float32)
        acc += x.to(tl.float32) * w
    tl.store(out_ptr + t * C + offs, acc * tl.sigmoid(acc), mask=mask)


def tree_conv_silu(
    state: torch.Tensor,
    new: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor,
    windows: torch.Tensor | None = None,
    block_c: int = 256,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """SiLU(sum_j src[index[t, j]] * weight[:, j]) in fp32, src = [state | new] without building it:
    state (kernel - 1, C) the conv state, new (T, C) the block's inputs (a column slice is fine), index
    (T, kernel) each token's window oldest first, weight (C, kernel). Returns (T, C) fp32. windows
    (T, kernel - 1, C), if given, receives each token's last kernel - 1 inputs (the conv state it
    leaves); for one token it may be `state[None]` (the AR step updates the state in place). out: where
    to write the output instead (a contiguous (T, C) fp32 tensor)."""
    t, kernel = index.shape
    c = state.shape[1]
    if new.stride(-1) != 1:
        new = new.contiguous()
    if windows is not None and (windows.shape != (t, kernel - 1, c) or not windows.is_contiguous()):
        raise ValueError(f"windows: expected a contiguous {(t, kernel - 1, c)} tensor, got {windows.shape}")
    if windows is not None and t > 1 and windows.data_ptr() == state.data_ptr():
        raise ValueError("windows may alias the state for a single token only")
    if out is None:
        out = torch.empty(t, c, dtype=torch.float32, device=state.device)
    elif out.shape != (t, c) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(
            f"out: expected a contiguous {(t, c)} fp32 tensor, got {tuple(out.shape)}, {out.dtype}"
        )
    bc = min(block_c, triton.next_power_of_2(c))
    _tree_conv_silu_kernel[(t, triton.cdiv(c, bc))](
        state.contiguous(), new, index.contiguous(), weight.contiguous(), out,
        out if windows is None else windows, c, new.stride(0), KERNEL=kernel, BC=bc,
        WINDOWS=windows is not None, enable_fp_fusion=False, **pdl_options(out),
    )  # fmt: skip
    return out
