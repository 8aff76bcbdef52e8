"""DFlash draft: a small non-causal transformer that fills a whole block in one pass.

Block = [last committed token, MASK x (B-1)]. Target hidden states of committed tokens (after the
layers in `target_layer_ids`) are fused by `fc` + `hidden_norm` into one context vector per
position, which every draft layer sees as extra keys/values. Block position j predicts the token
*at* position start + j (same-position prediction). The draft shares the target's embedding and
LM head. Context K/V depend only on committed features, so they live in an incremental ring cache.

Formats: z-lab dirs (config.json + model.safetensors) and GGUF, in llama.cpp's layout (arch `dflash`,
written by `flashtree convert` and by llama.cpp's converter) or flashtree's older one (arch
`dflash-draft`), all read into the same GGUF-style tensor names (models/config.py says how the layouts
differ).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from flashtree import kernels
from flashtree.errors import FlashtreeError
from flashtree.kernels import fp8
from flashtree.models.config import (
    DRAFT_GGUF_ARCHS,
    LLAMA_DRAFT_ARCH,
    LLAMA_DRAFT_TENSORS,
    SLIDING,
    DraftConfig,
    ModelConfig,
)
from flashtree.models.layers import (
    Fp8Linear,
    Linear,
    MergedLinear,
    RMSNorm,
    Rotary,
    SwiGLU,
    add_rms_norm,
    apply_rotary,
    grouped_attention,
    rms_norm,
)
from flashtree.models.loader import check_tensors, copy_rows
from flashtree.models.model import DecoderModel
from flashtree.models.state import KVCache


def check_fits(cfg: DraftConfig, target: DecoderModel, source: Path) -> None:
    """Refuse a draft built for another target, naming the mismatch."""
    tc = target.config
    problems = []
    if cfg.hidden != tc.hidden:
        problems.append(f"hidden size {cfg.hidden} != target's {tc.hidden}")
    if cfg.vocab != tc.vocab:
        problems.append(f"vocab {cfg.vocab} != target's {tc.vocab}")
    if not 0 <= cfg.mask_token_id < tc.vocab:
        problems.append(f"mask_token_id {cfg.mask_token_id} outside the target vocab of {tc.vocab}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < tc.n_layers]
    if bad:
        problems.append(f"target_layer_ids {list(bad)} outside the target's {tc.n_layers} layers")
    if cfg.n_target_layers is not None and cfg.n_target_layers != tc.n_layers:
        problems.append(f"num_target_layers {cfg.n_target_layers} != target's {tc.n_layers} layers")
    if problems:
        raise FlashtreeError(f"{source}: draft does not fit target {tc.name!r}: " + "; ".join(problems))


class RingRead(NamedTuple):
    """What a draft layer reads and writes of the context ring in `propose`."""

    cache: KVCache  # the layer's ring K/V, (n_kv, slots + block scratch, hd)
    read: int  # the first `read` slots are the context attended to
    block_at: int  # the block's K/V are written at slots block_at.. (the scratch past the ring)
    block_slots: torch.Tensor  # (max block,) long: block_at, block_at + 1, ...


class DraftTensors:
    """A draft's tensors as its layers take them: each put on `device` in `dtype` when asked for (the rows
    of several stacked into one tensor, as a merged matmul holds them), a chunk of rows at a time
    (loader.copy_rows): building the draft never holds a tensor twice on the device. On `meta` nothing
    is copied: the memory plan's build (flashtree/engine/plan.py)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], device: torch.device, dtype: torch.dtype):
        self.tensors, self.device, self.dtype = tensors, torch.device(device), dtype

    @staticmethod
    def of(tensors: Mapping[str, torch.Tensor] | DraftTensors) -> DraftTensors:
        """`tensors` as they are (a plain mapping keeps its tensors' device and dtype: fc's)."""
        if isinstance(tensors, DraftTensors):
            return tensors
        fc = tensors["fc.weight"]
        return DraftTensors(tensors, fc.device, fc.dtype)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.stacked([name])

    def stacked(self, names: list[str]) -> torch.Tensor:
        parts = [self.tensors[name] for name in names]
        rows = sum(p.shape[0] for p in parts)
        out = torch.empty((rows, *parts[0].shape[1:]), dtype=self.dtype, device=self.device)
        if self.device.type != "meta":
            at = 0
            for part in parts:
                copy_rows(out[at : at + part.shape[0]], part.detach())
                at += part.shape[0]
        return out

    def merged(self, names: list[str], matrix: type[nn.Module]) -> MergedLinear:
        """Matrices `names` (same input) as one matmul of `matrix` (Linear or Fp8Linear)."""
        sizes = [self.tensors[name].shape[0] for name in names]
        return MergedLinear([matrix(self.stacked(names))], [0] * len(names), sizes)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig, t: DraftTensors, i: int, matrix: type[nn.Module] = Linear):
        """matrix: the module every weight matrix becomes (Linear, or Fp8Linear: see DFlashDraft)."""
        super().__init__()
        p = f"blk.{i}"
        self.q, self.o = matrix(t[f"{p}.attn_q.weight"]), matrix(t[f"{p}.attn_output.weight"])
        # K and V in one matmul; Q apart: the context features need no queries
        self.kv = t.merged([f"{p}.attn_k.weight", f"{p}.attn_v.weight"], matrix)
        self.k, self.v = self.kv.parts
        self.q_norm = nn.Parameter(t[f"{p}.attn_q_norm.weight"].float(), requires_grad=False)
        self.k_norm = nn.Parameter(t[f"{p}.attn_k_norm.weight"].float(), requires_grad=False)
        self.attn_norm = RMSNorm(t[f"{p}.attn_norm.weight"].float(), cfg.rms_eps)
        self.mlp_norm = RMSNorm(t[f"{p}.ffn_norm.weight"].float(), cfg.rms_eps)
        gate_up = t.merged([f"{p}.ffn_gate.weight", f"{p}.ffn_up.weight"], matrix)
        self.mlp = SwiGLU(gate_up, matrix(t[f"{p}.ffn_down.weight"]))
        self.window = cfg.sliding_window if cfg.layer_types[i] == SLIDING else None
        self.n_heads, self.n_kv_heads, self.head_dim, self.eps = (
            cfg.n_heads,
            cfg.n_kv_heads,
            cfg.head_dim,
            cfg.rms_eps,
        )

    @property
    def qk_norms(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(q's norm weight, k's, eps): what KVCache.write_rotated norms q and k by, in RoPE's launch."""
        return self.q_norm, self.k_norm, self.eps

    def raw_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (not normed) and V of inputs x (T, H): (T, n_kv, hd) each. Same weights for the fused target
        context and the block tokens."""
        t = x.shape[0]
        k, v = (y.view(t, self.n_kv_heads, self.head_dim) for y in self.kv(x))
        return k, v

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """K (normed, rotated) and V of inputs x (T, H): (T, n_kv, hd) each."""
        k, v = self.raw_kv(x)
        return apply_rotary(rms_norm(k, self.k_norm, self.eps), cos, sin), v

    def forward(self, x, cos, sin, ring: RingRead, ctx_mask):
        """x: (B, H) block; ring: the layer's context K/V and where the block's go; ctx_mask: (B, read)
        bool or None, its rows all alike unless the layer has a sliding window (as `propose` builds it)."""
        b = x.shape[0]
        xn = self.attn_norm(x)
        q = self.q(xn).view(b, self.n_heads, self.head_dim)
        k, v = self.raw_kv(xn)
        scale = self.head_dim**-0.5
        if ctx_mask is not None and kernels.triton_kernels_for(q) and not q.requires_grad:
            # our kernel, not SDPA's (slow in fp32; with a window, after two copies of the context); the
            # block's normed, rotated K/V go to the ring in the rotary's launch, not into a copy of the
            # context
            from flashtree.kernels.attention import block_attention

            q = ring.cache.write_rotated(ring.block_slots[:b], q, k, v, cos, sin, self.qk_norms)
            out = block_attention(q, ring.cache.k, ring.cache.v, ctx_mask, scale, ring.block_at)
            out = out.reshape(b, -1)
        else:
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            keys = torch.cat(
                [ring.cache.k.data[:, : ring.read], k.transpose(0, 1)], dim=1
            )  # (n_kv, read + B, hd)
            values = torch.cat([ring.cache.v.data[:, : ring.read], v.transpose(0, 1)], dim=1)
            mask = None
            if ctx_mask is not None:  # the block always sees itself, in both directions
                mask = torch.cat([ctx_mask, ctx_mask.new_ones(b, b)], dim=1)
            out = grouped_attention(q.transpose(0, 1)[None], keys[None], values[None], mask, scale)
            out = out[0].transpose(0, 1).reshape(b, -1)
        out = self.o(out)
        h, normed = add_rms_norm(x, out, *self.mlp_norm.args, defer=self.mlp.gate_up.defers_norm(out))
        return h + self.mlp(normed)  # h is made by then (a deferred norm's matmul writes it)


class DraftContext:
    """Ring of per-layer context K/V over the last `size` committed positions.

    The ring has `spare` extra slots: a decode step appends a fixed number of feature rows (the whole
    verify block, padded) of which only the accepted ones count, and the padding must land in slots
    outside the live window. A slot is live iff the position it holds is among the last `size`
    before `position` (the committed length, on the device). Past the ring, `block` scratch slots take
    the K/V of the block being drafted (blocks of up to `block` tokens)."""

    def __init__(self, draft: DFlashDraft, size: int, spare: int = 0, block: int | None = None):
        c = draft.config
        dev, dt = draft.device, draft.dtype
        self.size = size
        slots = size + spare
        self.block = block or c.block_size
        self.k = torch.zeros(c.n_layers, c.n_kv_heads, slots + self.block, c.head_dim, dtype=dt, device=dev)
        self.v = torch.zeros_like(self.k)
        self.slot_pos = torch.full((slots,), -1, dtype=torch.long, device=dev)  # position held by each slot
        self.position = torch.zeros((), dtype=torch.long, device=dev)  # committed positions seen so far
        self.block_slots = torch.arange(slots, slots + self.block, device=dev)

    def layer(self, i: int) -> KVCache:
        return KVCache(self.k[i], self.v[i])

    def reset(self) -> None:
        self.slot_pos.fill_(-1)
        self.position.zero_()

    def live(self) -> torch.Tensor:
        """(slots,) bool: slots holding one of the last `size` committed positions."""
        return (
            (self.slot_pos >= 0)
            & (self.slot_pos < self.position)
            & (self.slot_pos >= self.position - self.size)
        )


class DFlashDraft(nn.Module):
    def __init__(
        self,
        cfg: DraftConfig,
        tensors: Mapping[str, torch.Tensor] | DraftTensors,
        target: DecoderModel,
        fp8_mode: str = "off",
    ):
        """fp8_mode (fp8.MODES): "matrices" puts every weight matrix in fp8, "all" a copy of the target's LM
        head too (kernels/fp8.py): fewer bytes a step reads; the draft's arithmetic changes what it
        proposes, never what is emitted."""
        super().__init__()
        self.config = cfg
        tensors = DraftTensors.of(tensors)
        fc = tensors["fc.weight"]
        self.dtype, self.fp8_mode = fc.dtype, fp8_mode  # the activations' dtype, fixed at construction
        matrix = Linear if fp8_mode == "off" else Fp8Linear
        self.fc = matrix(fc)
        self.hidden_norm = RMSNorm(tensors["hidden_norm.weight"].float(), cfg.rms_eps)
        self.norm = RMSNorm(tensors["output_norm.weight"].float(), cfg.rms_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg, tensors, i, matrix) for i in range(cfg.n_layers))
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta).to(fc.device)
        self._target = [target]  # shared embedding + LM head; a list keeps it out of our parameters
        self.head = Fp8Linear(target.lm_head) if fp8_mode == "all" else None  # the shared head, rounded once

    @property
    def target(self) -> DecoderModel:
        return self._target[0]

    @property
    def device(self) -> torch.device:
        return self.hidden_norm.weight.device

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of the draft's final states h (rows of the target's dtype), in fp32: the target's LM
        head, or its fp8 copy."""
        head = self.target.lm_head if self.head is None else self.head
        return head(h).float()

    def new_context(self, size: int, spare: int = 0, block: int | None = None) -> DraftContext:
        return DraftContext(self, size, spare, block)

    @torch.inference_mode()
    def append_context(
        self, ctx: DraftContext, features: torch.Tensor, n: torch.Tensor | None = None
    ) -> None:
        """Add target features (T, n_feat * H) of the next committed positions to the ring. With n
        (0-d, on the device) only the first n rows are committed positions; the rest is padding that
        keeps the shape fixed (it lands in spare slots and is never live)."""
        t_all = features.shape[0]
        if n is None:
            features = features[-ctx.size :]  # older positions would be overwritten anyway
        t = features.shape[0]
        positions = ctx.position + (t_all - t) + torch.arange(t, device=self.device)
        fused = self.hidden_norm(self.fc(features.to(self.dtype)))  # (T, H)
        cos, sin = self.rotary.cos_sin(positions, self.dtype)
        slots = positions % ctx.slot_pos.shape[0]
        for i, layer in enumerate(self.layers):  # K normed and rotated, K/V stored: one launch on the GPU
            ctx.layer(i).write_rotated(slots, None, *layer.raw_kv(fused), cos, sin, layer.qk_norms)
        ctx.slot_pos.index_copy_(0, slots, positions)
        ctx.position += t_all if n is None else n

    @torch.inference_mode()
    def propose(
        self, ctx: DraftContext, root: torch.Tensor, block_size: int, n_keys: int | None = None
    ) -> torch.Tensor:
        """Draft logits (block_size - 1, vocab) fp32 for the positions after `root` (0-d long on the
        device), which sits at position ctx.position (the first one the target has not processed).

        n_keys: a bound above every committed position (the target's KV read bucket). Position p sits in
        ring slot p % slots, so with n_keys <= slots the live slots all lie below n_keys and only those
        are read: attention over the ring's first n_keys slots, not all draft_ctx + spare of them."""
        n_slots = ctx.slot_pos.shape[0]
        read = n_slots if n_keys is None else min(n_keys, n_slots)
        if block_size > ctx.block:
            raise FlashtreeError(f"a draft block of {block_size} tokens: the context takes up to {ctx.block}")
        cfg = self.config
        masks = torch.full((block_size - 1,), cfg.mask_token_id, dtype=torch.long, device=self.device)
        ids = torch.cat([root.view(1), masks])
        positions = ctx.position + torch.arange(block_size, device=self.device)
        x = self.target.embed(ids).to(self.dtype)
        cos, sin = self.rotary.cos_sin(positions, self.dtype)
        live = ctx.live()[:read][None, :].expand(block_size, -1)  # (B, S), every row alike
        masks = {None: live}  # by window, made once a step: the sliding layers share theirs
        for window in {layer.window for layer in self.layers} - {None}:
            masks[window] = live & (positions[:, None] - ctx.slot_pos[None, :read] < window)
        for i, layer in enumerate(self.layers):
            ring = RingRead(ctx.layer(i), read, n_slots, ctx.block_slots)
            x = layer(x, cos, sin, ring, masks[layer.window])
        return self.lm_head(self.norm(x[1:]).to(self.target.dtype))


class _DraftFile(NamedTuple):
    """A draft's config and tensor shapes (GGUF names), and how to read its tensors once both are checked."""

    config: DraftConfig
    source: Path  # the file holding the tensors, for messages
    shapes: dict[str, tuple[int, ...]]
    read: Callable[[], dict[str, torch.Tensor]]


def _zlab_tensors(path: Path) -> _DraftFile:
    from safetensors import safe_open

    cfg_path, st_path = path / "config.json", path / "model.safetensors"
    for f in (cfg_path, st_path):
        if not f.exists():
            raise FlashtreeError(f"{path}: not a DFlash draft directory (missing {f.name})")
    try:
        cfg = ModelConfig.from_hf_config(json.loads(cfg_path.read_text()), cfg_path)
    except json.JSONDecodeError as e:
        raise FlashtreeError(f"{cfg_path}: invalid JSON ({e})") from None
    if not isinstance(cfg, DraftConfig):
        raise FlashtreeError(f"{cfg_path}: not a DFlash draft config (architecture {cfg.arch!r})")
    try:  # the header now, each tensor when read
        raw = safe_open(str(st_path), "pt")
        stored = set(raw.keys())
    except Exception as e:  # safetensors raises several types for damaged files
        raise FlashtreeError(f"{st_path}: cannot read safetensors ({e})") from None
    names = {
        "fc.weight": "fc.weight",
        "hidden_norm.weight": "hidden_norm.weight",
        "norm.weight": "output_norm.weight",
    }
    per_layer = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    for i in range(cfg.n_layers):
        for hf, gg in per_layer.items():
            names[f"layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    missing = [n for n in names if n not in stored]
    if missing:
        raise FlashtreeError(f"{st_path}: missing draft tensor(s) {', '.join(missing[:3])}")
    shapes = {gg: tuple(raw.get_slice(hf).get_shape()) for hf, gg in names.items()}
    return _DraftFile(cfg, st_path, shapes, lambda: {gg: raw.get_tensor(hf) for hf, gg in names.items()})


def _gguf_tensors(path: Path) -> _DraftFile:
    from flashtree.gguf.reader import open_gguf

    g = open_gguf(path)
    if g.arch not in DRAFT_GGUF_ARCHS:
        raise FlashtreeError(
            f"{path}: architecture {g.arch!r} is not a DFlash draft ({' or '.join(DRAFT_GGUF_ARCHS)})"
        )
    ours = {v: k for k, v in LLAMA_DRAFT_TENSORS.items()} if g.arch == LLAMA_DRAFT_ARCH else {}
    names = {ours.get(name, name): name for name in g.tensors}  # our name -> the file's
    shapes = {name: g.tensors[stored].shape for name, stored in names.items()}
    read = lambda: {name: g.tensor(stored) for name, stored in names.items()}  # noqa: E731
    return _DraftFile(ModelConfig.from_gguf(g), path, shapes, read)


def open_draft(path: str | Path, target: DecoderModel) -> _DraftFile:
    """A z-lab draft dir's or a draft GGUF's config and tensor shapes, checked against `target` and
    its config: no weight is read."""
    path = Path(path)
    if not path.exists():
        raise FlashtreeError(f"{path}: draft not found")
    draft = _zlab_tensors(path) if path.is_dir() else _gguf_tensors(path)
    check_fits(draft.config, target, path)
    check_tensors(draft.shapes, draft.config, draft.source)
    return draft


def load_draft(path: str | Path, target: DecoderModel, fp8_mode: str = "off") -> DFlashDraft:
    """Load a z-lab draft dir or a draft GGUF, check it fits `target` and holds the tensors its config
    implies, and build it next to it, in fp8 as fp8_mode says (fp8.MODES; Settings.draft_fp8)."""
    cfg, _, _, read = open_draft(path, target)
    path = Path(path)
    tensors = read()
    fp8_mode = _fp8_mode(fp8_mode, cfg, tensors, target, path)
    return DFlashDraft(cfg, DraftTensors(tensors, target.device, target.dtype), target, fp8_mode).eval()


def _fp8_mode(
    mode: str, cfg: DraftConfig, tensors: dict[str, torch.Tensor], target: DecoderModel, path: Path
) -> str:
    """The draft's fp8 mode, checked against the device and the shapes of the matrices it puts in fp8."""
    mode = fp8.check_mode(mode, target.device)
    shapes = {k: tuple(t.shape) for k, t in tensors.items() if t.dim() == 2 and mode != "off"}
    if mode == "all":
        shapes["the target's LM head"] = (target.config.vocab, cfg.hidden)
    odd = [f"{k} {shape}" for k, shape in shapes.items() if not fp8.fits(*shape)]
    if odd:
        raise FlashtreeError(
            f"{path}: an fp8 draft needs matrix sides that are multiples of {fp8.ALIGN}: {odd[0]}"
        )
    return mode
