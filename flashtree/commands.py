"""`flashtree run`: one prompt in, a streamed reply out (or one JSON object with --json)."""

from __future__ import annotations

import json
import sys

from rich.console import Console

from flashtree.config import SamplingParams, SpecConfig, check_request
from flashtree.generate import Engine, GenerationStats


def engine_from_options(
    target,
    draft,
    mode,
    max_ctx,
    device,
    block_size=None,
    budget=22,
    tree_top_k=8,
    chain_seed=False,
    draft_ctx=4096,
    draft_temperature=1.0,
) -> Engine:
    """The engine every CLI command builds from its --target/--draft/--mode/... options."""
    spec = SpecConfig(
        mode=mode or "tree",
        block_size=block_size,
        budget=budget,
        tree_top_k=tree_top_k,
        chain_seed=chain_seed,
        draft_ctx=draft_ctx,
        draft_temperature=draft_temperature,
    )
    with Console(stderr=True).status("loading model…"):
        return Engine.load(target, draft, mode=mode, spec=spec, max_ctx=max_ctx, device=device)


def run_command(
    prompt,
    target,
    draft,
    mode,
    max_tokens,
    temperature,
    top_p,
    top_k,
    seed,
    block_size,
    budget,
    tree_top_k,
    chain_seed,
    draft_ctx,
    draft_temperature,
    max_ctx,
    no_chat_template,
    as_json,
    device,
) -> None:
    # every option checked before the model loads: a bad one costs nothing
    check_request(max_tokens, max_ctx)
    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    engine = engine_from_options(
        target,
        draft,
        mode,
        max_ctx,
        device,
        block_size,
        budget,
        tree_top_k,
        chain_seed,
        draft_ctx,
        draft_temperature,
    )
    prompt_ids = engine.encode(prompt, chat=not no_chat_template)
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
