"""Speculative decoding is lossless: chain and tree outputs equal plain decoding, greedy and sampled."""

import random

import pytest
import torch

from flashtree.config import SamplingParams, SpecConfig
from flashtree.engine.cuda_graphs import MIN_KEYS, StepRunner
from flashtree.engine.generate import Engine
from flashtree.models.loader import load_target
from flashtree.spec import decoder as spec_decoder
from tests.spec_util import OracleDraft, engine, generate, random_draft
from tests.tiny import tiny_gguf

FAMILIES = ["llama", "qwen3", "qwen35"]
N_NEW = 16


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tiny_root):
    gguf = tiny_gguf(request.param, 0, tiny_root)
    target, _ = load_target(gguf, device="cpu", dtype=torch.float32)
    return target, random_draft(gguf, target, tiny_root, layers=1)


def prompts(n, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(n)]


CONFIGS = [dict(mode="chain", block_size=b) for b in (2, 4, 8, 16)] + [
    dict(mode="tree", block_size=16, budget=b) for b in (1, 4, 22, 64)
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_greedy_identity_random_draft(pair, config):
    target, draft = pair
    for prompt in prompts(50, target.config.vocab, seed=len(config)):
        ar, _ = generate(target, None, prompt, N_NEW)
        spec, _ = generate(target, draft, prompt, N_NEW, **config)
        assert spec == ar, f"prompt {prompt}"


ORACLE_CONFIGS = [
    dict(mode="chain", block_size=16),
    dict(mode="tree", block_size=16, budget=22),
    dict(mode="tree", block_size=8, budget=64),
]


@pytest.mark.parametrize("error", [0.0, 0.15, 0.4])
@pytest.mark.parametrize("config", ORACLE_CONFIGS, ids=["chain16", "tree16-22", "tree8-64"])
def test_greedy_identity_oracle_draft(pair, error, config, monkeypatch):
    target, _ = pair
    walks = []
    real_accept = spec_decoder.accept_path

    def recording_accept(tokens, layout, samples):
        accepted = real_accept(tokens, layout, samples)
        walks.append((layout, accepted.path[: int(accepted.n)].tolist()))
        return accepted

    monkeypatch.setattr(spec_decoder, "accept_path", recording_accept)
    hist_total = [0] * 17
    for i, prompt in enumerate(prompts(8, target.config.vocab, seed=3)):
        ar, _ = generate(target, None, prompt, 48)
        oracle = OracleDraft(prompt + ar, target.config.vocab, config["block_size"], error, seed=i)
        spec, stats = generate(target, oracle, prompt, 48, **config)
        assert spec == ar
        # every token after the prefill's counted once: none past max_tokens (a perfect draft's last
        # step accepts more than fits)
        assert sum(n * c for n, c in enumerate(stats.accept_hist)) + 1 == len(spec)
        for n, c in enumerate(stats.accept_hist):
            hist_total[n] += c
    block = config["block_size"]
    covers_all = config.get("budget", 0) >= 2 * (block - 1)  # room for the chain + every runner-up
    if error == 0.0 or (covers_all and error < 0.2):  # perfect draft, or a tree that recovers from it
        assert hist_total[block] >= sum(hist_total) - 8
    else:  # a realistic draft: many different accept lengths, down to 1 and up to the block size
        assert sum(c > 0 for c in hist_total) >= 4
        if config["mode"] == "chain":
            assert hist_total[block if error < 0.2 else 1] > 0
    if config["mode"] == "tree" and error > 0:
        depths = [int(layout.depths.max()) for layout, _ in walks]
        assert max(depths) >= block - 2  # deep trees
        branched = [
            (layout, path) for layout, path in walks
            if any(int(layout.parents[n]) != n - 1 for n in path[1:])
        ]  # fmt: skip
        assert branched, "no accepted path ever left the greedy chain"


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=1.3, top_p=0.9, seed=2),
     SamplingParams(temperature=1.0, top_k=5, seed=3)],
    ids=["t0.7", "t1.3-p0.9", "t1-k5"],
)  # fmt: skip
def test_sampled_output_identical_to_ar_sampling(pair, sampling):
    """Position-keyed sampling noise makes speculative sampling emit exactly AR's sample."""
    target, draft = pair
    for i, prompt in enumerate(prompts(10, target.config.vocab, seed=7)):
        ar, _ = generate(target, None, prompt, N_NEW, sampling)
        oracle = OracleDraft(prompt + ar, target.config.vocab, 16, 0.2, seed=i)
        assert generate(target, draft, prompt, N_NEW, sampling, mode="tree", budget=22)[0] == ar
        assert generate(target, oracle, prompt, N_NEW, sampling, mode="tree", budget=22)[0] == ar
        assert generate(target, oracle, prompt, N_NEW, sampling, mode="chain")[0] == ar


HOST_READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "nonzero", "cpu", "numpy")


@pytest.mark.parametrize("mode", ["ar", "chain", "tree"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_one_host_read_per_decode_step(tiny_root, family, mode, monkeypatch):
    """On a GPU every read of a tensor's value on the host waits for the device, so a decode step
    (draft, tree, verify, sample, accept, commit) may read back once: the tokens it emits.
    (qwen35 is left out: its CPU DeltaNet recurrence walks the parents on the host by design, where
    CUDA runs the Triton tree kernel on the device parents; so is the CPU's row-invariant attention,
    which reads a verify's tree on the host where CUDA runs tree_attention.)"""
    from flashtree.models.layers import use_row_invariant

    gguf = tiny_gguf(family, 0, tiny_root)
    target, _ = load_target(gguf, device="cpu", dtype=torch.float32)
    use_row_invariant(target, False)
    draft = None if mode == "ar" else random_draft(gguf, target, tiny_root, layers=1)
    e = engine(target, draft, mode=mode)
    prompt = prompts(1, target.config.vocab, seed=7)[0]
    steps = e.generate(prompt, 40, SamplingParams(temperature=0.8, seed=1), stop_ids=[])
    next(steps)  # the prefill's first token
    reads = []
    for name in HOST_READS:
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _real=real, _n=name, **k: (
            reads.append(_n), _real(self, *a, **k))[1])  # fmt: skip
    for _ in range(5):
        reads.clear()
        next(steps)
        assert len(reads) == 1, reads


BUCKETED_CONFIGS = [
    dict(mode="ar"),
    dict(mode="chain", block_size=8),
    dict(mode="tree", block_size=8, budget=12),
]


@pytest.mark.parametrize("config", BUCKETED_CONFIGS, ids=["ar", "chain8", "tree8-12"])
@pytest.mark.parametrize(
    "sampling", [SamplingParams(), SamplingParams(temperature=0.9, seed=4)], ids=["greedy", "t0.9"]
)
def test_fixed_shape_steps_emit_the_exact_steps_tokens(pair, config, sampling):
    """The steps CUDA graphs replay read the KV cache in fixed buckets (keys past the committed length
    masked) and keep the host's books from the step's read-back; run eagerly here, they must emit
    exactly plain decoding's tokens, with an oracle draft so long paths and branches are committed,
    and leave the host's and the device's committed length equal."""
    target, draft = pair
    mode = config["mode"]
    for i, prompt in enumerate(prompts(4, target.config.vocab, seed=11)):
        ar, _ = generate(target, None, prompt, 40, sampling)
        oracle = OracleDraft(prompt + ar, target.config.vocab, 8, 0.2, seed=i)
        e = Engine(target, None, None if mode == "ar" else oracle, SpecConfig(**config), max_ctx=300)
        e.runner = StepRunner(e.state, graphs=False, bucketed=True)
        assert e.runner.n_keys(len(prompt) + 1) == MIN_KEYS  # reads past the committed length
        got = [t for step in e.generate(prompt, 40, sampling, stop_ids=()) for t in step]
        assert got == ar
        # the last step may commit past the 40 tokens it is clipped to
        assert e.state.seq_len == int(e.state.position) >= len(prompt) + 40 - 1
