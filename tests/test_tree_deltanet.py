"""The Triton tree DeltaNet kernel vs the torch recurrence, on CPU through Triton's interpreter."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is compiled: run it on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402

from flashtree.kernels.tree_deltanet import tree_delta_rule  # noqa: E402
from flashtree.models.deltanet import l2_normalize, recurrent_delta_rule  # noqa: E402

TREES = {
    "chain": [-1, 0, 1, 2, 3],
    "tree": [-1, 0, 1, 0, 3, 1, 5, 2, -1],  # siblings, a branch back up, a second root child
}


@pytest.mark.parametrize("shape", [(3, 16, 8), (2, 12, 40)], ids=["pow2", "ragged"])
@pytest.mark.parametrize("tree", TREES, ids=list(TREES))
def test_tree_kernel_matches_torch_recurrence(shape, tree):
    h, kd, vd = shape
    parents = torch.tensor(TREES[tree])
    t = parents.shape[0]
    gen = torch.Generator().manual_seed(t + kd)
    q = l2_normalize(torch.randn(t, h, kd, generator=gen)) * kd**-0.5
    k = l2_normalize(torch.randn(t, h, kd, generator=gen))
    v = torch.randn(t, h, vd, generator=gen)
    g = -torch.rand(t, h, generator=gen)
    beta = torch.rand(t, h, generator=gen)
    s0 = torch.randn(h, kd, vd, generator=gen) * 0.3
    ref_o, ref_states = recurrent_delta_rule(q, k, v, g, beta, s0, parents.tolist())
    o, states = tree_delta_rule(q, k, v, g, beta, s0, parents, block_v=16)
    torch.testing.assert_close(o, ref_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, ref_states, atol=1e-5, rtol=1e-5)
