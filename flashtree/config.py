"""Frozen settings shared along the data path: sampling, speculation, engine."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from flashtree.errors import FlashtreeError

# Upper bounds on the knobs a user or a file sets (issue #41): each covers every real use with room to
# spare, and keeps a typo or a hostile value from asking for unbounded memory or time.
MAX_BUDGET = 1024  # DDTree nodes: the DDTree paper sweeps budgets 16..1024; a verify is budget + 1 rows
MAX_BLOCK_SIZE = 64  # DFlash blocks: the paper's and every trained draft's is 16 (the shipped one too)
MAX_TREE_TOP_K = 64  # ranks per depth (default 8): the draft top-k kernels unroll one pass per rank
MAX_CONTEXT = 1 << 20  # tokens of --max-ctx, --max-tokens, --draft-ctx: 4x the longest native context
# of the supported targets (Qwen3.6-27B's 262144)
DEFAULT_CONTEXT_CAP = 32768  # the context allocated without --max-ctx: the model's own, up to this


def check_range(name: str, value: int, low: int, high: int) -> None:
    """A FlashtreeError naming `name` unless low <= value <= high."""
    if not low <= value <= high:
        raise FlashtreeError(f"{name} must be between {low} and {high}, got {value}")


def check_finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise FlashtreeError(f"{name} must be a finite number, got {value}")


def check_request(max_tokens: int, max_ctx: int | None = None) -> None:
    """--max-tokens and --max-ctx in range, before any model is loaded."""
    check_range("--max-tokens", max_tokens, 1, MAX_CONTEXT)
    if max_ctx is not None:
        check_max_ctx(max_ctx)


def check_max_ctx(max_ctx: int) -> None:
    """A context length asked for (--max-ctx, Engine(max_ctx=...)), before any memory is planned."""
    check_range("--max-ctx", max_ctx, 1, MAX_CONTEXT)


MIN_TEMPERATURE = 1e-4


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next token is chosen. temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int = 0

    def __post_init__(self) -> None:
        check_finite("temperature", self.temperature)
        check_finite("top_p", self.top_p)
        if self.temperature < 0 or 0 < self.temperature < MIN_TEMPERATURE:
            # below it the fp32 logits / T overflow (1e-300 is 0 in fp32) while the draw is greedy anyway
            raise FlashtreeError(
                f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise FlashtreeError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise FlashtreeError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


MODES = ("ar", "chain", "tree")
AUTO = "auto"  # the commands' default mode: the fastest lossless one for the device (auto_mode)


def auto_mode(cuda: bool, has_draft: bool) -> str:
    """What --mode auto runs: tree where a draft and CUDA are (DDTree's verify costs the GPU little more
    than one AR step), else AR: on the CPU a verify's extra rows cost nearly their full price, and tree
    and chain decoded slower than AR there (issue #42)."""
    return "tree" if cuda and has_draft else "ar"


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding settings. mode: ar (no draft), chain (one DFlash block), tree (DDTree)."""

    mode: str = "tree"
    block_size: int | None = None  # None = the draft's own block size
    budget: int = 22  # DDTree non-root nodes
    tree_top_k: int = 8  # candidates per depth considered by the tree builder
    chain_seed: bool = False  # insert the draft's greedy chain first (lowers the mean AL: spec/tree.py)
    draft_temperature: float = 1.0  # temperature of the draft distributions the tree is built from
    draft_ctx: int = 4096  # ring of past target features the draft attends to

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise FlashtreeError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        check_range("budget", self.budget, 1, MAX_BUDGET)
        check_range("tree-top-k", self.tree_top_k, 1, MAX_TREE_TOP_K)
        if self.block_size is not None:
            check_block_size("block size", self.block_size)
        check_finite("draft temperature", self.draft_temperature)
        if self.draft_temperature <= 0:
            raise FlashtreeError(f"draft temperature must be > 0, got {self.draft_temperature}")
        check_range("draft-ctx", self.draft_ctx, 1, MAX_CONTEXT)


def check_attn_window(window: int) -> int:
    """--attn-window: 0 (off, full attention) or the positions a decode step's attention reads."""
    check_range("--attn-window", window, 0, MAX_CONTEXT)
    return window


def lossy_label(attn_window: int) -> str | None:
    """What every report of a run says makes its output differ from the full-attention model's (the
    summary line, bench JSON's "lossy", the server's system_fingerprint), or None: lossless."""
    return f"attn-window {attn_window}" if attn_window else None


def check_block_size(name: str, value: int) -> None:
    """A draft block: the root and at least one drafted token, at most MAX_BLOCK_SIZE tokens."""
    check_range(name, value, 2, MAX_BLOCK_SIZE)


def check_kv_names(*kinds: str | None) -> None:
    """--kv-type, --kv-type-k, --kv-type-v: known KV cache types (None: the compute dtype's), checked before
    anything loads; whether a type holds the model's heads is checked when it loads (set_kv_types)."""
    if any(kind is not None for kind in kinds):
        from flashtree.quant.kv import ROTATION, check_kv_type

        for kind in kinds:
            if kind is not None:
                check_kv_type(kind, ROTATION)  # a head size every type holds: the name alone


@dataclass(frozen=True)
class EngineConfig:
    """What an engine is built from; every command builds one from its options (commands.engine_config).

    target: a GGUF (None: the embedded default); draft: a DFlash draft, "none" for plain decoding (None:
    the draft shipped for the default target); mode: ar, chain, tree or auto (auto_mode), None: spec.mode
    with a draft, ar without; max_ctx: tokens of context (None: the planner's choice); device: cuda or cpu
    (None: cuda when there is one); kv_type_k, kv_type_v: the KV cache's types (quant/kv.py; None:
    the compute dtype's)."""

    target: str | Path | None = None
    draft: str | Path | None = None
    mode: str | None = None
    spec: SpecConfig = SpecConfig()
    max_ctx: int | None = None
    device: str | None = None
    kv_type_k: str | None = None  # the KV cache's K type (quant/kv.py; None: the compute dtype's)
    kv_type_v: str | None = None
    attn_window: int = 0  # > 0: decode steps attend to the last N positions only (lossy; prefill stays full)

    def __post_init__(self) -> None:
        check_kv_names(self.kv_type_k, self.kv_type_v)
        check_attn_window(self.attn_window)
        if self.mode is not None and self.mode not in (*MODES, AUTO):
            raise FlashtreeError(f"mode must be one of {', '.join((AUTO, *MODES))}, got {self.mode!r}")
