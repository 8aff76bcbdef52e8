"""The one-launch DDTree build vs spec/tree.py's torch path, on CPU through Triton's interpreter: the
same nodes, parents, depths and ancestor matrix."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is compiled: run it on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402

from flashtree.kernels.ddtree import TOPK_CHUNK, draft_topk  # noqa: E402
from flashtree.spec.tree import build_tree, fills_budget  # noqa: E402


@pytest.mark.parametrize("chain_seed", [True, False])
@pytest.mark.parametrize(
    "budget,top_k,depth", [(22, 8, 15), (22, 3, 4), (8, 2, 5), (40, 4, 3), (5, 3, 6), (1, 8, 16), (63, 4, 5)]
)
@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_builds_the_torch_paths_tree(kernels_path, chain_seed, budget, top_k, depth, seed):
    assert fills_budget(top_k, depth, budget)
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(depth, 300, generator=g)
    root = torch.tensor(7)
    kernels_path("torch")
    want = build_tree(root, logits, budget, top_k, chain_seed)
    kernels_path("triton")
    got = build_tree(root, logits, budget, top_k, chain_seed)
    assert torch.equal(got.tokens, want.tokens)
    assert torch.equal(got.layout.parents, want.layout.parents)
    assert torch.equal(got.layout.depths, want.layout.depths)
    assert torch.equal(got.layout.visible, want.layout.visible)


def test_kernel_is_used_only_when_the_budget_is_always_filled(monkeypatch, kernels_path):
    """A tiny vocabulary can hold fewer than `budget` paths: the torch path counts them (a host sync)."""
    calls = []
    kernels_path("triton")
    monkeypatch.setattr("flashtree.kernels.ddtree.ddtree", lambda *a: calls.append(a) or None)
    build_tree(torch.tensor(1), torch.randn(2, 3), 20, 3)  # 3 + 9 paths < 20
    assert not calls


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("vocab", [300, 2 * TOPK_CHUNK + 77])  # one chunk; three, the last partial
def test_draft_topk_is_torchs_log_softmax_topk(vocab, temperature):
    g = torch.Generator().manual_seed(vocab)
    logits = 4 * torch.randn(6, vocab, generator=g)
    logp, tok = draft_topk(logits, 8, temperature)
    want_logp, want_tok = torch.log_softmax(logits / temperature, dim=-1).topk(8, dim=-1)
    assert torch.equal(tok, want_tok)
    # A log-prob is logit - max - log(sum): exact up to a few ulp of the scaled logits' size, whatever
    # order the sum takes (torch's own CPU kernels change it with the CPU's vector width).
    exact = torch.log_softmax(logits.double() / temperature, dim=-1).gather(1, want_tok)
    ulp = torch.finfo(torch.float32).eps * (logits / temperature).abs().amax(dim=1, keepdim=True).double()
    assert ((logp.double() - exact).abs() <= 4 * ulp).all()


def test_draft_topk_takes_the_lower_token_on_ties():
    """Equal logits in different chunks and in one chunk: the lower token first, each token once."""
    logits = torch.full((2, 3 * TOPK_CHUNK), -5.0)
    logits[0, [TOPK_CHUNK + 3, 7, 2 * TOPK_CHUNK + 1, 9]] = 2.0  # four tied, across three chunks
    logits[1, 100:110] = 1.0  # ten tied in one chunk
    _, tok = draft_topk(logits, 3, 1.0)
    assert tok.tolist() == [[7, 9, TOPK_CHUNK + 3], [100, 101, 102]]


@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_builds_the_torch_paths_tree_over_a_large_vocabulary(kernels_path, seed):
    """Several top-k chunks per depth, the default budget and block."""
    logits = 3 * torch.randn(15, 3 * TOPK_CHUNK - 5, generator=torch.Generator().manual_seed(seed))
    kernels_path("torch")
    want = build_tree(torch.tensor(7), logits, 22, 8)
    kernels_path("triton")
    got = build_tree(torch.tensor(7), logits, 22, 8)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.layout.parents, want.layout.parents)
