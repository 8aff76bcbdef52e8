"""Gated DeltaNet along a draft tree, one Triton launch per layer (the verify hot path).

Each program owns one value head and a BV-wide slice of its (K x V) fp32 state, keeps it in
registers and walks the block's tokens in order. A token whose parent is not the previous token
(a sibling branch) reloads its parent's state slice from the per-token states it wrote before, so
every node starts from its parent's exact fp32 state. The torch reference is
`flashtree.models.deltanet.recurrent_delta_rule`; tests compare the two under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# T is not specialized: Triton would compile T == 1 (the AR step) apart from the verify shapes, and the
# AR step must compute a token bit for bit as verify does (see deltanet.l2_normalize).
@triton.jit(do_not_specialize=["T"])
def _tree_delta_rule_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, parents_ptr, s0_ptr, out_ptr, states_ptr,
    T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0)
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
    mask_k, mask_v = offs_k < K, offs_v < V
    mask_kv = mask_k[:, None] & mask_v[None, :]
    kv_offs = offs_k[:, None] * V + offs_v[None, :]  # offsets inside one head's (K, V) state
    s = tl.load(s0_ptr + h * K * V + kv_offs, mask=mask_kv, other=0.0)
    prev = -1
    for t in range(T):
        parent = tl.load(parents_ptr + t)
        if parent != prev:  # a sibling branch: restart from the parent's state
            if parent < 0:
                s = tl.load(s0_ptr + h * K * V + kv_offs, mask=mask_kv, other=0.0)
            else:
                s = tl.load(states_ptr + (parent * H + h) * K * V + kv_offs, mask=mask_kv, other=0.0)
        row = t * H + h
        k = tl.load(k_ptr + row * K + offs_k, mask=mask_k, other=0.0)
        q = tl.load(q_ptr + row * K + offs_k, mask=mask_k, other=0.0)
        v = tl.load(v_ptr + row * V + offs_v, mask=mask_v, other=0.0)
        decay = tl.exp(tl.load(g_ptr + row))
        beta = tl.load(beta_ptr + row)
        s = s * decay
        delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
        s = s + k[:, None] * delta[None, :]
        tl.store(out_ptr + row * V + offs_v, tl.sum(s * q[:, None], axis=0), mask=mask_v)
        tl.store(states_ptr + row * K * V + kv_offs, s, mask=mask_kv)
        prev = t


def tree_delta_rule(q, k, v, g, beta, state, parents: torch.Tensor, block_v: int = 32):
    """Same contract as `recurrent_delta_rule`, with `parents` a (T,) tensor on the device.

    q, k: (T, H, K) fp32 (q pre-scaled); v: (T, H, V); g, beta: (T, H); state: (H, K, V).
    Returns o (T, H, V) and the state after every token (T, H, K, V)."""
    t, h, kd = q.shape
    vd = v.shape[-1]
    q, k, v, g, beta, state = (x.float().contiguous() for x in (q, k, v, g, beta, state))
    out = torch.empty(t, h, vd, dtype=torch.float32, device=q.device)
    states = torch.empty(t, h, kd, vd, dtype=torch.float32, device=q.device)
    bv = min(block_v, triton.next_power_of_2(vd))
    grid = (h, triton.cdiv(vd, bv))
    _tree_delta_rule_kernel[grid](
        q, k, v, g, beta, parents.to(torch.int32).contiguous(), state, out, states,
        t, H=h, K=kd, V=vd, BK=triton.next_power_of_2(kd), BV=bv,
    )  # fmt: skip
    return out, states
