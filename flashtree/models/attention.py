"""Grouped-query attention over the static KV cache, optionally with qwen3.5's sigmoid output gate."""

from __future__ import annotations

import torch
from torch import nn

from flashtree import kernels
from flashtree.kernels import row_invariant
from flashtree.kernels.attention import tree_attention
from flashtree.kernels.prefill_attention import prefill_attention
from flashtree.kernels.qmatmul import MatmulInput
from flashtree.models.layers import Linear, MergedLinear, NormedInput, input_tensor, sigmoid_gate
from flashtree.models.pass_ import ForwardPass
from flashtree.models.state import KVCache


class Attention(nn.Module):
    def __init__(
        self,
        qkv: MergedLinear,  # q, k, v: they all read x
        o: Linear,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        eps: float,
        q_norm: torch.Tensor | None = None,
        k_norm: torch.Tensor | None = None,
        output_gate: bool = False,
    ):
        super().__init__()
        self.qkv, self.o = qkv, o
        self.q, self.k, self.v = qkv.parts
        self.n_heads, self.n_kv_heads, self.head_dim, self.eps = n_heads, n_kv_heads, head_dim, eps
        self.q_norm = nn.Parameter(q_norm, requires_grad=False) if q_norm is not None else None
        self.k_norm = nn.Parameter(k_norm, requires_grad=False) if k_norm is not None else None
        self.output_gate = output_gate
        self.row_invariant = True  # decode rows on the CPU: models.layers.use_row_invariant

    @property
    def input_projection(self) -> MergedLinear:
        """The matmul that reads the layer's input."""
        return self.qkv

    def forward(
        self, x: torch.Tensor | MatmulInput | NormedInput, kv: KVCache, fp: ForwardPass
    ) -> torch.Tensor:
        t, hd = input_tensor(x).shape[0], self.head_dim
        q, k, v = self.qkv(x)  # (T, q rows), (T, n_kv * hd) x 2
        gate = None
        if self.output_gate:  # q_proj rows are packed per head as [q_h | gate_h]
            q, gate = q.view(t, self.n_heads, 2 * hd).split(hd, dim=-1)  # gate (T, heads, hd)
        q = q.reshape(t, self.n_heads, hd)
        k = k.view(t, self.n_kv_heads, hd)
        v = v.view(t, self.n_kv_heads, hd)
        norms = None if self.q_norm is None else (self.q_norm, self.k_norm, self.eps)  # in RoPE's launch
        cos, sin = fp.rope()
        q = kv.write_rotated(fp.slots, q, k, v, cos, sin, norms)
        decode = t == 1 or not fp.commit  # an AR step or a verify (any size); prefill is the rest
        ours = kernels.triton_kernels_for(q) and not torch.is_grad_enabled()
        if ours and decode:
            # every row computed as the AR step computes it (see kernels/attention.py)
            paths = fp.attention_paths
            out = tree_attention(q, kv.k, kv.v, fp.start, *paths, fp.n_keys, hd**-0.5, window=fp.window)
        elif ours and fp.exact:  # a prefill chunk: causal over slots 0 .. start + T - 1, no mask tensor
            out = prefill_attention(q, kv.k, kv.v, fp.n_keys - t, hd**-0.5, fp.window)
        elif decode and not ours and row_invariant.wanted(self.row_invariant, q):  # each row as its AR step
            out = kv.attend_each_row(q, fp.host_start, fp.ancestors_list, hd**-0.5, fp.window)
        else:  # all past + ancestors in the block, by a (T, S) bool mask
            out = kv.attend(q, fp.n_keys, fp.attn_mask, hd**-0.5)
        out = out.reshape(t, self.n_heads * hd)
        if gate is not None:
            return self.o(sigmoid_gate(out, gate, self.o.takes_int8))
        return self.o(out)
