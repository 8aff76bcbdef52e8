"""The tree Gated DeltaNet (kernels/tree_deltanet.py) on the GPU at its default tile and the 27B's heads:
within 1e-5 of the torch reference in fp32 on a tree with siblings, and bit for bit each token alone
(from its parent's state) equal to its row of the launch, the AR step writing its state in place, the
verify as the model runs it and the commit's replay of each node's path (benchmarks/checks.py;
benchmarks/gpu_deltanet.py runs the same check for each tile it times)."""

import pytest

from benchmarks.checks import TOL, check_tree_deltanet

pytestmark = pytest.mark.gpu


def test_tree_deltanet_matches_reference_and_rows():
    row = check_tree_deltanet()
    assert row["ok"], f"max |err| {row['max_abs_err']:.2e} >= {TOL} from the torch reference"
    assert row["rows_bitwise"], f"rows differ: {row['bitwise']}"
