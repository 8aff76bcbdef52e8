"""Long context (issue #39, parts 4-6) on tiny models on the CPU: the prefill chunk rule, a model's chunked
prefill through the prefill attention kernel (interpreted) against the torch path, --attn-window (a
verify computes what the windowed AR step does, so chain/tree == AR with the same window; a window as long
as the context is full attention), and the draft's feature ring decoding far past its length."""

import random

import pytest
import torch

from flashtree.config import EngineConfig, SamplingParams, SpecConfig
from flashtree.engine.generate import Engine, GenerationStats
from flashtree.engine.prefill import MAX_CHUNK, MIN_CHUNK, prefill_chunk
from flashtree.errors import FlashtreeError
from flashtree.models.block import BlockLayout
from flashtree.models.loader import load_target
from flashtree.models.pass_ import ForwardPass
from tests.spec_util import feed, random_draft
from tests.tiny import tiny_gguf

FAMILIES = ["llama", "qwen3", "qwen35"]
GIB = 1 << 30


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tiny_root):
    gguf = tiny_gguf(request.param, 0, tiny_root)
    target, _ = load_target(gguf, device="cpu", dtype=torch.float32)
    return target, random_draft(gguf, target, tiny_root, layers=1)


def decode(target, draft, prompt, n, attn_window=0, **spec):
    """Greedy tokens of one generation (stop ids off) and the engine that made them."""
    mode = spec.pop("mode", "tree" if draft is not None else "ar")
    engine = Engine(target, None, draft, SpecConfig(mode=mode, **spec), 512, attn_window=attn_window)
    stats = GenerationStats(engine.mode)
    steps = engine.generate(prompt, n, SamplingParams(), stop_ids=(), stats=stats)
    return [t for step in steps for t in step], engine, stats


def prompts(n, vocab, seed=0, longest=40):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, longest))] for _ in range(n)]


class _Config:  # the fields prefill_chunk reads: the 27B's widths
    hidden, ffn, n_heads = 5120, 17408, 24


def test_the_prefill_chunk_follows_the_prompt_and_the_free_memory():
    c = _Config()
    assert prefill_chunk(c, 100_000, 64 * GIB, "cuda") == MAX_CHUNK["cuda"]
    assert prefill_chunk(c, 1000, 64 * GIB, "cuda") == 1000  # never longer than the prompt
    small = prefill_chunk(c, 100_000, GIB, "cuda")
    assert MIN_CHUNK <= small < MAX_CHUNK["cuda"] and small & (small - 1) == 0
    assert prefill_chunk(c, 100_000, 0, "cuda") == MIN_CHUNK
    assert prefill_chunk(c, 100_000, GIB, "cuda", fixed=300) == 300  # FLASHTREE_PREFILL_CHUNK
    # the 27B's 262K prompt in a 22 GiB budget, 0.98 GiB free after the load: 1024-token chunks, whose
    # activations the H100 measured at 1 / 3 of that (bench/results/h100-long-rows-2026-12-08)
    assert prefill_chunk(c, 261_760, int(0.98 * GIB), "cuda") == 1024
    # the CPU's torch path: the mask and scores over the whole prompt shrink the chunk as it grows, and
    # a 256K prompt's chunk holds them in half of 24 GiB, far from a 256K x 256K anything
    cpu = [prefill_chunk(c, n, 24 * GIB, "cpu") for n in (4096, 65536, 262144)]
    assert cpu[0] == MAX_CHUNK["cpu"] and cpu[0] >= cpu[1] >= cpu[2]
    assert cpu[2] * 262144 * (1 + 4 * c.n_heads) <= 12 * GIB


def test_a_chunked_prefill_through_the_kernel_is_the_torch_paths(pair, monkeypatch, kernels_path):
    """The prompt in chunks of 16 (the first at position 0, the rest past it): the attention through
    kernels/prefill_attention.py (no mask tensor), the last token's logits within fp32 rounding."""
    target, _ = pair
    ids = torch.randint(0, target.config.vocab, (40,), generator=torch.Generator().manual_seed(2))

    def prefill() -> torch.Tensor:
        state = target.new_state(64)
        for s in range(0, 40, 16):
            out = feed(target, ids[s : s + 16], state, logits="last")
        return out.logits

    torch_path = prefill()
    calls = []
    from flashtree.models import attention

    real = attention.prefill_attention
    monkeypatch.setattr(attention, "prefill_attention", lambda *a: calls.append(a[3]) or real(*a))
    kernels_path("triton")
    got = prefill()
    assert sorted(set(calls)) == [0, 16, 32]  # every chunk, from its own start
    torch.testing.assert_close(got, torch_path, rtol=1e-4, atol=1e-4)


def test_a_long_prompt_reports_its_prefill_chunk_by_chunk(pair):
    """`on_prefill(done, total)` after each chunk (FLASHTREE_PREFILL_CHUNK 16: 40 tokens in 3 chunks),
    and the tokens are the ones generated without it; the CLI's bar only for a long prompt."""
    from flashtree.cli.commands import LONG_PROMPT, prefill_progress
    from flashtree.settings import Settings

    target, _ = pair
    prompt = prompts(1, target.config.vocab, seed=7, longest=40)[0] + [1] * 40
    engine = Engine(target, None, None, SpecConfig(mode="ar"), 512, settings=Settings(prefill_chunk=16))
    seen = []
    out = engine.generate(prompt, 4, SamplingParams(), stop_ids=(), on_prefill=lambda *a: seen.append(a))
    tokens = [t for step in out for t in step]
    n = len(prompt)
    assert seen == [(min(s + 16, n), n) for s in range(0, n, 16)]
    assert tokens == decode(target, None, prompt, 4)[0]
    with prefill_progress(LONG_PROMPT - 1) as short:
        assert short is None
    with prefill_progress(LONG_PROMPT) as bar:
        bar(4096, LONG_PROMPT)


def test_a_windowed_mask_is_by_position():
    """The AR step at position 10 with a window of 3 reads keys 8, 9, 10; a tree node at depth d reads
    the committed keys and its ancestors whose positions are among its last 3."""
    layout = BlockLayout.from_parents(torch.tensor([-1, 0, 1, 2, 1]))  # depths 0 1 2 3 2
    fp = ForwardPass(torch.tensor(10), 15, True, layout, False, None, torch.float32, window=3)
    pos = 10 + layout.depths
    key_pos = torch.cat([torch.arange(10), 10 + layout.depths])
    want = layout.visible.clone()
    want = torch.cat([torch.ones(5, 10, dtype=torch.bool), want], dim=1)
    want &= key_pos[None, :] > pos[:, None] - 3
    assert torch.equal(fp.attn_mask, want)
    assert fp.attn_mask[3].nonzero().flatten().tolist() == [11, 12, 13]  # depth 3: its depths 1, 2, 3
    assert fp.attn_mask[4].nonzero().flatten().tolist() == [10, 11, 14]  # depth 2 at slot 14: 0, 1, 2
    assert fp.attn_mask[0].nonzero().flatten().tolist() == [8, 9, 10]
    step = ForwardPass(torch.tensor(10), 11, True, BlockLayout.chain(1), True, None, torch.float32, window=3)
    assert step.attn_mask.nonzero()[:, 1].tolist() == [8, 9, 10]
    full = ForwardPass(torch.tensor(10), 11, True, BlockLayout.chain(1), True, None, torch.float32)
    assert full.attn_mask is None  # no window: one token over an exact read needs no mask


SPECS = [dict(mode="chain", block_size=8), dict(mode="tree", block_size=8, budget=12)]


@pytest.mark.parametrize("spec", SPECS, ids=["chain", "tree"])
def test_with_a_window_speculation_equals_ar_with_the_window(pair, spec):
    target, draft = pair
    window, changed = 6, 0
    for prompt in prompts(6, target.config.vocab, seed=4):
        ar, engine, stats = decode(target, None, prompt, 24, attn_window=window)
        assert engine.lossy == "attn-window 6" and stats.as_dict()["lossy"] == "attn-window 6"
        spec_out, _, spec_stats = decode(target, draft, prompt, 24, attn_window=window, **spec)
        assert spec_out == ar, f"prompt {prompt}"
        assert spec_stats.lossy == "attn-window 6"
        changed += ar != decode(target, None, prompt, 24)[0]
    assert changed  # the window changed some output: it is not a no-op


def test_a_window_as_long_as_the_context_is_full_attention(pair):
    target, draft = pair
    prompt = prompts(1, target.config.vocab, seed=5)[0]
    full, engine, stats = decode(target, None, prompt, 20)
    assert engine.lossy is None and stats.as_dict()["lossy"] is None
    assert decode(target, None, prompt, 20, attn_window=len(prompt) + 20)[0] == full
    assert decode(target, draft, prompt, 20, attn_window=512, **SPECS[1])[0] == full


def test_a_bad_window_is_one_clear_error():
    with pytest.raises(FlashtreeError, match="--attn-window must be between 0 and 1048576, got -1"):
        EngineConfig(attn_window=-1)


@pytest.mark.parametrize("spec", SPECS, ids=["chain", "tree"])
def test_the_drafts_ring_keeps_working_far_past_its_length(pair, spec):
    """A 64-slot ring (draft_ctx 64), prompts shorter and longer than it, decoding well past it: output ==
    AR, and the ring then holds the last 64 positions' features, so the draft proposes what a ring filled
    with just those would (within fp32 rounding: the features came from verifies, here from one pass)."""
    target, draft = pair
    for prompt in prompts(2, target.config.vocab, seed=6, longest=30) + prompts(
        1, target.config.vocab, 7, 150
    ):
        ar = decode(target, None, prompt, 150)[0]
        out, engine, _ = decode(target, draft, prompt, 150, draft_ctx=64, **spec)
        assert out == ar
        ctx, committed = engine.decoder.context, engine.state.seq_len
        assert int(ctx.position) == committed > ctx.slot_pos.shape[0] + 64  # wrapped around the ring
        root = torch.tensor(out[-1])  # the token after the committed ones
        tokens = torch.tensor(prompt + out[:-1])
        assert tokens.shape[0] == committed
        state = target.new_state(committed + 1)
        features = target(tokens, state, logits="none", capture=engine.decoder.capture_layers).features
        fresh = draft.new_context(64, spare=ctx.slot_pos.shape[0] - 64, block=ctx.block)
        fresh.position.fill_(committed - 64)
        draft.append_context(fresh, features[-64:])
        block = engine.decoder.block_size
        want = draft.propose(fresh, root, block)
        torch.testing.assert_close(draft.propose(ctx, root, block), want, rtol=1e-3, atol=1e-3)


def test_the_server_labels_a_windowed_engine_lossy(tiny_root):
    """--attn-window's label on every response of `flashtree serve`: system_fingerprint, the stats'
    "lossy", the X-Flashtree-Lossy header and /health; a full-attention engine's say nothing of it."""
    import httpx

    from flashtree.serve.api import OpenAIServer
    from tests.test_server_fuzz import in_process

    body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
    for window, label in ((0, None), (4, "attn-window 4")):
        engine = Engine.load(
            tiny_gguf("llama", 0, tiny_root), "none", max_ctx=64, device="cpu", attn_window=window
        )
        with in_process(OpenAIServer(engine, "m")) as url:
            assert httpx.get(url + "/health").json()["lossy"] == label
            whole = httpx.post(url + "/v1/completions", json=body, timeout=60)
            streamed = httpx.post(url + "/v1/completions", json=body | {"stream": True}, timeout=60)
        reply = whole.json()
        assert reply["flashtree"]["lossy"] == label and whole.headers.get("x-flashtree-lossy") == label
        assert reply["system_fingerprint"] == "flashtree-ar" + (f" lossy: {label}" if label else "")
        assert streamed.headers.get("x-flashtree-lossy") == label
        assert f'"system_fingerprint": "{reply["system_fingerprint"]}"' in streamed.text


def test_run_says_lossy_and_refuses_a_bad_window(tiny_root):
    """`flashtree run --attn-window 4`: the JSON's "lossy" and the summary line's LOSSY; a negative window
    is one error line before anything loads."""
    import json

    from typer.testing import CliRunner

    from flashtree.cli import app

    target = str(tiny_gguf("llama", 0, tiny_root))
    args = ["run", "--target", target, "--draft", "none", "--device", "cpu", "-p", "hi", "-n", "4"]
    runner = CliRunner()
    reply = runner.invoke(app, [*args, "--attn-window", "4", "--json"])
    assert reply.exit_code == 0, reply.output
    assert json.loads(reply.stdout.splitlines()[-1])["lossy"] == "attn-window 4"
    streamed = runner.invoke(app, [*args, "--attn-window", "4"])
    assert "LOSSY: attn-window 4" in streamed.stderr
    assert "LOSSY" not in runner.invoke(app, args).stderr
    bad = runner.invoke(app, [*args, "--attn-window", "-1"])
    assert bad.exit_code == 1 and "error: --attn-window must be between 0 and" in bad.stderr
