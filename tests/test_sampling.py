"""Sampling: filters, the position-keyed noise, and the exact output distribution of tree mode."""

import itertools
import math

import pytest
import torch

from flashtree.config import SamplingParams
from flashtree.engine.sampling import filter_logits, sample, target_probs, uniform_noise
from flashtree.models.loader import load_target
from tests.spec_util import generate, random_draft
from tests.tiny import tiny_gguf


def test_noise_is_uniform_and_position_keyed():
    u = uniform_noise(7, torch.arange(64), 4096)
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.003 and abs(float(u.var()) - 1 / 12) < 0.002
    assert torch.equal(uniform_noise(7, torch.tensor([5]), 4096)[0], u[5])  # depends on (seed, pos) only
    assert not torch.equal(uniform_noise(8, torch.tensor([5]), 4096)[0], u[5])
    corr = torch.corrcoef(torch.stack([u[0], u[1]]))[0, 1]
    assert abs(float(corr)) < 0.05


def test_top_k_top_p_filters():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    assert torch.isinf(filter_logits(logits, SamplingParams(temperature=1, top_k=2)))[0].tolist() == [
        False, False, True, True
    ]  # fmt: skip
    # top_p 0.7: 0.5 + 0.25 reaches it, so the 0.15 and 0.1 tokens go.
    kept = ~torch.isinf(filter_logits(logits, SamplingParams(temperature=1, top_p=0.7)))[0]
    assert kept.tolist() == [True, True, False, False]
    probs = target_probs(logits, SamplingParams(temperature=1, top_p=0.7))[0]
    torch.testing.assert_close(probs, torch.tensor([2 / 3, 1 / 3, 0, 0]))


def test_sample_frequencies_match_probs():
    logits = torch.randn(1, 6, generator=torch.Generator().manual_seed(0)) * 2
    params = SamplingParams(temperature=0.8, top_k=4, seed=3)
    n = 20000
    draws = sample(logits.expand(n, -1), params, torch.arange(n))
    freq = torch.bincount(draws, minlength=6).float() / n
    torch.testing.assert_close(freq, target_probs(logits, params)[0], atol=0.012, rtol=0)


def wilson_hilferty_z(chi2: float, dof: int) -> float:
    """Normal approximation of a chi-square statistic's upper tail (z > 4 ~ p < 3e-5)."""
    return ((chi2 / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))


# Enough that noise shared by neighbouring positions, or top-p left out of the sampler, fails far past the
# bound (z 25-110 against 4 when tried); about a minute a case on 2 cores.
JOINT_SAMPLES = 6000


def exact_joint(target, prompt, params, vocab, n_tokens=3):
    """p(x1..x3 | prompt) from the target's own conditionals, enumerating every prefix."""
    probs = {}
    for seq in itertools.product(range(vocab), repeat=n_tokens):
        p = 1.0
        for i in range(n_tokens):
            ids = torch.tensor(prompt + list(seq[:i]))
            logits = target(ids, target.new_state(32), logits="last").logits
            p *= float(target_probs(logits, params)[0, seq[i]])
        probs[seq] = p
    return probs


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_p=0.8)],
    ids=["t1", "t0.6-p0.8"],
)
def test_tree_mode_joint_distribution_equals_target(params, tiny_root):
    vocab, n = 6, JOINT_SAMPLES
    gguf = tiny_gguf("llama", 3, tiny_root, vocab=vocab)
    target, _ = load_target(gguf, device="cpu", dtype=torch.float32)
    draft = random_draft(gguf, target, tiny_root, layers=1)
    prompt = [1, 4, 2]
    expected = exact_joint(target, prompt, params, vocab)
    counts = dict.fromkeys(expected, 0)
    for seed in range(n):
        p = SamplingParams(params.temperature, params.top_p, params.top_k, seed)
        out, _ = generate(target, draft, prompt, 3, p, mode="tree", block_size=4, budget=6, tree_top_k=3)
        counts[tuple(out)] += 1
    # Chi-square over cells expected >= 5 times; the rest pooled into one cell.
    big = [s for s in expected if expected[s] * n >= 5]
    chi2 = sum((counts[s] - n * expected[s]) ** 2 / (n * expected[s]) for s in big)
    rest_e = n * (1 - sum(expected[s] for s in big))
    rest_o = n - sum(counts[s] for s in big)
    if rest_e >= 5:
        chi2 += (rest_o - rest_e) ** 2 / rest_e
    dof = len(big) - (rest_e < 5)
    assert wilson_hilferty_z(chi2, dof) < 4.0, (chi2, dof)
