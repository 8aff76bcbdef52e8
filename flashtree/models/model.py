"""The decoder stack shared by every family: embed -> [mixer + SwiGLU] x L -> norm -> LM head."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from flashtree.kernels.qmatmul import MatmulInput
from flashtree.kernels.tiles import DEFAULT_KERNELS
from flashtree.models.attention import Attention
from flashtree.models.block import BlockLayout
from flashtree.models.config import ModelConfig
from flashtree.models.deltanet import GatedDeltaNet
from flashtree.models.layers import Linear, RMSNorm, Rotary, SwiGLU, add_rms_norm
from flashtree.models.pass_ import ForwardPass
from flashtree.models.state import DeltaNetState, DeltaNetStore, KVCache, KVStore, ModelState
from flashtree.quant.kv import check_kv_type, resolve_kv_type, vector_bytes


class DecoderLayer(nn.Module):
    def __init__(self, mixer: Attention | GatedDeltaNet, mlp: SwiGLU, mixer_norm: RMSNorm, mlp_norm: RMSNorm):
        super().__init__()
        self.mixer, self.mlp, self.mixer_norm, self.mlp_norm = mixer, mlp, mixer_norm, mlp_norm

    def forward(
        self, x: torch.Tensor, pending: torch.Tensor | None, state: KVCache | DeltaNetState, fp: ForwardPass
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's input is x + pending (pending None: x): the previous layer's MLP output joins the
        residual stream inside this layer's first RMSNorm (one fused launch, kernels/fused.py, or none:
        the matmul after it makes it, MergedLinear.defers_norm), not in an add of its own. Returns (the
        input, the residual after the mixer, the MLP output to add)."""
        proj = self.mixer.input_projection
        int8 = proj.takes_int8  # whether the norms make its int8 input too
        if pending is None:
            normed = self.mixer_norm.matmul_input(x, int8, proj.defers_norm(x))
        else:
            x, normed = add_rms_norm(x, pending, *self.mixer_norm.args, int8, proj.defers_norm(x))
        out = self.mixer(normed, state, fp)
        defer = self.mlp.gate_up.defers_norm(out)
        h, normed = add_rms_norm(x, out, *self.mlp_norm.args, self.mlp.takes_int8, defer)
        return x, h, self.mlp(normed)


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # (T or 1, vocab) fp32
    features: torch.Tensor | None  # (T, n_capture * hidden): hidden state after each captured layer


class DecoderModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        embedding: torch.Tensor | nn.Module,  # (vocab, hidden)
        layers: list[DecoderLayer],
        norm: RMSNorm,
        lm_head: Linear,
        rotary: Rotary,
    ):
        super().__init__()
        self.config = config
        # a dense table, or a PackedEmbedding (models/layers.py) that decodes the rows it is indexed by
        self.embedding = embedding if isinstance(embedding, nn.Module) else nn.Parameter(embedding, False)
        self.layers = nn.ModuleList(layers)
        self.norm, self.lm_head, self.rotary = norm, lm_head, rotary
        self.kernels = DEFAULT_KERNELS  # models.layers.use_kernels
        self.kv_types: tuple[str | None, str | None] = (None, None)  # K's, V's (`set_kv_types`)

    @property
    def device(self) -> torch.device:
        return self.embedding.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding.dtype

    def new_state(self, max_ctx: int) -> ModelState:
        """The layers' state, in one store per kind and shape (every model here has one of each kind):
        each layer's state is a slice of its store, so a commit touches all layers at once."""
        dev, dt = self.device, self.dtype
        shapes = [self._state_shape(m) for m in self.mixers]
        stores: dict[tuple, KVStore | DeltaNetStore] = {}
        for shape in dict.fromkeys(shapes):  # first-seen order
            n_layers = shapes.count(shape)
            if shape[0] == "kv":
                stores[shape] = KVStore(n_layers, shape[1], max_ctx, shape[2], dt, dev, self.kv_types)
            else:
                stores[shape] = DeltaNetStore(n_layers, *shape[1:], dt, dev, self.kernels.delta_tile)
        taken: Counter = Counter()
        states: list[KVCache | DeltaNetState] = []
        for shape in shapes:
            states.append(stores[shape].layer(taken[shape]))
            taken[shape] += 1
        return ModelState(states, list(stores.values()), max_ctx, dev)

    @staticmethod
    def _state_shape(m: nn.Module) -> tuple:
        if isinstance(m, Attention):
            return ("kv", m.n_kv_heads, m.head_dim)
        return ("deltanet", m.n_v_heads, m.k_dim, m.v_dim, m.conv_weight.shape[0], m.kernel, m.n_k_heads)

    @property
    def mixers(self) -> list[nn.Module]:
        """Each layer's attention or Gated DeltaNet."""
        return [layer.mixer for layer in self.layers]

    def set_kv_types(self, k: str | None, v: str | None) -> None:
        """The KV cache types (quant/kv.py) of the states `new_state` makes from now on, K's and V's (None:
        the compute dtype's); a FlashtreeError if a type cannot hold this model's heads."""
        for kind in (k, v):
            for m in self.mixers:
                if kind is not None and isinstance(m, Attention):
                    check_kv_type(kind, m.head_dim)
        self.kv_types = (k, v)

    @property
    def resolved_kv_types(self) -> tuple[str, str]:
        """The KV cache types `new_state` allocates, K's and V's."""
        k, v = self.kv_types
        return resolve_kv_type(k, self.dtype), resolve_kv_type(v, self.dtype)

    def state_bytes(self, max_ctx: int) -> int:
        """Bytes `new_state(max_ctx)` allocates: KV slots (every field of their types) plus fixed DeltaNet
        and conv state."""
        elem = self.dtype.itemsize
        kinds = self.resolved_kv_types
        total = 0
        for m in self.mixers:
            if isinstance(m, Attention):
                total += m.n_kv_heads * max_ctx * sum(vector_bytes(kind, m.head_dim) for kind in kinds)
            else:
                total += m.n_v_heads * m.k_dim * m.v_dim * 4 + (m.kernel - 1) * m.conv_weight.shape[0] * elem
        return total

    def pending_bytes(self, tokens: int) -> int:
        """Bytes a `tokens`-token verify forward allocates for what its Gated DeltaNet layers keep
        pending until the commit (DeltaNetStore.pending_buffers): 186 MB at the 27B's 23 nodes, which
        the memory plan must leave free next to the context."""
        shapes = [self._state_shape(m) for m in self.mixers if not isinstance(m, Attention)]
        return sum(
            DeltaNetStore.pending_bytes(shapes.count(shape), *shape[1:6], self.dtype.itemsize, tokens)
            for shape in dict.fromkeys(shapes)
        )

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding[tokens]

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,  # (T,) long
        state: ModelState,
        layout: BlockLayout | None = None,
        commit: bool = True,
        logits: str = "all",  # "all" | "last" | "none"
        capture: tuple[int, ...] = (),
        n_keys: int | None = None,
        window: int = 0,
    ) -> ForwardOutput:
        """n_keys: KV slots attention reads (default exactly seq_len + T; a CUDA-graph step passes a
        fixed bucket at least that large, so its shapes do not change from step to step). window > 0:
        each row attends to its last `window` positions only (--attn-window: the decode steps pass it,
        prefill does not). A committing forward advances the state's device position; its caller then
        calls state.advance(T)."""
        t = tokens.shape[0]
        layout = layout if layout is not None else BlockLayout.chain(t, tokens.device)
        state.check_room(t)
        exact = n_keys is None
        n_keys = state.seq_len + t if exact else n_keys
        fp = ForwardPass(state.position, n_keys, exact, layout, commit, self.rotary, self.dtype, window)
        x, pending = self.embed(tokens), None
        captured = {}
        for i, layer in enumerate(self.layers):
            layer_input, x, pending = layer(x, pending, state.layers[i], fp)
            if i - 1 in capture:
                captured[i - 1] = layer_input  # layer i - 1's output
        if commit:  # the device's count; the host's is the caller's (ModelState.advance)
            state.position += t
        last, head = len(self.layers) - 1, None
        if logits == "none":
            if last in capture:
                captured[last] = x + pending
        else:  # the last layer's MLP output joins the stream inside the final norm: one launch
            rows = slice(None) if logits == "all" or last in capture else slice(-1, None)
            out, normed = add_rms_norm(x[rows], pending[rows], *self.norm.args, self.lm_head.takes_int8)
            if last in capture:
                captured[last] = out
            head = normed if logits == "all" or normed.x.shape[0] == 1 else MatmulInput(normed.x[-1:])
        feats = torch.cat([captured[i] for i in capture], dim=-1) if capture else None
        return ForwardOutput(None if head is None else self.lm_head(head).float(), feats)
