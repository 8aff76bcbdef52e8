"""The Triton causal-conv kernel vs GatedDeltaNet's torch path, on CPU through Triton's interpreter."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is compiled: run it on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flashtree.kernels.tree_conv import tree_conv_silu  # noqa: E402
from flashtree.models.block import BlockLayout  # noqa: E402

TREES = {
    "single": [-1],  # the AR step
    "chain": [-1, 0, 1, 2, 3, 4],
    "tree": [-1, 0, 1, 0, 3, 1, 5, 2, -1],  # siblings, a branch back up, a second root child
}


def torch_conv(src, index, weight):
    """The formula: SiLU of each token's window (oldest first) times the taps, summed."""
    return F.silu((src[index] * weight.t()[None]).sum(1))


@pytest.mark.parametrize("channels", [40, 300], ids=["one-tile", "ragged-tiles"])
@pytest.mark.parametrize("tree", TREES, ids=list(TREES))
def test_tree_conv_matches_the_formula_and_is_row_independent(tree, channels):
    kernel = 4
    layout = BlockLayout.from_parents(torch.tensor(TREES[tree]))
    t = layout.size
    gen = torch.Generator().manual_seed(t + channels)
    src = torch.randn(kernel - 1 + t, channels, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    index = layout.conv_window_index(kernel)

    got = tree_conv_silu(src, index, weight, block_c=128)
    torch.testing.assert_close(got, torch_conv(src, index, weight), atol=1e-6, rtol=1e-6)
    # each token alone, from the same source rows: bit-identical rows
    alone = torch.cat([tree_conv_silu(src, index[i : i + 1], weight, block_c=128) for i in range(t)])
    assert torch.equal(alone, got)


def test_tree_conv_reads_bf16_and_computes_in_fp32():
    gen = torch.Generator().manual_seed(0)
    src = torch.randn(3 + 5, 64, generator=gen).bfloat16()
    weight = torch.randn(64, 4, generator=gen).bfloat16()
    index = BlockLayout.chain(5).conv_window_index(4)
    got = tree_conv_silu(src, index, weight)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch_conv(src.float(), index, weight.float()), atol=1e-6, rtol=1e-6)
