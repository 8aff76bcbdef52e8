"""Gated DeltaNet along a draft tree, one Triton launch per layer (the decode and verify hot path).

Each program owns one value head and a BV-wide slice of its (K x V) fp32 state, keeps it in
registers and walks the block's tokens in order. A token whose parent is not the previous token
(a sibling branch) reloads its parent's state slice from the per-token states it wrote before, so
every node starts from its parent's exact fp32 state.

The kernel reads the layer's raw inputs (the conv output holding q | k | v, and the alpha / beta
projections) and forms the gates and the L2-normalized q / k itself: the ops torch would run as a
dozen launches, and computed per token in a fixed order, so a token's result does not depend on how
many tokens share the launch (the AR step and the verify rows agree bit for bit; see
deltanet.l2_normalize for why that matters). The torch reference is `deltanet.delta_rule_inputs` +
`deltanet.recurrent_delta_rule`; tests compare the two under TRITON_INTERPRET=1.

Commit by replay (`replay_path`): a verify's per-token states are only needed inside its own launch
(sibling reloads), so they go to a scratch that every layer reuses. The accepted node's state is
rebuilt at commit by walking the accepted path again from the committed state, every layer in one
launch, with the same per-token code (`_token_update`) on the same inputs: the conv output rows (kept by
the conv) and each token's decay and beta (kept by the verify launch). So it equals the verify's node state
bit for bit, and a verify keeps its inputs pending, not every node's state.

Both kernels compile without fp fusion: the same source line must round the same way in every variant
(AR in place, verify with gates and restart states, replay), and whether the compiler contracts a
multiply and an add into one fma depends on the code around it (likely how a GPU check of one tile lost
the replay's bits: bench/results/h100-branches-2026-12-05).
"""

from __future__ import annotations

import torch

from flashtree.kernels import tl, triton
from flashtree.kernels.launch import pdl_options, wait_for_inputs
from flashtree.kernels.tiles import DEFAULT_KERNELS

EPS = 1e-6  # of the L2 norms of q and k (deltanet.l2_normalize)


@triton.jit
def _token_loads(
    x_ptr, alpha_ptr, beta_ptr, stride_ab, parents_ptr, t, width, q_col, k_col, v_col, offs_k, offs_v,
    mask_k, mask_v, h,
):  # fmt: skip
    """Token t's raw inputs: its parent, q, k, v and its alpha / beta projections, in fp32 (bf16
    projections are widened here, exactly, instead of by two cast launches a layer)."""
    x_row = x_ptr + t * width
    return (
        tl.load(parents_ptr + t),
        tl.load(x_row + q_col + offs_k, mask=mask_k, other=0.0).to(tl.float32),
        tl.load(x_row + k_col + offs_k, mask=mask_k, other=0.0).to(tl.float32),
        tl.load(x_row + v_col + offs_v, mask=mask_v, other=0.0).to(tl.float32),
        tl.load(alpha_ptr + t * stride_ab + h).to(tl.float32),
        tl.load(beta_ptr + t * stride_ab + h).to(tl.float32),
    )


@triton.jit
def _gates(alpha, beta, dt_bias, a):
    """A token's decay exp(a * softplus(alpha + dt_bias)) and sigmoid(beta), from its raw projections."""
    z = alpha + dt_bias
    softplus = tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(z)))  # torch's threshold
    return tl.exp(a * softplus), tl.sigmoid(beta)


@triton.jit
def _token_update(s, k, v, decay, beta, eps, k_scale, K: tl.constexpr):
    """The state slice s (BK, BV) after one token: its k L2-normalized (as RMSNorm with eps / K, times
    K^-0.5), then the delta rule with its decay and beta (`_gates`). One function for the verify and
    the commit replay, so that both compute a node's state with the same operations."""
    k = k * (tl.rsqrt(tl.sum(k * k, axis=0) / K + eps / K) * k_scale)
    s = s * decay
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
    return s + k[:, None] * delta[None, :]


# T is not specialized: Triton would compile T == 1 (the AR step) apart from the verify shapes.
@triton.jit(do_not_specialize=["T"])
def _tree_gated_delta_rule_kernel(
    x_ptr, alpha_ptr, beta_ptr, stride_ab, dt_bias_ptr, a_ptr, parents_ptr, s0_ptr, out_ptr, states_ptr,
    gates_ptr, keep_ptr, T, eps, q_scale, k_scale, H: tl.constexpr, NK: tl.constexpr, K: tl.constexpr,
    V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, KEEP_GATES: tl.constexpr,
    SOME_STATES: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """Token after token; token t + 1's inputs are loaded while token t computes: the walk is bound by
    latency, not by its state stores (bench/results/h200-bf16mma-2026-12-03). KEEP_GATES: the programs of
    the first value slice also store each token's decay and beta (`_gates`) at gates_ptr (T, 2, H), for
    `replay_path`. SOME_STATES: only the states of the tokens with keep_ptr[t] != 0 are stored (the ones
    a sibling restarts from); the others' stores carry an all-false mask."""
    wait_for_inputs(GDC)
    h = tl.program_id(0)
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
    mask_k, mask_v = offs_k < K, offs_v < V
    mask_kv = mask_k[:, None] & mask_v[None, :]
    kv_offs = offs_k[:, None] * V + offs_v[None, :]  # offsets inside one head's (K, V) state
    width = 2 * NK * K + H * V  # a conv-output row: q (NK heads) | k (NK heads) | v (H heads)
    q_col = (h % NK) * K  # GGUF tiles value heads over key heads: head h reads key head h % NK
    k_col = NK * K + q_col
    v_col = 2 * NK * K + h * V
    dt_bias = tl.load(dt_bias_ptr + h)
    a = tl.load(a_ptr + h)
    s = tl.load(s0_ptr + h * K * V + kv_offs, mask=mask_kv, other=0.0)
    prev = -1
    ahead = _token_loads(
        x_ptr, alpha_ptr, beta_ptr, stride_ab, parents_ptr, 0, width, q_col, k_col, v_col, offs_k, offs_v,
        mask_k, mask_v, h,
    )  # fmt: skip
    for t in range(T):
        parent, q, k, v, alpha, beta = ahead
        ahead = _token_loads(  # in flight while this token computes (the last loads itself again)
            x_ptr, alpha_ptr, beta_ptr, stride_ab, parents_ptr, tl.minimum(t + 1, T - 1), width, q_col, k_col,
            v_col, offs_k, offs_v, mask_k, mask_v, h,
        )  # fmt: skip
        decay, beta = _gates(alpha, beta, dt_bias, a)
        if KEEP_GATES:  # noqa: SIM102 - a compile-time switch around a run-time test
            if tl.program_id(1) == 0:
                tl.store(gates_ptr + 2 * t * H + h, decay)
                tl.store(gates_ptr + (2 * t + 1) * H + h, beta)
        # q: l2_normalize as RMSNorm with eps / K, times K^-0.5 and its attention scale K^-0.5
        q = q * (tl.rsqrt(tl.sum(q * q, axis=0) / K + eps / K) * q_scale)
        if parent != prev:  # a sibling branch: restart from the parent's state
            if parent < 0:
                s = tl.load(s0_ptr + h * K * V + kv_offs, mask=mask_kv, other=0.0)
            else:
                s = tl.load(states_ptr + (parent * H + h) * K * V + kv_offs, mask=mask_kv, other=0.0)
        s = _token_update(s, k, v, decay, beta, eps, k_scale, K)
        row = t * H + h
        tl.store(out_ptr + row * V + offs_v, tl.sum(s * q[:, None], axis=0), mask=mask_v)
        keep = mask_kv
        if SOME_STATES:
            # the flag broadcast before the compare: Triton's interpreter rejects a scalar term in a mask
            keep = mask_kv & (tl.full(mask_kv.shape, 0, tl.int8) + tl.load(keep_ptr + t) != 0)
        tl.store(states_ptr + row * K * V + kv_offs, s, mask=keep)
        prev = t


@triton.jit(do_not_specialize=["T"])
def _replay_path_kernel(
    x_ptr, gates_ptr, path_ptr, n_ptr, s_ptr, T, eps, k_scale, H: tl.constexpr, NK: tl.constexpr,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """Layer program_id(2): its state slice after tokens path[0 .. n) of the verify (each the child of
    the one before), from the state at s_ptr, written back in place. x_ptr (layers, T, width), gates_ptr
    (layers, T, 2, H): the verify's conv output and its tokens' decay and beta."""
    wait_for_inputs(GDC)
    h = tl.program_id(0)
    layer = tl.program_id(2).to(tl.int64)
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
    mask_k, mask_v = offs_k < K, offs_v < V
    mask_kv = mask_k[:, None] & mask_v[None, :]
    width = 2 * NK * K + H * V
    k_col = NK * K + (h % NK) * K
    v_col = 2 * NK * K + h * V
    x_ptr += layer * T * width
    gates_ptr += layer * T * 2 * H
    state_at = s_ptr + (layer * H + h) * K * V + offs_k[:, None] * V + offs_v[None, :]
    s = tl.load(state_at, mask=mask_kv, other=0.0)
    for i in range(tl.load(n_ptr)):
        t = tl.load(path_ptr + i)
        k = tl.load(x_ptr + t * width + k_col + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        v = tl.load(x_ptr + t * width + v_col + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        decay = tl.load(gates_ptr + 2 * t * H + h)
        beta = tl.load(gates_ptr + (2 * t + 1) * H + h)
        s = _token_update(s, k, v, decay, beta, eps, k_scale, K)
    tl.store(state_at, s, mask=mask_kv)


def tree_gated_delta_rule(
    conv_out: torch.Tensor,  # (T, 2 * nk * kd + nv * vd): q | k | v after the causal conv
    alpha: torch.Tensor,  # (T, nv) raw projection, any float dtype (a column slice is fine)
    beta: torch.Tensor,  # (T, nv) raw projection, same dtype and row stride as alpha
    dt_bias: torch.Tensor,  # (nv,)
    ssm_a: torch.Tensor,  # (nv,) = -exp(A_log)
    state: torch.Tensor,  # (nv, kd, vd) fp32
    parents: torch.Tensor,  # (T,) int32 on the device, -1 = from `state`
    n_k_heads: int,
    eps: float = EPS,
    states: torch.Tensor | None = None,
    tile: tuple[int, int] | None = None,
    gates: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
):
    """Every token from its parent's state, gates and norms included. Returns o (T, nv, vd) fp32 and
    the state after every token (T, nv, kd, vd), written to `states` if given (contiguous fp32; for a
    single token it may be `state` itself: each program reads its slice before writing it). tile:
    (BV, warps), default KernelConfig.delta_tile. gates (T, 2, nv) fp32, if given, receives each
    token's decay and beta
    (for `replay_path`). keep (T,) int8, if given: only the states of tokens with keep[t] != 0 are
    written, the others' rows of `states` left as they were: the verify keeps the ones its sibling
    branches restart from (BlockLayout.restart_points), a commit replays the accepted path's."""
    t = conv_out.shape[0]
    h, kd, vd = state.shape
    if alpha.dtype != beta.dtype or alpha.stride() != beta.stride() or alpha.stride(1) != 1:
        alpha, beta = alpha.contiguous(), beta.contiguous()
    out = torch.empty(t, h, vd, dtype=torch.float32, device=conv_out.device)
    if states is None:
        states = torch.empty(t, h, kd, vd, dtype=torch.float32, device=conv_out.device)
    elif t > 1 and states.data_ptr() == state.data_ptr():
        raise ValueError("states may alias state for a single token only")
    if gates is not None and (gates.shape != (t, 2, h) or gates.dtype != torch.float32):
        raise ValueError(f"gates: expected a {(t, 2, h)} fp32 tensor, got {tuple(gates.shape)} {gates.dtype}")
    block_v, warps = tile or DEFAULT_KERNELS.delta_tile
    bv = min(block_v, triton.next_power_of_2(vd))
    _tree_gated_delta_rule_kernel[(h, triton.cdiv(vd, bv))](
        conv_out.contiguous(), alpha, beta, alpha.stride(0), dt_bias.float().contiguous(),
        ssm_a.float().contiguous(), parents.to(torch.int32), state.contiguous(), out, states,
        out if gates is None else gates, out if keep is None else keep, t, eps, 1.0 / kd, kd**-0.5, H=h,
        NK=n_k_heads, K=kd, V=vd, BK=triton.next_power_of_2(kd), BV=bv, KEEP_GATES=gates is not None,
        SOME_STATES=keep is not None, num_warps=warps, enable_fp_fusion=False, **pdl_options(out),
    )  # fmt: skip
    return out, states


def replay_path(
    conv_out: torch.Tensor,  # (layers, T, 2 * nk * kd + nv * vd): each layer's verify conv output
    gates: torch.Tensor,  # (layers, T, 2, nv) fp32: each layer's decay and beta (tree_gated_delta_rule)
    path: torch.Tensor,  # (T',) int32 on the device: the accepted tokens, each the child of the one before
    n: torch.Tensor,  # (1,) int32 on the device: how many of path to walk
    state: torch.Tensor,  # (layers, nv, kd, vd) fp32, contiguous: replaced by the state after path[n - 1]
    n_k_heads: int,
    eps: float = EPS,
    tile: tuple[int, int] | None = None,
) -> None:
    """Every layer's state after tokens path[:n], from `state`, in place: one launch for all layers, the
    same per-token operations as tree_gated_delta_rule on its inputs (its node states, bit for bit)."""
    layers, h, kd, vd = state.shape
    if not state.is_contiguous() or not conv_out.is_contiguous() or not gates.is_contiguous():
        raise ValueError("replay_path: state, conv_out and gates must be contiguous")
    block_v, warps = tile or DEFAULT_KERNELS.delta_tile
    bv = min(block_v, triton.next_power_of_2(vd))
    _replay_path_kernel[(h, triton.cdiv(vd, bv), layers)](
        conv_out, gates, path, n, state, conv_out.shape[1], eps, kd**-0.5, H=h, NK=n_k_heads, K=kd, V=vd,
        BK=triton.next_power_of_2(kd), BV=bv, num_warps=warps, enable_fp_fusion=False, **pdl_options(state),
    )  # fmt: skip
