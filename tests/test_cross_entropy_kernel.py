"""kernels/cross_entropy.py (draft training's loss over a chunk of logits, gradient in place) vs the torch
path of train/loss.py, on CPU through Triton's interpreter. Vocabularies span several of the kernels'
blocks and end inside one, so the masked tails are exercised. The kernel sums in another order than
torch: fp32 results agree to 1e-6 relative, bf16 gradients to one unit in the last place."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are compiled: run them on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402
from test_fused_kernels import close  # noqa: E402

from flashtree.kernels.cross_entropy import (  # noqa: E402
    GRAD_BLOCK,
    STATS_BLOCK,
    cross_entropy_rows_torch,
    cross_entropy_rows_triton,
)
from flashtree.train.loss import FrozenHeadCrossEntropy  # noqa: E402

VOCAB = STATS_BLOCK + GRAD_BLOCK + 77  # three stats blocks, two gradient blocks, both ending inside one


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_equal_the_torch_path(dtype):
    gen = torch.Generator().manual_seed(3)
    rows = 6
    logits = (4 * torch.randn(rows, VOCAB, generator=gen)).to(dtype)
    labels = torch.randint(0, VOCAB, (rows,), generator=gen)
    labels[0] = logits[0].float().argmax()  # a row whose label is its argmax
    labels[1] = VOCAB - 1  # the last column, inside the masked tail
    w = torch.rand(rows, generator=gen)
    want_loss, want_correct, want_grad = cross_entropy_rows_torch(logits.clone(), labels, w)
    got = logits.clone()
    loss, correct, grad = cross_entropy_rows_triton(got, labels, w)
    assert grad is got  # in place
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    assert correct.tolist() == want_correct.tolist() and correct[0]
    close(got, want_grad.to(dtype))


def test_argmax_is_the_first_maximum_across_and_within_lanes():
    """bf16 logits tie often; `correct` counts a row right only where torch's argmax (the first maximum)
    is its label."""
    logits = torch.zeros(3, VOCAB)
    for row, cols in enumerate([(5, 5 + STATS_BLOCK, VOCAB - 1), (STATS_BLOCK + 9, 9), (VOCAB - 1,)]):
        logits[row, list(cols)] = 7.0
    labels = torch.tensor([5, 9, VOCAB - 1])
    _, correct, _ = cross_entropy_rows_triton(logits.clone(), labels, torch.ones(3))
    assert correct.tolist() == [True, True, True]
    later = torch.tensor([5 + STATS_BLOCK, STATS_BLOCK + 9, 0])  # a later maximum; a lower logit
    _, correct, _ = cross_entropy_rows_triton(logits.clone(), later, torch.ones(3))
    assert correct.tolist() == [False, False, False]


@pytest.mark.parametrize("chunk_rows", [1000, 3])  # one chunk; several, the last one short
def test_frozen_head_cross_entropy_takes_the_kernel_with_the_same_result(
    monkeypatch, kernels_path, chunk_rows
):
    gen = torch.Generator().manual_seed(8)
    n, hidden_size = 7, 16
    weight = torch.randn(VOCAB, hidden_size, generator=gen) / 4
    labels = torch.randint(0, VOCAB, (n,), generator=gen)
    w = torch.rand(n, generator=gen)
    h = torch.randn(n, hidden_size, generator=gen)
    monkeypatch.setattr(FrozenHeadCrossEntropy, "CHUNK_ELEMENTS", chunk_rows * VOCAB)
    results = {}
    for use_kernel in (False, True):
        kernels_path("triton" if use_kernel else "torch")
        leaf = h.clone().requires_grad_(True)
        loss, correct = FrozenHeadCrossEntropy.apply(leaf, weight, labels, w)
        (2.0 * loss).backward()
        results[use_kernel] = loss, correct, leaf.grad
    (want_loss, want_correct, want_grad), (loss, correct, grad) = results[False], results[True]
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    assert correct.tolist() == want_correct.tolist()
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-7)
