"""Per-sequence model state: static slot-indexed KV caches and exact fp32 DeltaNet state.

A forward writes its block's K/V at slots [seq_len, seq_len + T). With commit=True (prefill, AR)
everything is committed at once. With commit=False (verify) the recurrent layers keep what each block
token's state was made from as pending (its conv output, its gates, its conv window), and
`commit_path(path, n)` later keeps exactly the accepted tokens: their K/V are compacted into contiguous
slots, each DeltaNet layer's fp32 state is rebuilt by replaying the accepted tokens (the same operations
on the same inputs as the verify: its node state, bit for bit) and takes the conv window after the last
one. Rejected K/V slots are simply overwritten. Each kind of layer state lives in one store for all
layers (KVStore, DeltaNetStore), so that a commit is a handful of launches whatever the depth of the
model.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from flashtree.errors import FlashtreeError
from flashtree.models.deltanet import replay_accepted
from flashtree.models.layers import apply_rotary, rms_norm, rotary_kernel_fits
from flashtree.quant.kv import (
    FLOAT_TYPES,
    KVPlane,
    as_plane,
    dequantize,
    empty_plane,
    quantize,
    resolve_kv_type,
    rotate,
    unrotate,
)


class CommitPlan(NamedTuple):
    """What a speculative step keeps, on the device: block tokens path[:n] (root first, each the child of
    the one before), last = path[n - 1] (1,), and the KV slot moves src -> dst (commit_path)."""

    path: torch.Tensor
    n: torch.Tensor
    last: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor


class KVCache:
    """K/V of one attention layer: planes (quant/kv.py) of fields (n_kv, max_ctx, ...), views into a
    KVStore (or plain (n_kv, max_ctx, head_dim) float tensors, as the draft's ring keeps them)."""

    def __init__(self, k: torch.Tensor | KVPlane, v: torch.Tensor | KVPlane):
        self.k, self.v = as_plane(k), as_plane(v)

    @property
    def quantized(self) -> bool:
        return self.k.kind not in FLOAT_TYPES or self.v.kind not in FLOAT_TYPES

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: (T, n_kv, head_dim) written at slots (T,) (a device tensor: no host value needed), each
        quantized once to its plane's type."""
        for plane, x in ((self.k, k), (self.v, v)):
            for field, new in zip(plane.fields, quantize(x, plane.kind).fields, strict=True):
                field.index_copy_(1, slots, new.transpose(0, 1))

    def write_rotated(
        self, slots: torch.Tensor, q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, cos, sin,
        norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> torch.Tensor | None:  # fmt: skip
        """RoPE on q (T, heads, hd) and k, then k and v written at slots; returns the rotated q (None
        without q). norms (q's weight, k's, eps): q and k RMSNorm-ed per head before. On the GPU one
        Triton launch (kernels/rotary.py) computes the same bits as the torch path's four (six), and
        quantizes k and v as `quantize` does."""
        fits = (q is None or rotary_kernel_fits(q, cos)) and rotary_kernel_fits(k, cos) and v.stride(-1) == 1
        if fits and all(p.kind not in FLOAT_TYPES or p.data.dtype == k.dtype for p in (self.k, self.v)):
            from flashtree.kernels.rotary import rotary_store

            return rotary_store(q, k, v, cos, sin, self.k, self.v, slots, norms)
        if norms is not None:
            q_weight, k_weight, eps = norms
            q = None if q is None else rms_norm(q, q_weight, eps)
            k = rms_norm(k, k_weight, eps)
        self.write(slots, apply_rotary(k, cos, sin), v)
        return None if q is None else apply_rotary(q, cos, sin)

    def read(self, n_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of slots [0, n_keys): (n_kv, n_keys, head_dim) each, as stored for a float cache, else
        dequantized to fp32 (tq3_0's still rotated)."""
        k, v = (p.map(lambda f: f[:, :n_keys]) for p in (self.k, self.v))
        if not self.quantized:
            return k.data, v.data
        return dequantize(k), dequantize(v)

    def attend(self, q: torch.Tensor, n_keys: int, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        """softmax(q K^T * scale) V over slots [0, n_keys) by SDPA (q (T, heads, hd); mask (T, n_keys)
        bool or None), the reference path. A quantized cache is dequantized one layer at a time (the
        CPU's memory, not the GPU's: its kernels read the planes) and attended in its own domain: q
        rotated for a tq3_0 K, the output rotated back for a tq3_0 V."""
        keys, values = self.read(n_keys)  # (n_kv, S, hd)
        return self._sdpa(q, keys, values, mask, scale)

    def attend_each_row(
        self, q: torch.Tensor, start: int, ancestors: list[list[int]], scale: float, window: int = 0
    ) -> torch.Tensor:
        """`attend` of each row of q (T, heads, hd) alone, over exactly the keys its AR step reads: slots
        [0, start), then the block slots of its ancestors and itself (ancestors[i], root first), their last
        `window` if window > 0. SDPA's bits for a row depend on the number of rows and on masked keys, so
        the AR step (T = 1) and a verify row make the same one-row call over the same keys. A row off the
        block's first chain reads its path's K/V from a copy, in the slots its commit moves them to."""
        keys, values = self.read(start + q.shape[0])  # (n_kv, S, hd)
        copies = None
        rows = []
        for i, path in enumerate(ancestors):
            end = start + len(path)
            k, v = keys, values
            if path != list(range(len(path))):
                copies = copies or (keys.clone(), values.clone())
                k, v = copies
                slots = torch.tensor(path, device=q.device) + start
                k[:, start:end], v[:, start:end] = keys[:, slots], values[:, slots]
            first = max(0, end - window) if window else 0
            rows.append(self._sdpa(q[i : i + 1], k[:, first:end], v[:, first:end], None, scale))
        return torch.cat(rows)

    def _sdpa(self, q, keys, values, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        """SDPA of q (T, heads, hd) over keys and values read from this cache (n_kv, S, hd), in the cache's
        domain: q rotated for a tq3_0 K, the output rotated back for a tq3_0 V."""
        query = rotate(q) if self.k.kind == "tq3_0" else q
        if not query.dtype == keys.dtype == values.dtype:  # a cache in another type than the model's
            query, keys, values = query.float(), keys.float(), values.float()
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask, scale=scale,
            enable_gqa=True,
        )[0].transpose(0, 1)  # fmt: skip
        return (unrotate(out) if self.v.kind == "tq3_0" else out).to(q.dtype)


class KVStore:
    """K/V of every attention layer of one shape, preallocated for `max_ctx` tokens as two planes
    (quant/kv.py: K's type, V's), each field (layers, n_kv, max_ctx, ...): a speculative step's commit
    moves the accepted slots of all layers in one gather and one scatter per field."""

    def __init__(
        self, n_layers: int, n_kv: int, max_ctx: int, head_dim: int, dtype: torch.dtype, device,
        kinds: tuple[str | None, str | None] = (None, None),
    ):  # fmt: skip
        lead = (n_layers, n_kv, max_ctx)
        self.k, self.v = (empty_plane(resolve_kv_type(kind, dtype), lead, head_dim, device) for kind in kinds)

    def layer(self, i: int) -> KVCache:
        return KVCache(self.k.map(lambda f: f[i]), self.v.map(lambda f: f[i]))

    def commit(self, plan: CommitPlan) -> None:
        """Keep the accepted nodes: move slots src[i] to dst[i] in every layer and field (src is
        increasing and src >= dst, and the gather completes before the scatter)."""
        src, dst = plan.src, plan.dst
        for field in (*self.k.fields, *self.v.fields):
            field[:, :, dst] = field[:, :, src]

    def reset(self) -> None:
        """Nothing to clear: slots past the committed length are never read."""


class DeltaNetPending(NamedTuple):
    """What a verify forward of T tokens keeps for its commit, every layer of a DeltaNetStore at once,
    and the scratch its tree walks share."""

    conv_out: torch.Tensor  # (layers, T, channels) fp32: each token's conv output (q | k | v)
    gates: torch.Tensor  # (layers, T, 2, heads) fp32: each token's decay and beta, as the walk used them
    windows: torch.Tensor  # (layers, T, kernel - 1, channels): the conv window after each token
    scratch: torch.Tensor  # (T, heads, k, v) fp32: the state after each token, one layer at a time

    def layer(self, i: int) -> DeltaNetPending:
        return DeltaNetPending(self.conv_out[i], self.gates[i], self.windows[i], self.scratch)


class DeltaNetState:
    """Recurrent state (fp32) and causal-conv window of one Gated DeltaNet layer: views into a
    DeltaNetStore, as is what a verify forward keeps pending."""

    def __init__(self, store: DeltaNetStore, index: int):
        self.store, self.index = store, index
        self.recurrent = store.recurrent[index]  # (heads, k, v) fp32
        self.conv = store.conv[index]  # (kernel - 1, channels)

    def pending(self, t: int) -> DeltaNetPending:
        """Where a verify forward of t tokens leaves this layer's pending inputs (DeltaNetPending)."""
        return self.store.pending_buffers(t).layer(self.index)


class DeltaNetStore:
    """State of every Gated DeltaNet layer of one shape in two tensors (layers, ...), and what a verify
    forward keeps pending likewise: a speculative step's commit rebuilds every layer's state in one
    launch (`replay_accepted`) and adopts the accepted node's conv window with one gather and one copy."""

    def __init__(
        self, n_layers: int, heads: int, k_dim: int, v_dim: int, channels: int, kernel: int, n_k_heads: int,
        dtype, device, tile: tuple[int, int],
    ):  # fmt: skip
        self.tile = tile  # the tree DeltaNet kernel's (BV, warps): its commit replays with the verify's
        self.recurrent = torch.zeros(n_layers, heads, k_dim, v_dim, dtype=torch.float32, device=device)
        self.conv = torch.zeros(n_layers, kernel - 1, channels, dtype=dtype, device=device)
        self.n_k_heads = n_k_heads
        self.pending: DeltaNetPending | None = None

    def layer(self, i: int) -> DeltaNetState:
        return DeltaNetState(self, i)

    @staticmethod
    def pending_bytes(
        n_layers: int, heads: int, k_dim: int, v_dim: int, channels: int, kernel: int, elem: int, t: int
    ) -> int:
        """Bytes `pending_buffers(t)` allocates (DeltaNetPending's fields)."""
        per_layer = t * (channels * 4 + 2 * heads * 4 + (kernel - 1) * channels * elem)
        return n_layers * per_layer + t * heads * k_dim * v_dim * 4

    def pending_buffers(self, t: int) -> DeltaNetPending:
        """The pending buffers for a t-token verify, allocated by its first layer."""
        if self.pending is None or self.pending.scratch.shape[0] != t:
            n, heads, k_dim, v_dim = self.recurrent.shape
            self.pending = DeltaNetPending(  # fp32 like the recurrent state, the windows like the conv's
                self.recurrent.new_empty(n, t, self.conv.shape[2]),
                self.recurrent.new_empty(n, t, 2, heads),
                self.conv.new_empty(n, t, *self.conv.shape[1:]),
                self.recurrent.new_empty(t, heads, k_dim, v_dim),
            )
        return self.pending

    def commit(self, plan: CommitPlan) -> None:
        """Adopt the state after the accepted tokens: replayed from the committed state (every layer, on
        the device), and the conv window after the deepest accepted node (index_select: indexing with a
        device scalar would read it back to the host)."""
        p = self.pending
        if p is None:
            raise RuntimeError("commit_path without a pending verify forward")
        replay_accepted(p.conv_out, p.gates, plan.path, plan.n, self.recurrent, self.n_k_heads, self.tile)
        self.conv.copy_(p.windows.index_select(1, plan.last)[:, 0])
        self.pending = None

    def reset(self) -> None:
        self.recurrent.zero_()
        self.conv.zero_()
        self.pending = None


class ModelState:
    """Everything one sequence needs between forwards: `seq_len` committed tokens plus layer state.

    The committed length lives twice: `position` on the device, which every forward reads (RoPE
    positions, KV slots, masks) and a committing forward or `commit_path` advances (also when replayed
    from a CUDA graph); and `seq_len` on the host (room checks, KV read lengths), which only `advance`
    moves: the sequence's owner calls it with what a forward wrote or a step's read-back says it kept.
    Step code never touches the host count, so a replayed step and an eager one need the same books."""

    def __init__(
        self,
        layers: list[KVCache | DeltaNetState],
        stores: list[KVStore | DeltaNetStore],
        max_ctx: int,
        device,
    ):
        self.layers = layers  # per model layer: views into the stores
        self.stores = stores
        self.max_ctx = max_ctx
        self.seq_len = 0
        self.position = torch.zeros((), dtype=torch.long, device=device)

    @property
    def rewindable(self) -> bool:
        """Attention-only state can be truncated to any length; recurrent state cannot."""
        return not any(isinstance(s, DeltaNetState) for s in self.layers)

    def check_room(self, n: int) -> None:
        if self.seq_len + n > self.max_ctx:
            raise FlashtreeError(
                f"context full: {self.seq_len} + {n} tokens exceed the allocated {self.max_ctx}"
                " (raise --max-ctx)"
            )

    def advance(self, n: int) -> None:
        """The host's count of committed tokens, after a forward or a step committed n (device side)."""
        self.seq_len += n

    def commit_path(self, path: torch.Tensor, n: torch.Tensor) -> None:
        """Keep block tokens path[:n] (increasing indices, root first) of the last commit=False forward.

        path: (T',) on the device, the n accepted block indices first (a decode step passes every block
        index, so its shape is fixed); n: 0-d device tensor. Device work only (CUDA-graph safe): the
        caller calls advance(n) once it has read n back."""
        idx = torch.arange(path.shape[0], device=path.device)
        # Slot i takes accepted node path[i] for i < n; later slots are copied onto themselves (their
        # content is garbage either way), which keeps the shape fixed. src >= dst, so a gather is safe.
        src = self.position + torch.where(idx < n, path, idx)
        dst = self.position + idx
        last = path.gather(0, (n - 1).view(1))  # (1,): the deepest accepted node
        plan = CommitPlan(path, n.view(1), last, src, dst)
        for store in self.stores:
            store.commit(plan)
        self.position += n

    def truncate(self, length: int) -> None:
        if length == self.seq_len:
            return
        if not self.rewindable or length > self.seq_len:
            raise FlashtreeError(f"cannot rewind this state from {self.seq_len} to {length} tokens")
        self.seq_len = length
        self.position.fill_(length)

    def reset(self) -> None:
        self.seq_len = 0
        self.position.zero_()
        for store in self.stores:
            store.reset()
