"""Gated DeltaNet (qwen3.5 linear-attention layers) with exact fp32 recurrent state.

Per value head, with state S (k_dim x v_dim) and log-decay g <= 0:
    S <- exp(g) S;   delta = beta (v - S^T k);   S <- S + k delta^T;   o = S^T q / sqrt(k_dim)
Prefill uses the chunked (WY/UT-transform) form of the same recurrence; verify runs the token
recurrence along the tree, each node starting from its parent's state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from flashtree import kernels
from flashtree.kernels import row_invariant
from flashtree.kernels.qmatmul import MatmulInput
from flashtree.kernels.tiles import DEFAULT_KERNELS
from flashtree.models.layers import Linear, MergedLinear, NormedInput, gated_rms_norm, input_tensor
from flashtree.models.pass_ import ForwardPass

if TYPE_CHECKING:  # state.py imports this module (replay_accepted)
    from flashtree.models.state import DeltaNetState

CHUNK = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, written as RMSNorm: x / sqrt(mean(x^2) + eps/d)
    / sqrt(d) is the same function, and torch's RMSNorm kernel reduces each row the same way whatever
    the number of rows, where a `.sum(-1)` picks its reduction order by shape on CUDA. The verify pass
    must compute every token bit for bit as the AR step does: with int8-quantized activations (the
    packed kernels) a last-bit difference can round to a different int8 and flip a greedy near-tie."""
    d = x.shape[-1]
    return F.rms_norm(x, (d,), eps=eps / d) * d**-0.5


def normalized_qkv(conv_out, n_k_heads: int, k_dim: int, v_dim: int, n_v_heads: int):
    """q, k, v of the recurrence from the conv output (T, q | k | v): q and k L2-normalized (q also
    scaled by k_dim^-0.5) and tiled over the value heads: value head j reads key head j % n_k_heads, as
    GGUF lays them out."""
    t = conv_out.shape[0]
    nk, kd, nv = n_k_heads, k_dim, n_v_heads
    q, k, v = conv_out.float().split([nk * kd, nk * kd, nv * v_dim], dim=-1)
    q = l2_normalize(q.view(t, nk, kd)).repeat(1, nv // nk, 1) * kd**-0.5
    k = l2_normalize(k.view(t, nk, kd)).repeat(1, nv // nk, 1)
    return q, k, v.view(t, nv, v_dim)


def delta_rule_inputs(conv_out, alpha, beta, dt_bias, ssm_a, n_k_heads: int, k_dim: int, v_dim: int):
    """q, k, v, g, beta of the recurrence from the layer's raw inputs: the conv output (T, q | k | v)
    (`normalized_qkv`), the alpha and beta projections (T, nv)."""
    q, k, v = normalized_qkv(conv_out, n_k_heads, k_dim, v_dim, dt_bias.shape[0])
    # row_invariant.elementwise: an AR step's few gates would take torch's scalar tail, a verify's not
    g = ssm_a * row_invariant.elementwise(F.softplus, alpha.float() + dt_bias)  # (T, nv) log decay
    return q, k, v, g, row_invariant.elementwise(torch.sigmoid, beta.float())


def recurrent_delta_rule(q, k, v, g, beta, state, parents: list[int], decay=None):
    """Token-by-token recurrence along `parents` (-1 = start from `state`).

    q, k: (T, H, dk) fp32 (q already scaled); v: (T, H, dv); g, beta: (T, H); state: (H, dk, dv).
    decay: exp(g) itself (then g is unused), where the caller has it: torch's elementwise ops may round
    a value differently at another place in a tensor (vectorized or not), so a commit replays the
    verify's own decay. Returns o (T, H, dv) and the state after every token (T, H, dk, dv).
    """
    t = q.shape[0]
    states = q.new_empty((t + 1,) + tuple(state.shape))
    states[0] = state
    out = q.new_empty(v.shape)
    decay = g.exp() if decay is None else decay
    for i in range(t):
        s = states[parents[i] + 1] * decay[i][:, None, None]
        delta = (v[i] - torch.einsum("hk,hkv->hv", k[i], s)) * beta[i][:, None]
        s = s + k[i][:, :, None] * delta[:, None, :]
        states[i + 1] = s
        out[i] = torch.einsum("hk,hkv->hv", q[i], s)
    return out, states[1:]


def replay_accepted(
    conv_out: torch.Tensor,  # (layers, T, channels): each layer's verify conv output
    gates: torch.Tensor,  # (layers, T, 2, heads) fp32: each layer's decay and beta, as its verify used them
    path: torch.Tensor,  # (T',) the accepted block tokens first, root first, each the child of the one before
    n: torch.Tensor,  # (1,) how many of path were accepted
    state: torch.Tensor,  # (layers, heads, k, v) fp32: the committed state, replaced in place
    n_k_heads: int,
    tile: tuple[int, int],  # the tree kernel's (BV, warps): the verify's, for its bits
) -> None:
    """Every layer's state after the verify's tokens path[:n], from `state`: the verify's own operations
    on its own inputs, so its node state bit for bit (one Triton launch on the GPU for all layers)."""
    if kernels.triton_kernels_for(state):
        from flashtree.kernels.tree_deltanet import replay_path

        replay_path(conv_out, gates, path.to(torch.int32), n.to(torch.int32), state, n_k_heads, tile=tile)
        return
    count = int(n)  # the torch reference runs on the host's schedule anyway
    rows = path[:count]
    chain = list(range(-1, count - 1))
    _, heads, k_dim, v_dim = state.shape
    for layer in range(state.shape[0]):
        q, k, v = normalized_qkv(conv_out[layer, rows], n_k_heads, k_dim, v_dim, heads)
        g = gates[layer, rows]
        state[layer] = recurrent_delta_rule(q, k, v, None, g[:, 1], state[layer], chain, decay=g[:, 0])[1][-1]


def chunked_delta_rule(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The same recurrence over a causal chain, 64 tokens at a time. Returns o and the final state."""
    t, h, dk = q.shape
    dv = v.shape[-1]
    pad = (-t) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    n = (t + pad) // chunk
    # (H, N, C, d) per head and chunk
    q, k, v = (x.view(n, chunk, h, -1).permute(2, 0, 1, 3) for x in (q, k, v))
    g, beta = (x.view(n, chunk, h).permute(2, 0, 1) for x in (g, beta))

    gamma = g.cumsum(-1)  # (H, N, C) log decay from chunk start
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kb = k * beta[..., None]
    a = (kb @ k.transpose(-1, -2)) * decay  # strictly-lower part is the UT system
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    system = a.tril(-1) + eye
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * gamma.exp()[..., None], upper=False, unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * gamma.exp()[..., None]
    k_dec = k * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()  # (H, N)

    out = torch.empty(h, n, chunk, dv, dtype=q.dtype, device=q.device)
    s = state
    for c in range(n):
        v_new = u[:, c] - w[:, c] @ s  # (H, C, dv)
        out[:, c] = q_dec[:, c] @ s + qk[:, c] @ v_new
        s = s * chunk_decay[:, c, None, None] + k_dec[:, c].transpose(-1, -2) @ v_new
    out = out.permute(1, 2, 0, 3).reshape(n * chunk, h, dv)[:t]
    return out, s


class GatedDeltaNet(nn.Module):
    def __init__(
        self,
        in_proj: MergedLinear,  # qkv (the conv's input), z, beta, alpha: they all read x
        out: Linear,
        conv_weight: torch.Tensor,  # (channels, kernel)
        dt_bias: torch.Tensor,  # (v_heads,)
        ssm_a: torch.Tensor,  # (v_heads,) = -exp(A_log)
        norm_weight: torch.Tensor,  # (v_dim,)
        n_k_heads: int,
        n_v_heads: int,
        k_dim: int,
        v_dim: int,
        eps: float,
    ):
        super().__init__()
        self.in_proj, self.out = in_proj, out
        self.qkv, self.z, self.beta, self.alpha = in_proj.parts
        self.conv_weight = nn.Parameter(conv_weight, requires_grad=False)
        self.dt_bias = nn.Parameter(dt_bias.float(), requires_grad=False)
        self.ssm_a = nn.Parameter(ssm_a.float(), requires_grad=False)
        self.norm_weight = nn.Parameter(norm_weight, requires_grad=False)
        self.n_k_heads, self.n_v_heads, self.k_dim, self.v_dim, self.eps = (
            n_k_heads,
            n_v_heads,
            k_dim,
            v_dim,
            eps,
        )
        self.kernels = DEFAULT_KERNELS  # the tree kernel's tile: models.layers.use_kernels

    @property
    def kernel(self) -> int:
        return self.conv_weight.shape[1]

    def causal_conv(self, mixed: torch.Tensor, conv_state: torch.Tensor, fp: ForwardPass, windows, out=None):
        """Depthwise conv + SiLU along each token's ancestry over [conv state | block inputs]. Returns
        the output (fp32 on the GPU: one Triton launch; written to `out`, fp32, if given). windows
        (T, kernel-1, C), if not None, receives each token's last kernel-1 inputs (the conv state it
        leaves behind); the AR step passes the state itself, updated in place."""
        idx = fp.conv_index(self.kernel)  # (T, kernel) rows of [conv state | mixed], oldest first
        if kernels.triton_kernels_for(mixed):
            from flashtree.kernels.tree_conv import tree_conv_silu

            return tree_conv_silu(conv_state, mixed, idx, self.conv_weight, windows, out=out)
        src = torch.cat([conv_state, mixed], dim=0)
        rows = src[idx]  # (T, kernel, C)
        # Tap by tap in a fixed order (not a .sum(1), whose order may change with T: see l2_normalize).
        taps = self.conv_weight.t()  # (kernel, C)
        y = rows[:, 0] * taps[0]
        for j in range(1, self.kernel):
            y = y + rows[:, j] * taps[j]
        if windows is not None:
            windows.copy_(rows[:, 1:])
        y = row_invariant.elementwise(F.silu, y)
        return y if out is None else out.copy_(y)

    def tree_recurrence(self, conv_out, alpha, beta, state, fp: ForwardPass, states_out, gates_out=None):
        """Every block token from its parent's state, the state after each token written to states_out
        (T, heads, k, v): one Triton launch on the GPU (gates and norms included), the torch reference
        elsewhere. gates_out (T, 2, heads) fp32, if given, receives each token's decay and beta (what a
        commit replays from). In a verify (fp.commit false) states_out is a scratch only the walk itself
        reads: the kernel writes only the states a sibling branch restarts from (every state: 3.4 GB
        written by a 27B verify of 23 nodes). Returns o (T, heads, v)."""
        if kernels.triton_kernels_for(conv_out):
            from flashtree.kernels.tree_deltanet import tree_gated_delta_rule

            return tree_gated_delta_rule(
                conv_out, alpha, beta, self.dt_bias, self.ssm_a, state, fp.parents_int32, self.n_k_heads,
                states=states_out, tile=self.kernels.delta_tile, gates=gates_out,
                keep=None if fp.commit else fp.restart_points,
            )[0]  # fmt: skip
        q, k, v, g, beta = delta_rule_inputs(conv_out, alpha, beta, *self._head_args)
        decay = g.exp()
        if gates_out is not None:
            gates_out.copy_(torch.stack([decay, beta], dim=1))
        o, states = recurrent_delta_rule(q, k, v, g, beta, state, fp.parents_list, decay=decay)
        states_out.copy_(states)
        return o

    @property
    def input_projection(self) -> MergedLinear:
        """The matmul that reads the layer's input."""
        return self.in_proj

    @property
    def _head_args(self) -> tuple:
        return self.dt_bias, self.ssm_a, self.n_k_heads, self.k_dim, self.v_dim

    def forward(
        self, x: torch.Tensor | MatmulInput | NormedInput, st: DeltaNetState, fp: ForwardPass
    ) -> torch.Tensor:
        hidden = input_tensor(x)  # (T, H)
        t = hidden.shape[0]
        mixed, z, beta, alpha = self.in_proj(x)  # (T, conv channels), (T, nv * vd), (T, nv) x 2
        if fp.commit and t > 1:  # prefill: chunked form, only the final states are kept
            conv_out = self.causal_conv(mixed, st.conv, fp, None)
            tail = torch.cat([st.conv, mixed[1 - self.kernel :]], dim=0)  # not the whole prompt's inputs
            st.conv.copy_(tail[1 - self.kernel :])  # its last kernel-1 inputs
            inputs = delta_rule_inputs(conv_out, alpha, beta, *self._head_args)
            o, final = chunked_delta_rule(*inputs, st.recurrent)
            st.recurrent.copy_(final)
        elif fp.commit:  # the AR step: the new conv and recurrent states written in place
            conv_out = self.causal_conv(mixed, st.conv, fp, st.conv[None])
            o = self.tree_recurrence(conv_out, alpha, beta, st.recurrent, fp, st.recurrent[None])
        else:  # verify: every node's inputs and conv window kept pending until commit_path replays them
            pending = st.pending(t)
            conv_out = self.causal_conv(mixed, st.conv, fp, pending.windows, out=pending.conv_out)
            o = self.tree_recurrence(conv_out, alpha, beta, st.recurrent, fp, pending.scratch, pending.gates)

        return self.out(gated_rms_norm(o, self.norm_weight, self.eps, z, hidden.dtype, self.out.takes_int8))
