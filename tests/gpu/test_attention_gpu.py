"""The decode/verify attention (kernels/attention.py) on the GPU at its default settings: the 27B's heads
(bf16) and SmolLM2's (fp32), after 600 committed tokens, in caches whose splits are one tile and several:
within rounding of the masked SDPA, and every node of a tree equal to the AR step at its position bit
for bit, with more splits launched too (benchmarks/checks.py; benchmarks/gpu_attention.py runs the same
check under each setting it times)."""

import itertools

import pytest

from benchmarks.checks import ATTENTION_CACHES, ATTENTION_HEADS, check_attention_case

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("heads,cache", list(itertools.product(ATTENTION_HEADS, ATTENTION_CACHES)))
def test_attention_matches_sdpa_and_ar_rows(heads, cache):
    row = check_attention_case(heads, cache)
    assert row["ok"], f"{row['kernel']}: max |err| {row['max_abs_err']:.2e} >= {row['tol']} from SDPA"
    assert row["rows_bitwise"], f"{row['kernel']}: a verify row differs from its AR step"
