"""benchmarks/kv_quality.py's choice of K and V types: one type for both, or K/V."""

from __future__ import annotations

from benchmarks.kv_quality import kv_pair


def test_a_kind_names_one_type_for_both_or_k_and_v():
    assert kv_pair("tq3_0") == ("tq3_0", "tq3_0")
    assert kv_pair("q8_0/tq3_0") == ("q8_0", "tq3_0")
