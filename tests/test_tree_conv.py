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


def conv_inputs(t, channels, kernel, seed, dtype=torch.float32):
    """The conv state, the block's inputs as a column slice of a wider projection (as MergedLinear
    returns them) and the weight."""
    gen = torch.Generator().manual_seed(seed)
    state = torch.randn(kernel - 1, channels, generator=gen).to(dtype)
    new = torch.randn(t, channels + 7, generator=gen).to(dtype)[:, 3 : 3 + channels]
    weight = torch.randn(channels, kernel, generator=gen).to(dtype)
    return state, new, weight


@pytest.mark.parametrize("channels", [40, 300], ids=["one-tile", "ragged-tiles"])
@pytest.mark.parametrize("tree", TREES, ids=list(TREES))
def test_tree_conv_matches_the_formula_and_is_row_independent(tree, channels):
    kernel = 4
    layout = BlockLayout.from_parents(torch.tensor(TREES[tree]))
    t = layout.size
    state, new, weight = conv_inputs(t, channels, kernel, seed=t + channels)
    src = torch.cat([state, new])
    index = layout.conv_window_index(kernel)

    windows = torch.full((t, kernel - 1, channels), float("nan"))
    got = tree_conv_silu(state, new, index, weight, windows, block_c=128)
    torch.testing.assert_close(got, torch_conv(src, index, weight), atol=1e-6, rtol=1e-6)
    assert torch.equal(windows, src[index][:, 1:])  # each token's last kernel-1 inputs, exactly
    # each token alone, from the same source rows: bit-identical rows
    alone = torch.cat([tree_conv_silu(state, new, index[i : i + 1], weight, block_c=128) for i in range(t)])
    assert torch.equal(alone, got)


def test_the_ar_step_updates_the_conv_state_in_place():
    """One token with windows = the state itself: the output of the old window, and the state shifted
    by one row with the token's input last (what the next step reads)."""
    kernel, channels = 4, 300
    state, new, weight = conv_inputs(1, channels, kernel, seed=3)
    src = torch.cat([state, new])
    index = BlockLayout.chain(1).conv_window_index(kernel)
    want = torch_conv(src, index, weight)
    got = tree_conv_silu(state, new, index, weight, state[None], block_c=128)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert torch.equal(state, src[1:])


def test_windows_are_checked():
    state, new, weight = conv_inputs(3, 40, 4, seed=0)
    index = BlockLayout.chain(3).conv_window_index(4)
    buffer = torch.randn(3, 3, 40)  # windows over the state's memory
    with pytest.raises(ValueError, match="single token"):
        tree_conv_silu(buffer[0], new, index, weight, buffer)
    with pytest.raises(ValueError, match="contiguous"):
        tree_conv_silu(state, new, index, weight, torch.empty(3, 2, 40))


def test_tree_conv_reads_bf16_and_computes_in_fp32():
    state, new, weight = conv_inputs(5, 64, 4, seed=0, dtype=torch.bfloat16)
    index = BlockLayout.chain(5).conv_window_index(4)
    windows = torch.empty(5, 3, 64, dtype=torch.bfloat16)
    got = tree_conv_silu(state, new, index, weight, windows)
    assert got.dtype == torch.float32
    src = torch.cat([state, new])
    torch.testing.assert_close(got, torch_conv(src.float(), index, weight.float()), atol=1e-6, rtol=1e-6)
    assert torch.equal(windows, src[index][:, 1:])
