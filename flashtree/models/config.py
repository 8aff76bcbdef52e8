"""The model-shape schema: one frozen config per model, shared by the loader, the draft, `flashtree
convert`, `synth`, `inspect` and `train-draft`.

`ModelConfig` is a target's geometry (llama, qwen3, qwen35); `DraftConfig` extends it with what a DFlash
draft adds (dflash.md §2.1). Both are read from GGUF metadata (`from_gguf`) or a Hugging Face config.json
(`from_hf_config`) and written back to GGUF metadata (`gguf_metadata`; a draft also to its z-lab
config.json, `DraftConfig.hf_config`): nothing else reads or writes these keys. `GGUF_KEYS` names the
metadata key of every value.

A draft GGUF comes in two layouts, both read:
- llama.cpp's, arch `dflash` (what its convert_hf_to_gguf.py writes and its `--spec-type draft-dflash`
  runs; what flashtree writes, `DraftConfig.llama_metadata`): `dflash.block_size`, `dflash.target_layers`
  holding the target layers whose *input* is read (z-lab's target_layer_ids + 1: llama.cpp captures a
  layer's input, z-lab a layer's output), the mask token as `tokenizer.ggml.mask_token_id` next to the
  target's tokenizer (llama.cpp reads the mask through the draft's vocabulary), sliding windows as
  `dflash.attention.sliding_window` + a per-layer bool `dflash.attention.sliding_window_pattern`, and
  hidden_norm stored as `enc.output_norm.weight`. It does not record the target's depth.
- flashtree's older one, arch `dflash-draft` (`_DRAFT_KEYS`).

Layer kinds carry Hugging Face's names: FULL (full attention), LINEAR (qwen35's Gated DeltaNet layers)
and SLIDING (a draft's sliding-window attention). In qwen35, layer i is full attention iff
(i + 1) % full_attention_interval == 0; GGUF stores only the interval.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashtree.errors import FlashtreeError
from flashtree.gguf.reader import GGUFFile, check_key_names

DRAFT_ARCH = "dflash-draft"  # the DraftConfig's arch, and the arch of flashtree's older draft GGUFs
LLAMA_DRAFT_ARCH = "dflash"  # llama.cpp's draft GGUFs (what flashtree writes)
DRAFT_GGUF_ARCHS = (DRAFT_ARCH, LLAMA_DRAFT_ARCH)
MASK_TOKEN_KEY = "tokenizer.ggml.mask_token_id"
FULL, LINEAR, SLIDING = "full_attention", "linear_attention", "sliding_attention"
LAYER_KINDS = {"llama": (FULL,), "qwen3": (FULL,), "qwen35": (FULL, LINEAR), DRAFT_ARCH: (FULL, SLIDING)}
ARCHS = tuple(LAYER_KINDS)
MAX_LAYERS = 1024  # decoder layers: the largest supported model has 64 (Llama-3 405B has 126)
MAX_ROPE_THETA = 1e12  # RoPE bases in use run from 1e4 to 1e7 (a few long-context models 1e9)
MAX_RMS_EPS = 0.01  # RMSNorm epsilons in use are 1e-6 and 1e-5

# The `{arch}.*` GGUF metadata key of each config value (a field or property): what every model writes,
_COMMON_KEYS = {
    "vocab": "vocab_size",
    "n_layers": "block_count",
    "context_length": "context_length",
    "hidden": "embedding_length",
    "ffn": "feed_forward_length",
    "n_heads": "attention.head_count",
    "n_kv_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "value_dim": "attention.value_length",
    "rms_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base",
    "rope_dim": "rope.dimension_count",
}
# what qwen35 adds (the last five: its LinearAttnConfig's),
_QWEN35_KEYS = {
    "rope_sections": "rope.dimension_sections",
    "full_attention_interval": "full_attention_interval",
}
_LINEAR_ATTN_KEYS = {
    "conv_kernel": "ssm.conv_kernel",
    "head_k_dim": "ssm.state_size",
    "n_k_heads": "ssm.group_count",
    "n_v_heads": "ssm.time_step_rank",
    "inner": "ssm.inner_size",
}
# and what a DraftConfig adds.
_DRAFT_KEYS = {
    "block_size": "dflash.block_size",
    "mask_token_id": "dflash.mask_token_id",
    "target_layer_ids": "dflash.target_layer_ids",
    "n_target_layers": "dflash.n_target_layers",
    "layer_types": "layer_types",
    "sliding_window": "attention.sliding_window",
}
GGUF_KEYS = _COMMON_KEYS | _QWEN35_KEYS | _LINEAR_ATTN_KEYS | _DRAFT_KEYS
# llama.cpp's `dflash.*` draft keys (its gguf-py constants: Keys.LLM.BLOCK_SIZE, TARGET_LAYERS, ...), where
# they differ from GGUF_KEYS, and the ones flashtree refuses: its DSpark / DFlash2 / scaled variants.
_LLAMA_DRAFT_KEYS = {
    "block_size": "block_size",
    "target_layers": "target_layers",
    "sliding_window_pattern": "attention.sliding_window_pattern",
    "causal": "attention.causal",
    "target_hidden_size": "target_hidden_size",
    "hidden_act": "hidden_activation",
}
_LLAMA_DRAFT_UNSUPPORTED = (
    "embedding_scale", "logit_scale", "final_logit_softcapping", "attention.scale",
    "attention.value_scale", "hyper_connection.count", "conv_kernel_size", "selector_rank",
    "selector_top_k", "sample_from_anchor", "has_confidence_head",
)  # fmt: skip
# llama.cpp's name of a draft tensor, where it differs from ours (MODEL_TENSOR.ENC_OUTPUT_NORM)
LLAMA_DRAFT_TENSORS = {"hidden_norm.weight": "enc.output_norm.weight"}

HF_ARCHS = {  # config.json `architectures` -> arch
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3_5ForCausalLM": "qwen35",
    "Qwen3_5ForConditionalGeneration": "qwen35",
    "DFlashDraftModel": DRAFT_ARCH,
}
MODEL_TYPES = {"llama": "llama", "qwen3": "qwen3", "qwen3_5": "qwen35", "qwen3_5_text": "qwen35"}


@dataclass(frozen=True)
class LinearAttnConfig:
    """Gated DeltaNet geometry of the qwen35 linear-attention layers."""

    n_k_heads: int
    n_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4

    def __post_init__(self) -> None:
        for name in ("n_k_heads", "n_v_heads", "head_k_dim", "head_v_dim"):
            check_count(name, getattr(self, name))
        check_count("conv_kernel", self.conv_kernel, low=2)
        if self.n_v_heads % self.n_k_heads:
            raise FlashtreeError(
                f"{self.n_v_heads} linear-attention value heads do not tile {self.n_k_heads} key heads"
            )

    @property
    def inner(self) -> int:
        """Width of the value/gate stream: n_v_heads * head_v_dim."""
        return self.n_v_heads * self.head_v_dim

    @property
    def conv_channels(self) -> int:
        """Channels of the causal conv: [q | k | v] of in_proj_qkv."""
        return 2 * self.n_k_heads * self.head_k_dim + self.inner


def check_count(name: str, value: Any, low: int = 1, high: int | None = None) -> None:
    """A FlashtreeError naming config value `name` (and its GGUF key) unless it is an integer in
    [low, high]."""
    if not (_is_int(value) and value >= low and (high is None or value <= high)):
        bound = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
        raise FlashtreeError(f"{_label(name)} is {_short(value)}, not {bound}")


def _check_float(name: str, value: Any, low: float, high: float) -> None:
    """A FlashtreeError unless `value` is a finite number in (low, high]."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and low < value <= high):
        raise FlashtreeError(f"{_label(name)} is {_short(value)}, not a finite number in ({low:g}, {high:g}]")


def _label(name: str) -> str:
    return f"{name} ({GGUF_KEYS[name]})" if name in GGUF_KEYS else name


def hybrid_layer_types(n_layers: int, interval: int) -> tuple[str, ...]:
    """qwen35's layer kinds: layer i is FULL iff (i + 1) % interval == 0, else LINEAR (all LINEAR for 0)."""
    return tuple(FULL if interval and (i + 1) % interval == 0 else LINEAR for i in range(n_layers))


def default_target_layer_ids(n_target_layers: int, n_draft_layers: int) -> tuple[int, ...]:
    """Target layers a DFlash draft reads features from, spread over 1 … L-3 (dflash.md §2.1).

    Clamped to the target's layers, which only matters for toy targets of fewer than 4 layers.
    """
    if n_draft_layers == 1:
        return (n_target_layers // 2,)
    step = (n_target_layers - 4) / (n_draft_layers - 1)
    return tuple(min(max(round(1 + i * step), 0), n_target_layers - 1) for i in range(n_draft_layers))


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A model's geometry. Values left at their defaults are filled in on construction: rope_dim 0 is
    head_dim, empty layer_types all FULL; sliding_window is None without SLIDING layers."""

    arch: str
    n_layers: int  # the decoder layers run (a GGUF's MTP blocks not counted)
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    context_length: int
    rope_theta: float
    rms_eps: float
    tied_embeddings: bool = False
    rope_dim: int = 0  # rotated dims per head (partial rotary when < head_dim)
    rope_sections: tuple[int, ...] = ()  # qwen35 M-RoPE sections, padded to 4
    layer_types: tuple[str, ...] = ()  # per layer: FULL, LINEAR (qwen35) or SLIDING (drafts)
    sliding_window: int | None = None  # positions a SLIDING layer sees
    linear_attn: LinearAttnConfig | None = None  # qwen35 only
    name: str = field(default="", compare=False)  # for messages: general.name, or the checkpoint's dir

    def __post_init__(self) -> None:
        self._check_values()
        for name, value in self._filled_in().items():
            object.__setattr__(self, name, value)
        self._check()

    def _check_values(self) -> None:
        """Every number in its range, before any is used to size something (layer_types)."""
        for name in ("hidden", "ffn", "n_heads", "n_kv_heads", "head_dim", "vocab", "context_length"):
            check_count(name, getattr(self, name))
        check_count("n_layers", self.n_layers, high=MAX_LAYERS)
        check_count("rope_dim", self.rope_dim, low=0, high=self.head_dim)  # 0: head_dim
        if self.rope_dim % 2:
            raise FlashtreeError(f"{_label('rope_dim')} is {self.rope_dim}: RoPE rotates pairs of dims")
        _check_float("rms_eps", self.rms_eps, 0.0, MAX_RMS_EPS)
        _check_float("rope_theta", self.rope_theta, 1.0, MAX_ROPE_THETA)
        for i, section in enumerate(self.rope_sections):
            check_count(f"rope_sections[{i}]", section, low=0, high=self.head_dim)
        if self.sliding_window is not None:
            check_count("sliding_window", self.sliding_window)

    def _filled_in(self) -> dict[str, Any]:
        layer_types = tuple(self.layer_types) or (FULL,) * self.n_layers
        return dict(
            rope_dim=self.rope_dim or self.head_dim,
            rope_theta=float(self.rope_theta),
            rms_eps=float(self.rms_eps),
            rope_sections=tuple(self.rope_sections),
            layer_types=layer_types,
            sliding_window=self.sliding_window if SLIDING in layer_types else None,
        )

    def _check(self) -> None:
        if self.arch not in ARCHS:
            raise FlashtreeError(f"unknown architecture {self.arch!r} (supported: {', '.join(ARCHS)})")
        need = DraftConfig if self.arch == DRAFT_ARCH else ModelConfig
        if type(self) is not need:
            raise FlashtreeError(
                f"a {self.arch} model's config is a {need.__name__}, not a {type(self).__name__}"
            )
        if self.n_heads % self.n_kv_heads:
            raise FlashtreeError(
                f"{self.n_heads} attention heads do not split into {self.n_kv_heads} KV heads"
            )
        kinds = LAYER_KINDS[self.arch]
        if len(self.layer_types) != self.n_layers or not set(self.layer_types) <= set(kinds):
            raise FlashtreeError(
                f"layer_types {list(self.layer_types)}: a {self.arch} model needs {self.n_layers} of "
                f"{', '.join(kinds)}"
            )
        if SLIDING in self.layer_types and not self.sliding_window:
            raise FlashtreeError("sliding_attention layers need a sliding_window")
        if (self.arch == "qwen35") != (self.linear_attn is not None):
            raise FlashtreeError("qwen35 models, and only they, have linear-attention geometry")
        interval = self.full_attention_interval
        if self.arch == "qwen35" and not (
            interval and self.layer_types == hybrid_layer_types(self.n_layers, interval)
        ):
            raise FlashtreeError(
                f"layer_types is not a regular full-attention interval: {list(self.layer_types)}"
            )

    @property
    def value_dim(self) -> int:
        """Width of a V head: head_dim in every model here."""
        return self.head_dim

    @property
    def full_attention_interval(self) -> int:
        """Layer i is full attention iff (i + 1) % interval == 0 in qwen35 (GGUF stores only this); 1 in
        models of full attention only, 0 in those without."""
        return self.layer_types.index(FULL) + 1 if FULL in self.layer_types else 0

    def gguf_metadata(self) -> dict[str, Any]:
        """The `{arch}.*` keys (no general.* or tokenizer.* keys). Ints are counts (UINT32 in GGUF)."""
        values = self._gguf_values().items()
        return {f"{self.arch}.{GGUF_KEYS[k]}": list(v) if isinstance(v, tuple) else v for k, v in values}

    def _gguf_values(self) -> dict[str, Any]:
        values = {name: getattr(self, name) for name in _COMMON_KEYS}
        if self.linear_attn is not None:
            values |= {name: getattr(self, name) for name in _QWEN35_KEYS}
            values |= {name: getattr(self.linear_attn, name) for name in _LINEAR_ATTN_KEYS}
        return values

    @staticmethod
    def from_gguf(g: GGUFFile) -> ModelConfig:
        """The config of a GGUF file: a DraftConfig for a dflash-draft one. Every value is checked for its
        type and range, and the layer count against the blocks the file holds, before anything is sized."""
        v = _GGUFValues(g)
        n_heads, hidden = v.count("n_heads"), v.count("hidden")
        head_dim = v.count("head_dim", hidden // n_heads)
        if v.count("value_dim", head_dim) != head_dim:
            raise FlashtreeError(
                f"{g.path}: {g.arch}.attention.value_length {v.count('value_dim')} differs from the key"
                f" length {head_dim} (flashtree's models have V heads as wide as K heads)"
            )
        values = dict(
            arch=DRAFT_ARCH if g.arch in DRAFT_GGUF_ARCHS else g.arch,
            name=str(g.get("general.name", g.path.stem)),
            n_layers=_gguf_layers(g, v),
            hidden=hidden,
            ffn=v.count("ffn"),
            n_heads=n_heads,
            n_kv_heads=v.count("n_kv_heads", n_heads),
            head_dim=head_dim,
            vocab=_gguf_vocab(g, v),
            context_length=v.count("context_length"),
            rms_eps=v.number("rms_eps"),
            rope_theta=v.number("rope_theta", 10000.0),
            rope_dim=v.count("rope_dim", head_dim),
            tied_embeddings=g.arch not in DRAFT_GGUF_ARCHS and not g.has("output.weight"),
        )
        if g.arch == DRAFT_ARCH:
            values |= _draft_from_gguf(v)
        if g.arch == LLAMA_DRAFT_ARCH:
            values |= _llama_draft_from_gguf(v, values)
        if g.arch == "qwen35":
            values |= _qwen35_from_gguf(v, values["n_layers"])
        return _build(values, g.path)

    @staticmethod
    def from_hf_config(config: dict, path: Path) -> ModelConfig:
        """The config of a Hugging Face checkpoint, or a DraftConfig for a z-lab DFlash draft, from its
        config.json (`path`: for messages)."""
        try:
            return _from_hf_config(config, path)
        except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError) as e:
            raise FlashtreeError(f"{path}: not a usable model config ({type(e).__name__}: {e})") from None


@dataclass(frozen=True, kw_only=True)
class DraftConfig(ModelConfig):
    """A DFlash draft: a qwen3-style body without embeddings or LM head (it uses the target's) that reads
    the target's hidden states after `target_layer_ids` and fills blocks of `block_size` tokens."""

    arch: str = DRAFT_ARCH
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    n_target_layers: int | None  # layers of the target it was made for (None: not recorded, llama.cpp's GGUF)

    def _filled_in(self) -> dict[str, Any]:
        return super()._filled_in() | dict(target_layer_ids=tuple(self.target_layer_ids))

    def _check_values(self) -> None:
        super()._check_values()
        check_count("block_size", self.block_size)
        check_count("mask_token_id", self.mask_token_id, low=0)
        if self.n_target_layers is not None:
            check_count("n_target_layers", self.n_target_layers, high=MAX_LAYERS)
        if not self.target_layer_ids:
            raise FlashtreeError("target_layer_ids is empty: a draft reads at least one target layer")
        for i in self.target_layer_ids:
            check_count("target_layer_ids", i, low=0, high=(self.n_target_layers or MAX_LAYERS) - 1)

    def _check(self) -> None:
        super()._check()
        if self.rope_dim != self.head_dim:
            raise FlashtreeError(
                f"a DFlash draft rotates whole heads of {self.head_dim}, not {self.rope_dim}"
            )

    def _gguf_values(self) -> dict[str, Any]:
        values = super()._gguf_values() | {name: getattr(self, name) for name in _DRAFT_KEYS}
        if self.sliding_window is None:
            del values["sliding_window"]
        return values

    def llama_metadata(self) -> dict[str, Any]:
        """The draft's metadata in llama.cpp's `dflash` layout, as its converter writes it (no general.*
        keys, and no tokenizer: llama.cpp needs the target's next to the mask token to run the draft)."""
        a = LLAMA_DRAFT_ARCH
        values = {f"{a}.{GGUF_KEYS[k]}": getattr(self, k) for k in _COMMON_KEYS}
        values |= {
            f"{a}.block_size": self.block_size,
            f"{a}.target_layers": [i + 1 for i in self.target_layer_ids],  # inputs of layers i + 1
            MASK_TOKEN_KEY: self.mask_token_id,
        }
        if self.sliding_window is not None:
            values[f"{a}.attention.sliding_window"] = self.sliding_window
            values[f"{a}.attention.sliding_window_pattern"] = [t == SLIDING for t in self.layer_types]
        return values

    def hf_config(self) -> dict[str, Any]:
        """The z-lab config.json: Qwen3 keys plus block_size, num_target_layers, dflash_config."""
        return {
            "architectures": ["DFlashDraftModel"],
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
            "model_type": "qwen3",
            "hidden_size": self.hidden,
            "intermediate_size": self.ffn,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.context_length,
            "vocab_size": self.vocab,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "dtype": "bfloat16",
            "layer_types": list(self.layer_types),
            "use_sliding_window": self.sliding_window is not None,
            "sliding_window": self.sliding_window,
            "block_size": self.block_size,
            **({} if self.n_target_layers is None else {"num_target_layers": self.n_target_layers}),
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
        }


def _build(values: dict[str, Any], source: Path) -> ModelConfig:
    """The config of `values` (a DraftConfig for a draft's), its errors naming the file they came from."""
    try:
        return (DraftConfig if values["arch"] == DRAFT_ARCH else ModelConfig)(**values)
    except FlashtreeError as e:
        raise FlashtreeError(f"{source}: {e}") from None


# --- GGUF metadata ----------------------------------------------------------------------------------


class _GGUFValues:
    """A GGUF's `{arch}.*` values by config name (GGUF_KEYS), each of its GGUF type, as llama.cpp also
    requires: a missing key (without a default) or a value of another type or sign is a FlashtreeError
    naming the file and the key."""

    def __init__(self, g: GGUFFile):
        self.g = g
        # llama.cpp's draft keys take the place of ours in its layout (block_size: `dflash.block_size`)
        self.keys = GGUF_KEYS | _LLAMA_DRAFT_KEYS if g.arch == LLAMA_DRAFT_ARCH else GGUF_KEYS
        known = [f"{g.arch}.{key}" for key in (*self.keys.values(), *_OTHER_KEYS)]
        check_key_names(g.metadata, known, g.path)

    def _get(self, name: str, default: tuple, kind: str, ok: Callable[[Any], bool]) -> Any:
        key = f"{self.g.arch}.{self.keys.get(name, name)}"
        if default and key not in self.g.metadata:
            return default[0]
        value = self.g.get(key)
        if not ok(value):
            raise FlashtreeError(f"{self.g.path}: metadata {key} is {_short(value)}, not {kind}")
        return value

    def count(self, name: str, *default: int) -> int:
        return self._get(name, default, "a positive integer", lambda x: _is_int(x) and x > 0)

    def index(self, name: str, *default: int) -> int:
        return self._get(name, default, "an integer >= 0", lambda x: _is_int(x) and x >= 0)

    def number(self, name: str, *default: float) -> float:
        return self._get(name, default, "a floating-point number", lambda x: isinstance(x, float))

    def indices(self, name: str, *default: tuple) -> tuple[int, ...]:
        ok = lambda x: isinstance(x, list) and all(_is_int(i) and i >= 0 for i in x)  # noqa: E731
        return tuple(self._get(name, default, "a list of integers >= 0", ok))

    def strings(self, name: str, *default: tuple) -> tuple[str, ...]:
        ok = lambda x: isinstance(x, list) and all(isinstance(i, str) for i in x)  # noqa: E731
        return tuple(self._get(name, default, "a list of strings", ok))

    def bools(self, name: str, *default: tuple) -> tuple[bool, ...]:
        ok = lambda x: isinstance(x, list) and all(isinstance(i, bool) for i in x)  # noqa: E731
        return tuple(self._get(name, default, "a list of booleans", ok))

    def has(self, name: str) -> bool:
        return f"{self.g.arch}.{self.keys.get(name, name)}" in self.g.metadata


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_OTHER_KEYS = ("nextn_predict_layers",)  # `{arch}.*` keys read besides GGUF_KEYS'


def _gguf_layers(g: GGUFFile, v: _GGUFValues) -> int:
    """The decoder layers: block_count less the MTP blocks (nextn_predict_layers), the file's `blk.N.`
    tensors being exactly blocks 0 .. block_count - 1."""
    block_count, mtp = v.count("n_layers"), v.index("nextn_predict_layers", 0)
    if block_count > MAX_LAYERS:
        raise FlashtreeError(f"{g.path}: {g.arch}.block_count {block_count} is more than {MAX_LAYERS} layers")
    present = {int(m.group(1)) for name in g.tensors if (m := re.match(r"blk\.(\d+)\.", name))}
    missing = sorted(set(range(block_count)) - present)
    extra = sorted(i for i in present if i >= block_count)
    if missing or extra:
        found = f"blocks {_few(missing)} missing" if missing else f"tensors of blocks {_few(extra)}"
        raise FlashtreeError(f"{g.path}: {g.arch}.block_count is {block_count} but the file has {found}")
    if mtp >= block_count:
        raise FlashtreeError(
            f"{g.path}: {g.arch}.nextn_predict_layers {mtp} leaves none of the {block_count} blocks as layers"
        )
    return block_count - mtp


def _few(items: list) -> str:
    """The first three items, and how many more."""
    more = f" and {len(items) - 3} more" if len(items) > 3 else ""
    return ", ".join(str(i) for i in items[:3]) + more


def _gguf_vocab(g: GGUFFile, v: _GGUFValues) -> int:
    """Rows of the token embedding (equal to vocab_size where the file states it); a draft, which has no
    embedding, states its vocab (llama.cpp's: the tokens of the target's tokenizer it carries, as llama.cpp
    counts them, or vocab_size)."""
    if g.arch == DRAFT_ARCH:
        return v.count("vocab")
    if g.arch == LLAMA_DRAFT_ARCH:
        tokens = g.get("tokenizer.ggml.tokens", None)
        if isinstance(tokens, list) and tokens:
            if v.count("vocab", len(tokens)) != len(tokens):
                raise FlashtreeError(
                    f"{g.path}: {g.arch}.vocab_size {v.count('vocab')} but the tokenizer has {len(tokens)}"
                    " tokens"
                )
            return len(tokens)
        return v.count("vocab")
    if not g.has("token_embd.weight"):
        raise FlashtreeError(f"{g.path}: missing tensor 'token_embd.weight'")
    rows = g.tensors["token_embd.weight"].shape[0]
    if v.count("vocab", rows) != rows:
        raise FlashtreeError(
            f"{g.path}: {g.arch}.vocab_size {v.count('vocab')} but token_embd.weight has {rows} rows"
        )
    return rows


def _qwen35_from_gguf(v: _GGUFValues, n_layers: int) -> dict[str, Any]:
    v_heads = v.count("n_v_heads")
    inner = v.count("inner")
    if inner % v_heads:
        raise FlashtreeError(
            f"{v.g.path}: qwen35.ssm.inner_size {inner} does not split into {v_heads} heads (time_step_rank)"
        )
    return dict(
        rope_sections=v.indices("rope_sections", ()),
        layer_types=hybrid_layer_types(n_layers, v.count("full_attention_interval", 4)),
        linear_attn=LinearAttnConfig(
            n_k_heads=v.count("n_k_heads"),
            n_v_heads=v_heads,
            head_k_dim=v.count("head_k_dim"),
            head_v_dim=inner // v_heads,
            conv_kernel=v.count("conv_kernel"),
        ),
    )


def _draft_from_gguf(v: _GGUFValues) -> dict[str, Any]:
    return dict(
        block_size=v.count("block_size", 16),
        mask_token_id=v.index("mask_token_id"),
        target_layer_ids=v.indices("target_layer_ids"),
        n_target_layers=v.count("n_target_layers"),
        layer_types=v.strings("layer_types", ()),
        sliding_window=v.count("sliding_window", None),
    )


def _llama_draft_from_gguf(v: _GGUFValues, values: dict[str, Any]) -> dict[str, Any]:
    """A llama.cpp `dflash` draft's DFlash values, refusing the variants flashtree does not run."""
    _check_llama_draft(v, values)
    inputs = v.indices("target_layers")
    if 0 in inputs:
        raise FlashtreeError(
            f"{v.g.path}: {v.g.arch}.target_layers holds 0, the target's token embeddings, which flashtree's"
            " drafts do not read"
        )
    mask = v.g.get(MASK_TOKEN_KEY, None)
    if not (_is_int(mask) and mask >= 0):
        raise FlashtreeError(f"{v.g.path}: {MASK_TOKEN_KEY} is {_short(mask)}, not a token id")
    window = v.index("sliding_window", 0)  # llama.cpp: 0 is no window, and then no pattern is read
    pattern = v.bools("sliding_window_pattern") if window else ()
    layer_types = tuple(SLIDING if swa else FULL for swa in pattern)
    if window and len(layer_types) != values["n_layers"]:
        raise FlashtreeError(
            f"{v.g.path}: {v.g.arch}.attention.sliding_window_pattern has {len(layer_types)} entries for"
            f" {values['n_layers']} layers"
        )
    return dict(
        block_size=v.count("block_size", 16),
        mask_token_id=mask,
        target_layer_ids=tuple(i - 1 for i in inputs),
        n_target_layers=None,
        layer_types=layer_types,
        sliding_window=window if SLIDING in layer_types else None,
    )


def _check_llama_draft(v: _GGUFValues, values: dict[str, Any]) -> None:
    """Refuse what llama.cpp's `dflash` arch allows beyond a plain DFlash draft (DSpark heads, DFlash2
    selectors, scales, causal blocks, another activation, real M-RoPE, a target of another width)."""
    g = v.g
    used = [key for key in _LLAMA_DRAFT_UNSUPPORTED if f"{g.arch}.{key}" in g.metadata]
    if v.has("causal") and g.get(f"{g.arch}.attention.causal") is not False:
        used.append("attention.causal")
    if v.has("hidden_act") and g.get(f"{g.arch}.hidden_activation") != "silu":
        used.append("hidden_activation")
    if v.has("target_hidden_size") and v.count("target_hidden_size") != values["hidden"]:
        used.append("target_hidden_size")
    sections = v.indices("rope_sections", ())  # a draft for an M-RoPE target ropes the temporal dims only
    if any(sections) and list(sections) != [values["rope_dim"] // 2, 0, 0, 0][: len(sections)]:
        used.append("rope.dimension_sections")
    if used:
        keys = ", ".join(f"{g.arch}.{key}" for key in used)
        raise FlashtreeError(f"{g.path}: {keys}: a DFlash variant flashtree does not run (only plain DFlash)")


# --- Hugging Face config.json -----------------------------------------------------------------------


def detect_arch(config: dict, path: Path) -> str:
    names = config.get("architectures") or []
    for name in names:
        if name in HF_ARCHS:
            return HF_ARCHS[name]
    model_type = config.get("model_type")
    if not names and model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    found = ", ".join(names) or f"model_type {model_type!r}"
    raise FlashtreeError(f"{path}: unsupported architecture {found} (supported: {', '.join(HF_ARCHS)})")


class _Fields:
    """config.json values, with a FlashtreeError naming the file and the key when one is missing."""

    def __init__(self, config: dict, path: Path):
        # Qwen3_5ForConditionalGeneration nests the language model's settings under text_config
        self.values = {**config, **(config.get("text_config") or {})}
        self.path = path

    def __call__(self, key: str, default=None):
        value = self.values.get(key)
        if value is None:  # absent or null
            value = default
        if value is None:
            raise FlashtreeError(f"{self.path}: missing {key!r}")
        return value

    def rope(self) -> dict:
        """RoPE settings: transformers 5 keeps them in rope_parameters, older configs at the top level."""
        rope = {k: v for k, v in self.values.items() if k in ("rope_theta", "partial_rotary_factor")}
        rope |= self.values.get("rope_parameters") or self.values.get("rope_scaling") or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise FlashtreeError(f"{self.path}: unsupported RoPE scaling {kind!r} (only plain RoPE)")
        return rope


def _from_hf_config(config: dict, path: Path) -> ModelConfig:
    arch = detect_arch(config, path)
    f = _Fields(config, path)
    if f("attention_bias", False) or f("mlp_bias", False):
        raise FlashtreeError(f"{path}: attention/MLP biases are not supported")
    if "quantization_config" in f.values:  # FP8/GPTQ/... weights would need their scales applied
        raise FlashtreeError(f"{path}: quantized checkpoints are not supported (convert the bf16/f32 one)")
    n_heads, hidden, n_layers = (
        int(f("num_attention_heads")),
        int(f("hidden_size")),
        int(f("num_hidden_layers")),
    )
    head_dim = int(f("head_dim", hidden // n_heads if n_heads > 0 else 0))  # 0 heads: refused by the config
    rope = f.rope()
    values = dict(
        arch=arch,
        name=path.parent.name,
        n_layers=n_layers,
        hidden=hidden,
        ffn=int(f("intermediate_size")),
        n_heads=n_heads,
        n_kv_heads=int(f("num_key_value_heads", n_heads)),
        head_dim=head_dim,
        vocab=int(f("vocab_size")),
        context_length=int(f("max_position_embeddings")),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rms_eps=float(f("rms_norm_eps")),
        tied_embeddings=arch != DRAFT_ARCH and bool(f("tie_word_embeddings", False)),
    )
    if arch == "qwen35":
        values |= _qwen35_from_hf(f, rope, head_dim, n_layers)
    if arch == DRAFT_ARCH:
        values |= _draft_from_hf(f, n_layers)
    return _build(values, path)


def _qwen35_from_hf(f: _Fields, rope: dict, head_dim: int, n_layers: int) -> dict[str, Any]:
    sections = list(rope.get("mrope_section", [11, 11, 10]))  # llama.cpp's default when absent
    layer_types = f.values.get("layer_types")
    if layer_types is None:
        layer_types = hybrid_layer_types(n_layers, int(f("full_attention_interval", 4)))
    return dict(
        rope_dim=int(head_dim * rope.get("partial_rotary_factor", 0.25)),
        rope_sections=tuple(sections + [0] * (4 - len(sections))),
        layer_types=tuple(layer_types),
        linear_attn=LinearAttnConfig(
            n_k_heads=int(f("linear_num_key_heads")),
            n_v_heads=int(f("linear_num_value_heads")),
            head_k_dim=int(f("linear_key_head_dim")),
            head_v_dim=int(f("linear_value_head_dim")),
            conv_kernel=int(f("linear_conv_kernel_dim", 4)),
        ),
    )


def _draft_from_hf(f: _Fields, n_layers: int) -> dict[str, Any]:
    dflash = f.values.get("dflash_config") or {}
    if "mask_token_id" not in dflash:
        raise FlashtreeError(f"{f.path}: missing 'dflash_config.mask_token_id'")
    target_layer_ids = dflash.get("target_layer_ids")
    n_target_layers = f.values.get("num_target_layers")  # needed to place the default target layers
    if n_target_layers is not None or not target_layer_ids:
        n_target_layers = int(f("num_target_layers"))
    target_layer_ids = target_layer_ids or default_target_layer_ids(n_target_layers, n_layers)
    layer_types = tuple(f.values.get("layer_types") or ())
    return dict(
        block_size=int(f("block_size", 16)),
        mask_token_id=int(dflash["mask_token_id"]),
        target_layer_ids=tuple(int(i) for i in target_layer_ids),
        n_target_layers=n_target_layers,
        layer_types=layer_types,
        sliding_window=int(f("sliding_window")) if SLIDING in layer_types else None,
    )
