"""The K-splits' summing launch (qmatmul.sum_splits) on the GPU: at the 27B's shapes that a 23-row verify
sums in a second launch, every (block, warps) that benchmarks/gpu_sum_splits.py sweeps gives the default
launch's sums bit for bit (the order of the adds does not depend on the block)."""

import pytest
import torch

from benchmarks import knobs
from benchmarks.gpu_sum_splits import launches, shapes, sums

pytestmark = pytest.mark.gpu

ROWS = 23


@pytest.mark.parametrize("block,warps", launches())
def test_sum_splits_any_launch_same_sums(block, warps):
    found = shapes(ROWS)
    if not found:
        pytest.skip("no 27B shape sums its K-splits in a second launch at 23 rows (the tiles fuse the sum)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in found:
        parts = torch.randn(shape["splits"], ROWS, shape["rows"], device="cuda", generator=gen)
        want = sums(parts)
        with knobs.sum_launch_set(block, warps):
            got = sums(parts)
        assert torch.equal(got, want), f"{shape['name']} {shape['rows']} x {shape['splits']} splits"
