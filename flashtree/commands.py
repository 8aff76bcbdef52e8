"""`flashtree run`: one prompt in, a streamed reply out (or one JSON object with --json)."""

from __future__ import annotations

import json
import sys

from rich.console import Console

from flashtree.config import EngineConfig, SamplingParams, SpecConfig, check_request
from flashtree.generate import Engine, GenerationStats


def engine_config(
    target, draft, mode, max_ctx, device, *, block_size=None, budget=22, tree_top_k=8, chain_seed=False,
    draft_ctx=4096, draft_temperature=1.0,
) -> EngineConfig:  # fmt: skip
    """The EngineConfig of a command's --target/--draft/--mode/... options (checked: nothing loads yet)."""
    spec = SpecConfig(
        mode=mode or "tree", block_size=block_size, budget=budget, tree_top_k=tree_top_k,
        chain_seed=chain_seed, draft_ctx=draft_ctx, draft_temperature=draft_temperature,
    )  # fmt: skip
    return EngineConfig(target, draft, mode, spec, max_ctx, device)


def load_engine(config: EngineConfig) -> Engine:
    with Console(stderr=True).status("loading model…"):
        return Engine.from_config(config)


def engine_from_options(target, draft, mode, max_ctx, device, block_size=None, budget=22) -> Engine:
    """The engine of the server's, the chat's and the benchmark's options."""
    config = engine_config(target, draft, mode, max_ctx, device, block_size=block_size, budget=budget)
    return load_engine(config)


def run_command(
    prompt: str, config: EngineConfig, sampling: SamplingParams, max_tokens: int, chat: bool, as_json: bool
) -> None:
    """One prompt in, the reply streamed to stdout (or one JSON object), a summary line on stderr."""
    check_request(max_tokens, config.max_ctx)  # every option checked before the model loads
    engine = load_engine(config)
    prompt_ids = engine.encode(prompt, chat=chat)
    stats = GenerationStats(engine.mode)
    text, token_ids = [], []
    for chunk in engine.stream(prompt_ids, max_tokens, sampling, stats=stats):
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
                    **stats.as_dict(),
                }
            )
        )
        return
    sys.stdout.write("\n")
    summary = (
        f"\\[{stats.mode}] {stats.n_prompt} prompt tokens at {stats.prefill_tok_s:.1f} tok/s, "
        f"{stats.n_generated} generated at {stats.decode_tok_s:.1f} tok/s"
    )
    if stats.mode != "ar":
        summary += f", mean acceptance length {stats.mean_accept_len:.2f}"
    Console(stderr=True).print(summary, style="dim")
