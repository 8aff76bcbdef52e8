"""GGUF -> DecoderModel. Each family says which GGUF tensors make which block; this module holds
what they share: the check that a file holds exactly the tensors its config implies (before any weight
is read), strict weight access and the arch registry."""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable
from pathlib import Path

import torch

from flashtree import kernels
from flashtree.convert.shapes import gguf_tensors
from flashtree.errors import FlashtreeError
from flashtree.gguf.reader import GGUFFile, open_gguf
from flashtree.models.config import ModelConfig
from flashtree.models.layers import Linear, MergedLinear, PackedEmbedding, RMSNorm, Rotary, SwiGLU
from flashtree.models.model import DecoderLayer, DecoderModel
from flashtree.quant.dequant import dequantize

ARCHITECTURES = {"llama": "llama", "qwen3": "qwen3", "qwen35": "qwen35"}  # GGUF arch -> family module


# Bytes of a tensor's file rows converted at a time: a load streams every tensor through buffers this
# size (raw rows on the device, their decoded or repacked form written straight into the resident
# tensor), so its peak device memory is the resident weights plus temporaries of this order.
LOAD_CHUNK_BYTES = 4 << 20


class Weights:
    """Strict access to a GGUF's tensors, dequantized to the compute dtype on the target device.

    With `quantized` (see default_quantized), quantized matrices stay packed in `QuantLinear`s that
    run the Triton kernels; otherwise, and always for float tensors, a matrix becomes a dense `Linear`.
    `merged` puts matrices that read the same input into as few matmuls as their storage allows.

    Every tensor is allocated once, in its resident form, and filled from the file a few rows at a time
    (LOAD_CHUNK_BYTES): no whole-tensor copy, decoded or packed, ever sits next to it. On the `meta`
    device nothing is read: the model built is the memory plan's (flashtree/engine/plan.py), tensor for tensor
    the one a load allocates; `gguf` may then be a header's tensor table alone (plan.TensorTable)."""

    def __init__(self, gguf, device: torch.device | str, dtype: torch.dtype, quantized: bool | None = None):
        self.gguf, self.device, self.dtype = gguf, torch.device(device), dtype
        self.quantized = default_quantized(self.device, gguf) if quantized is None else quantized

    def kind(self, name: str) -> int | None:
        """The GGUF type a matrix stays packed in, or None when it becomes a dense weight."""
        info = self.gguf.info(name)
        if self.quantized and len(info.shape) == 2:
            from flashtree.kernels.qmatmul import KERNEL_TYPES

            if info.qtype in KERNEL_TYPES:  # float tensors and types without a kernel stay dense
                return info.qtype
        return None

    def _chunks(self, name: str, order: torch.Tensor | None = None, decoded: bool = False):
        """(first row, raw rows on the device) of tensor `name` (rows: all dims but the last), a chunk
        of LOAD_CHUNK_BYTES at a time (of their fp32 values when `decoded`: decoding makes temporaries of
        that size); `order`: the file row each row takes. Nothing on `meta`."""
        if self.device.type == "meta":
            return
        info = self.gguf.info(name)
        raw = self.gguf.raw(name)
        step = max(1, LOAD_CHUNK_BYTES // (4 * info.shape[-1] if decoded else raw.shape[1]))
        for r in range(0, raw.shape[0], step):
            rows = raw[r : r + step] if order is None else raw[order[r : r + step].numpy()]
            yield r, torch.from_numpy(rows).to(self.device), info

    def _fill_dense(self, dest: torch.Tensor, name: str, order: torch.Tensor | None = None) -> None:
        """Decode tensor `name` into `dest` (its rows, as (rows, cols))."""
        for r, raw, info in self._chunks(name, order, decoded=True):
            n = raw.shape[0]
            dest[r : r + n] = dequantize(raw, info.qtype, (n, info.shape[-1]), dest.dtype)

    def dense(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        shape = self.gguf.info(name).shape
        out = torch.empty(shape, dtype=dtype or self.dtype, device=self.device)
        self._fill_dense(out.view(-1, shape[-1]), name)
        return out

    def _group(self, names: list[str], kind: int | None, orders: dict[str, torch.Tensor]) -> Linear:
        """One layer holding the rows of matrices `names` (same input, same `kind`) in order."""
        shape = (sum(self.gguf.info(n).shape[0] for n in names), self.gguf.info(names[0]).shape[-1])
        if kind is None:
            layer = Linear(torch.empty(shape, dtype=self.dtype, device=self.device))
        else:
            from flashtree.kernels.qlinear import QuantLinear
            from flashtree.kernels.qmatmul import repack_into

            layer = QuantLinear(None, kind, shape, self.device)
        at = 0
        for name in names:
            if kind is None:
                self._fill_dense(layer.weight.data[at:], name, orders.get(name))
            else:
                for r, raw, _ in self._chunks(name, orders.get(name)):
                    repack_into(layer.fields, raw, kind, shape[1], at + r)
            at += self.gguf.info(name).shape[0]
        return layer

    def linear(self, name: str) -> Linear:
        return self._group([name], self.kind(name), {})

    def merged(self, names: list[str], reorder: dict[str, Callable] | None = None) -> MergedLinear:
        """The matrices `names`, which read the same input, as one MergedLinear: one matmul for the dense
        ones, one per GGUF type for the packed ones. `reorder`: a function permuting a matrix's rows, per
        name (applied to the file's rows as they are read)."""
        orders = {n: f(torch.arange(self.gguf.info(n).shape[0])) for n, f in (reorder or {}).items()}
        kinds = [self.kind(name) for name in names]
        order = list(dict.fromkeys(kinds))  # the kinds, in order of first appearance
        groups = [self._group([n for n, k in zip(names, kinds, strict=True) if k == kind], kind, orders)
                  for kind in order]  # fmt: skip
        sizes = [self.gguf.info(name).shape[0] for name in names]
        return MergedLinear(groups, [order.index(k) for k in kinds], sizes)

    def vector(self, name: str) -> torch.Tensor:
        """1-D parameters (norm weights, DeltaNet decay terms) stay fp32."""
        return self.dense(name, torch.float32)

    def norm(self, name: str, eps: float) -> RMSNorm:
        return RMSNorm(self.vector(name), eps)

    def swiglu(self, prefix: str) -> SwiGLU:
        return SwiGLU(
            self.merged([f"{prefix}.ffn_gate.weight", f"{prefix}.ffn_up.weight"]),
            self.linear(f"{prefix}.ffn_down.weight"),
        )

    def embedding(self, config: ModelConfig) -> torch.Tensor | PackedEmbedding:
        """The token embedding: packed like the matrices when they are and it is not the LM head too (a
        decode step reads one row of it; a dense copy would hold the whole table in the compute dtype)."""
        name = "token_embd.weight"
        if self.kind(name) is None or not self.gguf.has("output.weight"):
            return self.dense(name)
        info = self.gguf.info(name)
        rows = torch.empty(info.shape[0], info.nbytes // info.shape[0], dtype=torch.uint8, device=self.device)
        for r, raw, _ in self._chunks(name):
            rows[r : r + raw.shape[0]] = raw
        return PackedEmbedding(rows, info.qtype, config.hidden, self.dtype)

    def lm_head(self, embedding: torch.Tensor) -> Linear:
        """Untied `output.weight`, or the token embedding itself when tied."""
        return self.linear("output.weight") if self.gguf.has("output.weight") else Linear(embedding)

    def layer(self, prefix: str, mixer, config: ModelConfig, mlp_norm: str = "ffn_norm") -> DecoderLayer:
        """A pre-norm block: `mixer` and the SwiGLU MLP with their norms (qwen35 names the second
        one post_attention_norm)."""
        return DecoderLayer(
            mixer,
            self.swiglu(prefix),
            self.norm(f"{prefix}.attn_norm.weight", config.rms_eps),
            self.norm(f"{prefix}.{mlp_norm}.weight", config.rms_eps),
        )

    def decoder(self, config: ModelConfig, layers: list[DecoderLayer]) -> DecoderModel:
        """What every family puts around its layers: embedding, final norm, LM head, RoPE."""
        embedding = self.embedding(config)
        freq_factors = self.vector("rope_freqs.weight") if self.gguf.has("rope_freqs.weight") else None
        rotary = Rotary(config.rope_dim, config.rope_theta, freq_factors).to(self.device)
        norm = self.norm("output_norm.weight", config.rms_eps)
        return DecoderModel(config, embedding, layers, norm, self.lm_head(embedding), rotary)


def copy_rows(dest: torch.Tensor, src: torch.Tensor) -> None:
    """dest[:] = src (another device or dtype), LOAD_CHUNK_BYTES of src's rows at a time: a conversion
    never makes a whole-tensor temporary on dest's device."""
    step = max(1, LOAD_CHUNK_BYTES // max(1, src[:1].numel() * src.element_size()))
    for r in range(0, src.shape[0], step):
        dest[r : r + step] = src[r : r + step]


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device asked for (default: the GPU if there is one), refused with a clear error when it is
    a GPU this machine does not have."""
    if device is None:
        return default_device()
    try:
        resolved = torch.device(device)
    except RuntimeError as e:
        raise FlashtreeError(f"unknown device {device!r} ({e})") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise FlashtreeError(f"device {device!r}: this machine has no CUDA GPU (use --device cpu)")
    return resolved


def default_quantized(device: torch.device, gguf, free: int | None = None) -> bool:
    """Keep weights packed (the quantized-matmul kernels) on CUDA for models computed in bf16
    (FP32_MAX_PARAMS and up) and wherever dense bf16 would not fit in 0.8 of `free` bytes (default: the
    device's free memory). Why packed when dense fits: the
    packed kernels are batch-invariant (a verify row equals the AR step bit for bit, so speculative
    output equals plain decoding), cuBLAS's bf16 GEMV and GEMM are not; and on the 27B the packed AR
    step is 1.85x faster (8.4 vs 15.5 ms, int8 arithmetic), the packed tree step 1.1x faster (21.6 vs
    23.9 ms, bf16 arithmetic; bench/results/h200-bf16mma-2026-12-03). Small fp32 models stay dense
    (launch-bound either way; their outputs matched AR 60/60 on the H200). FLASHTREE_QUANT_KERNELS=1/0
    forces either path on CUDA (Engine.load)."""
    if device.type != "cuda":
        return False
    if sum(math.prod(t.shape) for t in gguf.tensors.values()) >= FP32_MAX_PARAMS:
        return True
    dense_bytes = 2 * sum(math.prod(t.shape) for t in gguf.tensors.values() if len(t.shape) == 2)
    if free is None:
        free, _ = torch.cuda.mem_get_info(device)
    return dense_bytes > 0.8 * free


# Below this many weights the GPU computes in fp32: decoding such a model is bound by kernel launches,
# not by reading weights, so fp32 costs nothing measurable, and its logits from a 23-token verify pass
# agree with the 1-token AR pass to ~1e-6, where bf16's rounding flipped near-tied greedy choices
# on 11 of 15 prompts (H200, SmolLM2, first GPU dry run of `flashtree bench`).
FP32_MAX_PARAMS = 1_000_000_000


def default_dtype(device: torch.device, n_params: int = 0) -> torch.dtype:
    """fp32 on the CPU (bf16 matmuls are slower there, and tests want exactness) and for small models
    on the GPU (FP32_MAX_PARAMS); bf16 for large ones on the GPU."""
    return torch.bfloat16 if device.type == "cuda" and n_params >= FP32_MAX_PARAMS else torch.float32


def load_target(
    path: str | Path,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    quantized: bool | None = None,
):
    """Open a GGUF target and build its model on `device` (`quantized`: see Weights).
    Returns (DecoderModel, GGUFFile)."""
    gguf, config = open_target(path)
    device = resolve_device(device)
    if device.type == "cuda":
        kernels.require_triton()  # the GPU path runs Triton kernels: say so before reading any weight
    return build_model(config, gguf, device, dtype, quantized), gguf


def open_target(path: str | Path) -> tuple[GGUFFile, ModelConfig]:
    """A target GGUF's header, checked (architecture, tensor table, tokenizer): no weight is read."""
    gguf = open_gguf(path)
    if gguf.arch not in ARCHITECTURES:
        raise FlashtreeError(
            f"{gguf.path}: unsupported architecture {gguf.arch!r} (supported: {', '.join(ARCHITECTURES)})"
        )
    config = ModelConfig.from_gguf(gguf)
    check_tensors({name: t.shape for name, t in gguf.tensors.items()}, config, gguf.path)
    _check_tokenizer_fits(gguf, config)
    return gguf, config


def build_model(
    config: ModelConfig, tensors, device: torch.device, dtype: torch.dtype | None = None, quantized=None
) -> DecoderModel:
    """The target of `config` from `tensors` (a GGUFFile; on `meta`, any tensor table: see Weights)."""
    module = importlib.import_module(f"flashtree.models.{ARCHITECTURES[config.arch]}")
    n_params = sum(math.prod(t.shape) for t in tensors.tensors.values())
    return module.build(config, Weights(tensors, device, dtype or default_dtype(device, n_params), quantized))


def check_tensors(shapes: dict[str, tuple[int, ...]], config: ModelConfig, source: Path) -> None:
    """`shapes` (name -> torch-order shape) must be the tensors `config` implies (convert.shapes), each
    with its shape, and nothing else but an optional `rope_freqs.weight` and MTP blocks (past the
    decoder layers, with their `nextn.eh_proj.weight`). Checked before any weight is read."""
    expected = {spec.name: spec.shape for spec in gguf_tensors(config)}
    if "rope_freqs.weight" in shapes:
        expected["rope_freqs.weight"] = (config.rope_dim // 2,)
    missing = [name for name in expected if name not in shapes]
    if missing:
        raise FlashtreeError(f"{source}: missing tensor(s) {_names(missing)}")
    extra = [name for name in shapes if name not in expected and not _mtp_tensor(name, config, shapes)]
    if extra:
        raise FlashtreeError(f"{source}: unexpected tensor(s) {_names(extra)} in a {_describe(config)}")
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise FlashtreeError(
                f"{source}: tensor {name!r} has shape {tuple(shapes[name])}, but a {_describe(config)} "
                f"has {shape}"
            )


def _mtp_tensor(name: str, config: ModelConfig, shapes: dict) -> bool:
    """A tensor of a multi-token-prediction block (llama.cpp's `nextn`), which follows the layers."""
    block = re.match(r"blk\.(\d+)\.", name)
    return (
        block is not None
        and int(block.group(1)) >= config.n_layers
        and (f"{block.group()}nextn.eh_proj.weight" in shapes)
    )


def _names(names: list[str]) -> str:
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(repr(n) for n in names[:3]) + more


def _describe(config: ModelConfig) -> str:
    return f"{config.arch} model of {config.n_layers} layers per its metadata"


def _check_tokenizer_fits(gguf: GGUFFile, config: ModelConfig) -> None:
    """Every token id must have an embedding row."""
    tokens = gguf.get("tokenizer.ggml.tokens", [])
    if isinstance(tokens, list) and len(tokens) > config.vocab:
        raise FlashtreeError(
            f"{gguf.path}: the tokenizer has {len(tokens)} tokens but the model embeds only {config.vocab}"
        )
