"""CUDA-graph decode steps on the GPU emit exactly the eager steps' tokens.

For tiny random targets of each family (synth: llama f32, qwen3 and qwen35 Q4_K_M; the quantized ones
both with dense weights, as the loader keeps small models, and with the packed-weight kernels) with a
random 1-layer draft: plain eager AR gives the reference tokens of three prompts (5, 37 and 300 tokens,
64 new tokens each); AR, chain and tree engines replaying CUDA graphs must emit exactly them, greedy and
sampled. The graphed steps' times are benchmarks/gpu_profile_steps.py's.
"""

import pytest
import torch

from benchmarks.tiny import tiny_pair
from flashtree.config import SamplingParams, SpecConfig
from flashtree.engine.cuda_graphs import StepRunner
from flashtree.engine.generate import Engine

pytestmark = pytest.mark.gpu

N_NEW = 64
CONFIGS = [
    dict(mode="ar"),
    dict(mode="chain", block_size=16),
    dict(mode="tree", block_size=16, budget=22),
    dict(mode="tree", block_size=8, budget=40),
]
SAMPLINGS = {"greedy": SamplingParams(), "sampled": SamplingParams(temperature=0.8, top_p=0.95, seed=5)}
TARGETS = [  # (shape, GGUF type, packed weights): f32 has no quantized matrices to pack
    ("tiny-llama", "f32", False),
    ("tiny-qwen3", "q4_k_m", False),
    ("tiny-qwen3", "q4_k_m", True),
    ("tiny-qwen35", "q4_k_m", False),
    ("tiny-qwen35", "q4_k_m", True),
]


def decode(engine: Engine, prompt: list[int], sampling: SamplingParams) -> list[int]:
    steps = engine.generate(prompt, N_NEW, sampling, stop_ids=())
    return [token for step in steps for token in step]


@pytest.fixture(scope="module")
def pairs(tiny_dir):
    """(target, draft) by (shape, type, packed), loaded once for the module."""
    loaded = {}

    def get(shape: str, qtype: str, packed: bool):
        if (shape, qtype, packed) not in loaded:
            loaded[(shape, qtype, packed)] = tiny_pair(shape, qtype, tiny_dir, quantized=packed)
        return loaded[(shape, qtype, packed)]

    return get


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize(
    "shape,qtype,packed", TARGETS, ids=[f"{s}-{q}-{'packed' if p else 'dense'}" for s, q, p in TARGETS]
)
def test_graphed_steps_emit_eager_tokens(pairs, shape, qtype, packed, sampling):
    target, draft = pairs(shape, qtype, packed)
    sampling = SAMPLINGS[sampling]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, target.config.vocab, (n,), generator=gen).tolist() for n in (5, 37, 300)]
    ref_engine = Engine(target, None, None, SpecConfig(mode="ar"), max_ctx=1024)
    ref_engine.runner = StepRunner(ref_engine.state, graphs=False)
    refs = [decode(ref_engine, p, sampling) for p in prompts]
    failures = []
    for config in CONFIGS:
        engine = Engine(
            target, None, None if config["mode"] == "ar" else draft, SpecConfig(**config), max_ctx=1024
        )
        assert engine.runner.enabled, "CUDA graphs are off (FLASHTREE_CUDA_GRAPHS=0?)"
        got = [decode(engine, p, sampling) for p in prompts]
        same = [g == r for g, r in zip(got, refs, strict=True)]
        if not all(same):
            failures.append(f"{config}: identical per prompt {same}")
    assert not failures, "; ".join(failures)
