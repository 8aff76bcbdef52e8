"""`flashtree run`: one prompt in, a streamed reply out (or one JSON object with --json); `flashtree models`.

torch comes in with the engine (generate.py), imported where a model loads: every option and name is
checked before that."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING

from rich.console import Console

from flashtree.config import AUTO, MODES, EngineConfig, SamplingParams, SpecConfig, check_request
from flashtree.errors import FlashtreeError

if TYPE_CHECKING:
    from flashtree.engine.generate import Engine


def engine_config(
    target, draft, mode, max_ctx, device, *, block_size=None, budget=22, tree_top_k=8, chain_seed=False,
    draft_ctx=4096, draft_temperature=1.0, kv_type=None, kv_type_k=None, kv_type_v=None, attn_window=0,
) -> EngineConfig:  # fmt: skip
    """The EngineConfig of a command's --target/--draft/--mode/... options (checked, the model names found
    in their stores: nothing loads yet). kv_type: K's and V's, unless kv_type_k / kv_type_v say;
    attn_window: --attn-window (lossy)."""
    from flashtree.gguf.locate import resolve_model

    spec = SpecConfig(
        mode=mode if mode in MODES else "tree", block_size=block_size, budget=budget,  # auto: EngineConfig
        tree_top_k=tree_top_k, chain_seed=chain_seed, draft_ctx=draft_ctx,
        draft_temperature=draft_temperature,
    )  # fmt: skip
    kv_types = {"kv_type_k": kv_type_k or kv_type, "kv_type_v": kv_type_v or kv_type}
    config = EngineConfig(target, draft, mode, spec, max_ctx, device, **kv_types, attn_window=attn_window)
    for name, what in ((target, "file"), (None if draft == "none" else draft, "draft")):
        if name is not None and not resolve_model(name).exists():  # here, not after torch and a load
            raise FlashtreeError(f"{name}: {what} not found")
    return config


def load_engine(config: EngineConfig) -> Engine:
    from flashtree.engine.generate import Engine

    if config.target is None:  # the default model's first download shows its progress, outside the spinner
        from flashtree.defaults import default_target_path

        default_target_path()
    with Console(stderr=True).status("loading model…"):
        return Engine.from_config(config)


def engine_from_options(config: EngineConfig, *, mode: str | None, max_ctx: int | None) -> Engine:
    """The engine of a command's checked options (engine_config) in another mode and context: `bench`'s
    loading engine, which lends its weights to the engines of every mode."""
    return load_engine(replace(config, mode=mode, max_ctx=max_ctx))


def run_command(
    prompt: str, config: EngineConfig, sampling: SamplingParams, max_tokens: int, chat: bool, as_json: bool
) -> None:
    """One prompt in, the reply streamed to stdout (or one JSON object), a summary line on stderr."""
    check_request(max_tokens, config.max_ctx)  # every option checked before torch and the model load
    from flashtree.engine.generate import GenerationStats

    engine = load_engine(config)
    prompt_ids = engine.encode(prompt, chat=chat)
    stats = GenerationStats(engine.mode)
    text, token_ids = [], []
    with prefill_progress(len(prompt_ids)) as on_prefill:
        for chunk in engine.stream(prompt_ids, max_tokens, sampling, stats=stats, on_prefill=on_prefill):
            text.append(chunk.text)
            token_ids.extend(chunk.token_ids)
            if not as_json:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
    if as_json:
        print(
            json.dumps(
                {
                    "text": "".join(text),
                    "prompt_token_ids": prompt_ids,
                    "token_ids": token_ids,
                    "kv_types": list(engine.kv_types),
                    **stats.as_dict(),
                }
            )
        )
        return
    sys.stdout.write("\n")
    summary_line(stats, config.mode == AUTO, engine.device.type, engine.kv_types)


LONG_PROMPT = 8192  # tokens: a prompt this long shows its prefill's progress


@contextmanager
def prefill_progress(n_prompt: int):
    """A callback for Engine.stream's `on_prefill` that draws a progress bar on stderr while a long
    prompt is prefilled (gone once the reply starts); None for a short prompt."""
    if n_prompt < LONG_PROMPT:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("prefill"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("prefill", total=n_prompt)
        yield lambda done, total: bar.update(task, completed=done)


def summary_line(stats, auto: bool, device: str, kv_types: tuple[str, str]) -> None:
    """The run's one-line summary on stderr: never wrapped (a log or a pipe gets it whole); with --mode
    auto, what auto chose and why; the KV cache's types; LOSSY and why, when the output is not the full
    model's (--attn-window)."""
    mode = stats.mode
    if auto:
        why = "a draft on CUDA" if mode != "ar" else ("the CPU" if device == "cpu" else "no draft")
        mode += f" (auto: the fastest lossless mode for {why})"
    summary = (
        f"[{mode}] {stats.n_prompt} prompt tokens at {stats.prefill_tok_s:.1f} tok/s, "
        f"{stats.n_generated} generated at {stats.decode_tok_s:.1f} tok/s"
    )
    if stats.mode != "ar":
        summary += f", mean acceptance length {stats.mean_accept_len:.2f}"
    k, v = kv_types
    summary += f", KV cache {k}" if k == v else f", KV cache K {k} V {v}"
    if stats.lossy:
        summary += f", LOSSY: {stats.lossy}"
    Console(stderr=True, soft_wrap=True, markup=False, highlight=False).print(summary, style="dim")


def models_command(as_json: bool) -> None:
    """`flashtree models`: what the Hugging Face cache, Ollama and LM Studio hold, by --target name."""
    from flashtree.gguf.locate import find_models, size_text
    from flashtree.settings import model_stores

    stores = model_stores()
    found = find_models(stores)
    if as_json:
        print(json.dumps([m.as_dict() for m in found]))
        return
    if not found:
        places = [stores.hf_hub, *stores.ollama, *stores.lmstudio]
        print(f"no models found in {', '.join(map(str, places))}")
        return
    from rich.table import Table

    table = Table("name (--target)", "arch", "size", "quant", "path", box=None, pad_edge=False)
    for m in found:
        table.add_row(m.name, m.arch or "?", size_text(m.size), m.quant or "?", str(m.path))
    console = Console()
    if not console.is_terminal:  # a pipe or a file gets whole lines, not paths folded at 80 columns
        console = Console(width=1 << 16)
    console.print(table)
