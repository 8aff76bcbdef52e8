"""`flashtree inspect FILE [--json]`: what a GGUF holds and what decoding one token costs in weight reads."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import typer
from gguf import LlamaFileType
from rich.console import Console
from rich.table import Table

from flashtree.errors import FlashtreeError
from flashtree.gguf.locate import size_text
from flashtree.gguf.reader import GGUFFile, open_gguf
from flashtree.models.config import FULL, GGUF_KEYS, LINEAR, DraftConfig, ModelConfig, hybrid_layer_types
from flashtree.quant.formats import type_name

_LAYER = re.compile(r"blk\.(\d+)\.")

# (JSON key, ModelConfig value) for the dimensions every transformer GGUF declares; read tolerantly from
# their metadata keys (GGUF_KEYS), so that any GGUF can be described
_DIMENSIONS = (
    ("embedding", "hidden"),
    ("layers", "n_layers"),
    ("heads", "n_heads"),
    ("kv_heads", "n_kv_heads"),
    ("head_dim_k", "head_dim"),
    ("head_dim_v", "value_dim"),
    ("ffn", "ffn"),
    ("context", "context_length"),
    ("rope_dims", "rope_dim"),
    ("rope_freq_base", "rope_theta"),
    ("rms_eps", "rms_eps"),
)
_SSM = (  # of LinearAttnConfig
    ("conv_kernel", "conv_kernel"),
    ("state_size", "head_k_dim"),
    ("group_count", "n_k_heads"),
    ("time_step_rank", "n_v_heads"),
    ("inner_size", "inner"),
)


def _count(g: GGUFFile, suffix: str, default: int | None = None) -> int | None:
    """An `{arch}.*` count, checked to be a non-negative integer."""
    value = g.arch_get(suffix, default)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise FlashtreeError(f"{g.path}: {g.arch}.{suffix} = {value!r} is not a count")
    return value


def _trunk_layers(g: GGUFFile) -> int | None:
    """Decoder layers used for plain decoding: block_count minus any MTP (nextn) blocks."""
    blocks = _count(g, GGUF_KEYS["n_layers"])
    return None if blocks is None else blocks - _count(g, "nextn_predict_layers", 0)


def _vocabsize_text(g: GGUFFile) -> int | None:
    tokens = g.get("tokenizer.ggml.tokens", None)
    if tokens is not None:
        return len(tokens)
    if g.has("token_embd.weight"):
        return g.tensors["token_embd.weight"].shape[0]
    return g.arch_get(GGUF_KEYS["vocab"], None)


def _dimensions(g: GGUFFile) -> dict[str, Any]:
    dims = {key: g.arch_get(GGUF_KEYS[name], None) for key, name in _DIMENSIONS}
    dims["vocab"] = _vocabsize_text(g)
    ssm = {key: g.arch_get(GGUF_KEYS[name], None) for key, name in _SSM}
    if any(v is not None for v in ssm.values()):
        dims["ssm"] = {k: v for k, v in ssm.items() if v is not None}
    return {k: v for k, v in dims.items() if v is not None}


def _layer_pattern(g: GGUFFile) -> dict[str, Any]:
    """Which layers are full attention and which are linear (DeltaNet), for hybrids like qwen35."""
    n_layers = _trunk_layers(g) or 0
    interval = _count(g, GGUF_KEYS["full_attention_interval"])
    if not interval:
        return {"kind": "attention", "layers": n_layers}
    kinds = hybrid_layer_types(n_layers, interval)
    return {
        "kind": "hybrid",
        "full_attention_interval": interval,
        "full_attention_layers": [i for i, kind in enumerate(kinds) if kind == FULL],
        "deltanet_layers": [i for i, kind in enumerate(kinds) if kind == LINEAR],
    }


def _tensor_types(g: GGUFFile) -> dict[str, dict[str, int]]:
    """Per GGML type: tensor count and bytes, largest first."""
    by_type: dict[str, dict[str, int]] = {}
    for info in g.tensors.values():
        entry = by_type.setdefault(type_name(info.qtype), {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += info.nbytes
    return dict(sorted(by_type.items(), key=lambda kv: -kv[1]["bytes"]))


def _bytes_per_token(g: GGUFFile) -> int:
    """Weight bytes one decode step reads: every trunk tensor except token_embd, which is a row lookup;
    with tied embeddings (no output.weight) token_embd is also the LM head and is read in full."""
    trunk = _trunk_layers(g)
    tied = not g.has("output.weight")
    total = 0
    for name, info in g.tensors.items():
        layer = _LAYER.match(name)
        if layer and trunk is not None and int(layer.group(1)) >= trunk:
            continue  # MTP blocks are not run by plain decoding
        if name == "token_embd.weight" and not tied:
            continue
        total += info.nbytes
    return total


def _tokenizer(g: GGUFFile) -> dict[str, Any]:
    tokens = g.get("tokenizer.ggml.tokens", None)
    merges = g.get("tokenizer.ggml.merges", None)
    info = {
        "model": g.get("tokenizer.ggml.model", None),
        "pre": g.get("tokenizer.ggml.pre", None),
        "size": None if tokens is None else len(tokens),
        "merges": None if merges is None else len(merges),
        "bos_id": g.get("tokenizer.ggml.bos_token_id", None),
        "eos_id": g.get("tokenizer.ggml.eos_token_id", None),
        "eot_id": g.get("tokenizer.ggml.eot_token_id", None),
    }
    return {k: v for k, v in info.items() if v is not None}


def _file_type(g: GGUFFile) -> str | None:
    value = g.get("general.file_type", None)
    if value is None:
        return None
    try:
        return LlamaFileType(value).name.removeprefix("MOSTLY_")
    except ValueError:
        return str(value)


def _draft(g: GGUFFile) -> dict[str, Any] | None:
    """A DFlash draft's own values (in either layout, as the loader reads them), else None."""
    if not g.arch.startswith("dflash"):
        return None
    cfg = ModelConfig.from_gguf(g)
    if not isinstance(cfg, DraftConfig):
        return None
    return {
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": list(cfg.target_layer_ids),
        "n_target_layers": cfg.n_target_layers,
    }


def describe(gguf: GGUFFile) -> dict[str, Any]:
    """Everything `flashtree inspect --json` prints, as one JSON-ready dict."""
    return {
        "file": str(gguf.path),
        "file_bytes": gguf.path.stat().st_size,
        "architecture": gguf.arch,
        "name": gguf.get("general.name", None),
        "file_type": _file_type(gguf),
        "dimensions": _dimensions(gguf),
        "layer_pattern": _layer_pattern(gguf),
        "n_tensors": len(gguf.tensors),
        "parameters": sum(math.prod(t.shape) for t in gguf.tensors.values()),
        "tensor_types": _tensor_types(gguf),
        "tied_embeddings": gguf.has("token_embd.weight") and not gguf.has("output.weight"),
        "tokenizer": _tokenizer(gguf),
        "chat_template": gguf.get("tokenizer.chat_template", None) is not None,
        "bytes_per_token": _bytes_per_token(gguf),
        "draft": _draft(gguf),
    }


def _value_text(value: Any) -> str:
    """Metadata for the table: float32 values without their binary noise (1e-06, not 9.99999997e-07)."""
    if isinstance(value, dict):
        return ", ".join(f"{k} {_value_text(v)}" for k, v in value.items())
    return f"{value:.7g}" if isinstance(value, float) else str(value)


def _pattern_text(pattern: dict[str, Any]) -> str:
    if pattern["kind"] != "hybrid":
        return f"{pattern['layers']} attention layers"
    full = pattern["full_attention_layers"]
    shown = ", ".join(map(str, full[:4])) + (", ..." if len(full) > 4 else "")
    return (
        f"{len(pattern['deltanet_layers'])} DeltaNet + {len(full)} full attention "
        f"(every {pattern['full_attention_interval']}th: {shown})"
    )


def _tokenizer_text(tok: dict[str, Any], draft: bool) -> str:
    if not tok:
        return "none: a draft uses its target's" if draft else "none"
    parts = [tok.get("model"), tok.get("pre")]
    return " / ".join(p for p in parts if p) + (f", {tok['size']} tokens" if "size" in tok else "")


def _print_tables(info: dict[str, Any]) -> None:
    console = Console()
    summary = Table(title=info["file"], show_header=False, title_justify="left")
    summary.add_row("architecture", info["architecture"] + (f" ({info['name']})" if info["name"] else ""))
    if info["file_type"]:
        summary.add_row("file type", info["file_type"])
    for key, value in info["dimensions"].items():
        summary.add_row(key, _value_text(value))
    summary.add_row("layer pattern", _pattern_text(info["layer_pattern"]))
    summary.add_row("parameters", f"{info['parameters'] / 1e9:.3f} billion in {info['n_tensors']} tensors")
    summary.add_row("tokenizer", _tokenizer_text(info["tokenizer"], info["draft"] is not None))
    if info["draft"]:
        draft = info["draft"]
        summary.add_row("block size", str(draft["block_size"]))
        layers = ", ".join(map(str, draft["target_layer_ids"]))
        of = f" (of the target's {draft['n_target_layers']})" if draft["n_target_layers"] else ""
        summary.add_row("target layers", f"{layers}{of}")
        summary.add_row("mask token", f"id {draft['mask_token_id']} (of the target's vocabulary)")
    summary.add_row("chat template", "yes" if info["chat_template"] else "no")
    tied = " (tied embeddings: token_embd read as the LM head)" if info["tied_embeddings"] else ""
    summary.add_row("bytes read per token", size_text(info["bytes_per_token"]) + tied)
    summary.add_row("file size", size_text(info["file_bytes"]))
    console.print(summary)
    types = Table("type", "tensors", "bytes", title="tensor types", title_justify="left")
    for name, entry in info["tensor_types"].items():
        types.add_row(name, str(entry["count"]), size_text(entry["bytes"]))
    console.print(types)


def inspect_command(file: Path, as_json: bool) -> None:
    """Describe a GGUF file as rich tables, or as one JSON object with --json."""
    gguf = open_gguf(file)
    try:
        info = describe(gguf)
    finally:
        gguf.close()
    if as_json:
        typer.echo(json.dumps(info))
    else:
        _print_tables(info)
