"""Every FLASHTREE_* environment variable: read here once, checked, and documented in one table; and
the other tools' variables that say where their models are (`model_stores`: HF_HOME, OLLAMA_MODELS, ...).

The rest of the code never reads the environment: the CLI, the server, the benchmarks and the trainer
build their configs from `current()` (or from a `Settings` a test constructs) and pass them down.
An unknown FLASHTREE_* name or a malformed value is one clear error naming the variable."""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType

from flashtree.errors import FlashtreeError
from flashtree.kernels.tiles import (
    ARITHMETICS,
    DEFAULT_DENSE_TILES,
    DEFAULT_TILES,
    QMM_KERNELS,
    DenseTiles,
    KernelConfig,
    TileConfig,
    known_tile_key,
)

DRAFT_FP8_MODES = ("off", "matrices", "all")
KERNEL_PATHS = ("auto", "triton", "torch")  # auto: Triton on CUDA, the torch reference elsewhere


@dataclass(frozen=True)
class Settings:
    """The process's settings; the defaults are what was measured best. See VARIABLES for each one."""

    cache: Path = field(default_factory=lambda: Path.home() / ".cache" / "flashtree")
    cuda_graphs: bool = True
    pdl: bool = True
    expandable_segments: bool = True
    quant_kernels: bool | None = None  # None: packed on CUDA for bf16-sized models (models/loader.py)
    draft_fp8: str = "off"
    prefill_chunk: int | None = None  # None: by the prompt length and free memory (engine/prefill.py)
    kernel_path: str = "auto"  # kernels.triton_kernels_for: auto, triton (the interpreter on a CPU) or torch
    kernels: KernelConfig = field(default_factory=KernelConfig)
    git_commit: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The settings `environ` (default: os.environ) gives, every FLASHTREE_* name known and checked."""
        environ = os.environ if environ is None else environ
        given = {name: value for name, value in environ.items() if name.startswith("FLASHTREE_")}
        unknown = sorted(set(given) - set(VARIABLES))
        if unknown:
            raise FlashtreeError(f"unknown setting {', '.join(unknown)} (known: {', '.join(VARIABLES)})")
        settings, kernel_fields = cls(), {}
        for name, value in given.items():
            var = VARIABLES[name]
            try:
                parsed = var.parse(value)
            except (ValueError, TypeError, AttributeError, KeyError) as e:
                detail = f" ({e})" if str(e) and str(e) not in var.expects else ""
                raise FlashtreeError(f"{name}={value!r}: expected {var.expects}{detail}") from None
            if var.field.startswith("kernels."):
                kernel_fields[var.field.removeprefix("kernels.")] = parsed
            else:
                settings = replace(settings, **{var.field: parsed})
        try:
            return replace(settings, kernels=KernelConfig(**kernel_fields))
        except FlashtreeError as e:
            raise FlashtreeError(f"FLASHTREE_* kernel settings: {e}") from None

    def explicit(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """The FLASHTREE_* variables that chose kernels, tiles or arithmetic in `environ` (results record
        them; the cache path and the commit are not settings of the computation)."""
        environ = os.environ if environ is None else environ
        return {k: v for k, v in sorted(environ.items()) if k in VARIABLES and VARIABLES[k].recorded}


def _flag(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError("0 or 1")
    return text == "1"


def _choice(options: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in options:
            raise ValueError(f"one of {', '.join(options)}")
        return text

    return parse


def _qmm_tiles(text: str) -> Mapping[str, TileConfig]:
    chosen = {str(key): TileConfig(*map(int, value)) for key, value in json.loads(text).items()}
    unknown = sorted(key for key in chosen if not known_tile_key(key))
    if unknown:
        raise ValueError(f"unknown keys {unknown}; use {sorted(DEFAULT_TILES)} or BUCKET:TYPE, e.g. b32:Q6_K")
    return MappingProxyType({**DEFAULT_TILES, **chosen})


def _qmm_splits(text: str) -> Mapping[str, int]:
    chosen = {str(key): int(value) for key, value in json.loads(text).items()}
    bad = [key for key, value in chosen.items() if value < 1 or key.split(":")[0] not in ARITHMETICS]
    if bad:
        raise ValueError(f"bad entries {bad}")
    return MappingProxyType(chosen)


def _dense_tiles(text: str) -> Mapping[str, DenseTiles]:
    chosen = {str(key): DenseTiles(*map(int, value)) for key, value in json.loads(text).items()}
    return MappingProxyType({**DEFAULT_DENSE_TILES, **chosen})


def _chunk(text: str) -> int:
    from flashtree.config import MAX_CONTEXT

    tokens = int(text)
    if not 1 <= tokens <= MAX_CONTEXT:
        raise ValueError(f"1 to {MAX_CONTEXT}")
    return tokens


def _path(text: str) -> Path:
    return Path(text) if text else Settings().cache


def _delta_tile(text: str) -> tuple[int, int]:
    bv, warps = (int(v) for v in text.split(","))
    if bv < 1 or bv & (bv - 1) or warps not in (1, 2, 4, 8):
        raise ValueError("BV a power of two, WARPS 1, 2, 4 or 8")
    return bv, warps


@dataclass(frozen=True)
class Variable:
    field: str  # Settings field, or "kernels.FIELD" of its KernelConfig
    parse: Callable[[str], object]
    default: str
    expects: str
    doc: str
    recorded: bool = True  # results record it (it can change what is computed or how fast)


VARIABLES: dict[str, Variable] = {
    "FLASHTREE_CACHE": Variable(
        "cache", _path, "~/.cache/flashtree", "a directory",
        "where the default target GGUF and the benchmark prompts are kept", recorded=False),
    "FLASHTREE_CUDA_GRAPHS": Variable(
        "cuda_graphs", _flag, "1", "0 or 1", "0: decode steps run eagerly, not replayed from CUDA graphs"),
    "FLASHTREE_PDL": Variable(
        "pdl", _flag, "1", "0 or 1", "0: no programmatic dependent launch (sm_90+)"),
    "FLASHTREE_EXPANDABLE_SEGMENTS": Variable(
        "expandable_segments", _flag, "1", "0 or 1",
        "0: torch's default CUDA allocator (1: segments grow in place: reserved memory stays near the plan)"),
    "FLASHTREE_QUANT_KERNELS": Variable(
        "quant_kernels", _flag, "CUDA: by model size", "0 or 1",
        "1/0: packed quantized weights + our kernels, or dequantized dense weights (CUDA)"),
    "FLASHTREE_DRAFT_FP8": Variable(
        "draft_fp8", _choice(DRAFT_FP8_MODES), "off", "off, matrices or all",
        "matrices: the draft's matrices in fp8 e4m3; all: also an fp8 copy of the LM head (sm_89+)"),
    "FLASHTREE_PREFILL_CHUNK": Variable(
        "prefill_chunk", _chunk, "by prompt and memory", "a token count",
        "tokens per prefill chunk (default: flashtree/engine/prefill.py's rule)"),
    "FLASHTREE_KERNELS": Variable(
        "kernel_path", _choice(KERNEL_PATHS), "auto", "one of auto, triton, torch",
        "auto: Triton kernels on CUDA, the torch reference elsewhere; triton: the kernels everywhere "
        "(TRITON_INTERPRET=1 on a CPU); torch: the reference everywhere (an A/B on a GPU)"),
    "FLASHTREE_QMM_KERNEL": Variable(
        "kernels.qmm_kernel", _choice(QMM_KERNELS), "triton", "one of triton, gluon",
        "gluon: the bf16 Q4_K and Q6_K products of up to 32 rows on sm_90 by the Gluon kernel "
        "(kernels/gluon_qmm.py; a second copy of those matrices' codes), the Triton kernel elsewhere"),
    "FLASHTREE_QMM_ARITH": Variable(
        "kernels.arithmetic", _choice(ARITHMETICS), "per engine", "one of int8, bf16",
        "the packed matmuls' arithmetic (default: bf16 when speculating, int8 for plain decoding)"),
    "FLASHTREE_QMM_TILES": Variable(
        "kernels.tiles", _qmm_tiles, "tiles.DEFAULT_TILES",
        "JSON {key: [rows, warps, stages, unroll(, fused_sum)]}", "quantized-matmul tiles per row bucket"),
    "FLASHTREE_QMM_SPLITS": Variable(
        "kernels.splits", _qmm_splits, "shape rule", 'JSON {"ARITH:TYPE:NxK": target >= 1}',
        "K-split targets per packed matrix"),
    "FLASHTREE_DENSE_KERNEL": Variable(
        "kernels.dense_kernel", _flag, "when speculating", "0 or 1",
        "1/0: the fp32 decode-row kernel instead of cuBLAS"),
    "FLASHTREE_DENSE_TILES": Variable(
        "kernels.dense_tiles", _dense_tiles, "tiles.DEFAULT_DENSE_TILES",
        'JSON {"default" or "NxK": [rows, k_block, warps, stages, programs(, fused_sum)]}',
        "the fp32 decode-row kernel's tiles per matrix shape"),
    "FLASHTREE_DELTA_TILE": Variable(
        "kernels.delta_tile", _delta_tile, "16,1", "BV,WARPS (two integers)",
        "the tree Gated DeltaNet kernel's value-column slice and warps"),
    "FLASHTREE_GIT_COMMIT": Variable(
        "git_commit", str, "the checkout's", "a commit id",
        "the commit results record (a copied tree on the GPU machine may lack .git)", recorded=False),
}  # fmt: skip


def current() -> Settings:
    """This process's settings, from its environment (read again only when a FLASHTREE_* value changed)."""
    return _settings_for(tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("FLASHTREE_"))))


def kernel_path() -> str:
    """FLASHTREE_KERNELS, checked: `current().kernel_path` for one variable, cheap enough for the per-layer
    kernel choice of every step (current() reads the whole environment)."""
    return _kernel_path_of(os.environ.get("FLASHTREE_KERNELS"))


@functools.lru_cache(maxsize=4)
def _kernel_path_of(value: str | None) -> str:
    return "auto" if value is None else Settings.from_env({"FLASHTREE_KERNELS": value}).kernel_path


@functools.lru_cache(maxsize=8)
def _settings_for(given: tuple[tuple[str, str], ...]) -> Settings:
    return Settings.from_env(dict(given))


@contextlib.contextmanager
def overriding(name: str, value: str) -> Iterator[None]:
    """Inside: the setting `name` is `value` in this process (a benchmark timing both kernel paths); after:
    as before."""
    if name not in VARIABLES:
        raise FlashtreeError(f"unknown setting {name}")
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def environment_without(*names: str) -> dict[str, str]:
    """This process's environment less `names`, for a child process (sm90.py's compiler run)."""
    return {k: v for k, v in os.environ.items() if k not in names}


OLLAMA_SERVICE_MODELS = "/usr/share/ollama/.ollama/models"  # where Linux's `ollama serve` service keeps them


@dataclass(frozen=True)
class ModelStores:
    """Where other tools keep GGUFs (gguf/locate.py), as their own variables and defaults say."""

    hf_hub: Path  # the Hugging Face hub cache: models--OWNER--NAME/{blobs,refs,snapshots}
    ollama: tuple[Path, ...]  # Ollama's model dirs: manifests/ and blobs/
    lmstudio: tuple[Path, ...]  # LM Studio's models dirs: PUBLISHER/REPO/FILE.gguf


def model_stores(environ: Mapping[str, str] | None = None) -> ModelStores:
    """The model stores `environ` (default: os.environ) points to: huggingface_hub's and Ollama's rules
    (HF_HUB_CACHE, else HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub; OLLAMA_MODELS, else the user's
    and the Linux service's ~/.ollama/models), and LM Studio's folder and its older place."""
    environ = os.environ if environ is None else environ
    home = Path(environ.get("HOME") or Path.home())
    hf_home = environ.get("HF_HOME") or Path(environ.get("XDG_CACHE_HOME") or home / ".cache") / "huggingface"
    hf_hub = environ.get("HF_HUB_CACHE") or environ.get("HUGGINGFACE_HUB_CACHE") or Path(hf_home) / "hub"
    ollama = environ.get("OLLAMA_MODELS")
    ollama_dirs = (Path(ollama),) if ollama else (home / ".ollama/models", Path(OLLAMA_SERVICE_MODELS))
    lmstudio = (home / ".lmstudio/models", home / ".cache/lm-studio/models")
    return ModelStores(Path(hf_hub).expanduser(), tuple(p.expanduser() for p in ollama_dirs), lmstudio)


def table(environ: Mapping[str, str] | None = None) -> list[tuple[str, str, str, str | None]]:
    """(variable, default, what it sets, its value in `environ` or None) for every setting: `flashtree
    settings` prints it."""
    environ = os.environ if environ is None else environ
    return [(name, var.default, var.doc, environ.get(name)) for name, var in VARIABLES.items()]
