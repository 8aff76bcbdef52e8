"""flashtree bench-step on a tiny synthetic qwen35 target + draft, on CPU: every measurement is there,
positive, and the ratios are the documented quotients of the measured numbers."""

import json
import math

import pytest

from flashtree.bench import step
from flashtree.convert.synth import synth_draft, synth_model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-step")
    target = root / "t.gguf"
    synth_model("tiny-qwen35", "q4_k_m", target, seed=5)
    synth_draft(target, 1, root / "draft", seed=5)
    return target, root / "draft"


def test_bench_step_measures_everything(pair, monkeypatch):
    monkeypatch.setattr(step, "DRAFT_RING", 16)  # the draft's ring keeps the last 16 of the 24 positions
    monkeypatch.setenv("FLASHTREE_PREFILL_CHUNK", "10")  # the context prefilled in 3 chunks
    kernels_for = []  # each use_kernels call's engine kind: the speculating one's only for tree rows
    real_use_kernels = step.use_kernels
    monkeypatch.setattr(
        step,
        "use_kernels",
        lambda m, k, speculative: kernels_for.append(speculative) or real_use_kernels(m, k, speculative),
    )
    target, draft = pair
    r = step.run_bench_step(
        target, draft, 6, 4, None, 1, verify_sizes=(4, 7), prefill_sizes=(16, 40), context=24,
        contexts=(24, 40), kv_type="q8_0",
    )  # fmt: skip
    # the suite's, then AR, tree and the suite's again for the suite's engine steps and each context row
    assert kernels_for == [False] + [False, True, False] * 3
    json.dumps(r)  # JSON-ready
    assert r["context_tokens"] == 24 and r["lossy"] is None and r["kv_types"] == ["q8_0", "q8_0"]
    assert r["weights"] == "dense" and r["quant_linears"] == 0  # CPU: the dense path
    assert r["ceilings"]["copy_gb_s"] > 0 and r["ceilings"]["matmul_tflops"] > 0
    assert r["ar"]["eager_ms"] > 0 and r["ar"]["graph_ms"] is None  # no CUDA graphs on CPU
    assert set(r["verify_ms"]) == {"4", "7"} and all(v > 0 for v in r["verify_ms"].values())
    d = r["draft_step"]
    assert d["total_ms"] == pytest.approx(d["propose_ms"] + d["tree_ms"])
    assert [p["tokens"] for p in r["prefill"]] == [16, 40]
    assert all(p["tok_s"] == pytest.approx(p["tokens"] / p["ms"] * 1e3) for p in r["prefill"])
    ratios = r["ratios"]
    roofline = r["target"]["bytes_per_token"] / (r["ceilings"]["copy_gb_s"] * 1e9) * 1e3
    assert ratios["ar_roofline_ms"] == pytest.approx(roofline)
    assert ratios["ar_roofline_ratio"] == pytest.approx(roofline / r["ar"]["eager_ms"])
    assert ratios["draft_over_ar"] == pytest.approx(d["total_ms"] / r["ar"]["eager_ms"])
    for mode in ("matrices", "all"):  # the CPU has torch's fp8 GEMM
        d8 = r[f"draft_step_fp8_{mode}"]
        assert ratios[f"draft_fp8_{mode}_over_ar"] == pytest.approx(d8["total_ms"] / r["ar"]["eager_ms"])
    assert math.isnan(ratios["verify_23_over_ar"])  # 23 was not measured here
    assert {"ar_step", "verify_7", "draft_step", "draft_step_fp8_matrices", "draft_step_fp8_all"} <= set(
        r["profile"]
    )
    copy = r["ceilings"]["copy_gb_s"] * 1e9
    for row, n in zip(r["contexts"], (24, 40), strict=True):  # the long-context rows, in q8_0
        # tiny-qwen35: 2 attention layers of 2 KV heads, K and V each 64 int8 values + 2 fp16 scales
        assert row["context"] == n and row["kv_type"] == "q8_0" and row["prefill_chunk"] == 10
        assert row["kv_bytes"] == 2 * 2 * 2 * (64 + 4) * n
        assert row["ar_prefill_tok_s"] > 0 and row["tree_prefill_tok_s"] > 0
        weights = r["target"]["bytes_per_token"]
        assert row["ar_roofline_ms"] == pytest.approx((weights + row["kv_bytes"]) / copy * 1e3)
        assert row["tree_roofline_ms"] > row["ar_roofline_ms"]  # the draft's weights too
        for mode in ("ar", "tree"):
            ratio = row[f"{mode}_roofline_ms"] / row[f"{mode}_ms"]
            assert row[f"{mode}_roofline_ratio"] == pytest.approx(ratio)
    lines = step.summary_lines(r)
    assert sum(line.startswith("context ") for line in lines) == 2
    assert any(line.startswith("AR roofline") for line in lines)
    assert any("verify N=7" in line for line in lines)
    assert any(line.startswith("draft, fp8 all") for line in lines)


def test_bench_step_refuses_missing_files_and_unknown_weights(tmp_path):
    from flashtree.errors import FlashtreeError

    with pytest.raises(FlashtreeError, match="not found"):
        step.bench_step_command(tmp_path / "no.gguf", tmp_path, 22, 16, tmp_path / "o.json", "auto", 3)
    with pytest.raises(FlashtreeError, match="--weights must be one of auto, packed, dense"):
        step.bench_step_command(tmp_path / "no.gguf", tmp_path, 22, 16, tmp_path / "o.json", "quant", 3)
    (tmp_path / "t.gguf").touch()
    with pytest.raises(FlashtreeError, match="--context must be >= 1 and <= 1048576, got 0"):
        step.bench_step_command(tmp_path / "t.gguf", tmp_path, 22, 16, tmp_path / "o.json", "auto", 3, 0)
    with pytest.raises(FlashtreeError, match="--context must be a token count or a comma-separated list"):
        step.bench_step_command(tmp_path / "t.gguf", tmp_path, 22, 16, tmp_path / "o.json", "auto", 3, "8K")
    with pytest.raises(FlashtreeError, match="--attn-window must be between 0 and"):
        step.bench_step_command(
            tmp_path / "t.gguf", tmp_path, 22, 16, tmp_path / "o.json", "auto", 3, "8", -1
        )


def test_bench_step_refuses_a_context_past_the_model_before_measuring(pair, monkeypatch):
    from flashtree.errors import FlashtreeError

    target, draft = pair
    measured = []
    monkeypatch.setattr(step, "_measure", lambda *a: measured.append(a))
    bench = step.StepBench(target, draft, None, 6, 4, 1)
    limit = bench.model.config.context_length
    longest = limit - (1 + 4) * (6 + 1)  # the engine rows' 1 + 4 steps of budget + 1 tokens
    bench.check_contexts((16, longest))  # the longest that fits
    with pytest.raises(FlashtreeError, match=f"--context {longest + 1} leaves no room .* at most {longest}"):
        step.run_bench_step(target, draft, 6, 4, None, 1, context=16, contexts=(16, longest + 1))
    assert not measured  # refused before the suite ran


def _bench_results(path, hists: dict[str, list[list[int]]]):
    """A `flashtree bench` results.json holding only what the projection reads: rows with histograms."""
    rows = [{"mode": mode, "accept_hist": h} for mode, hs in hists.items() for h in hs]
    path.write_text(json.dumps({"rows": rows}))
    return path


def test_the_projection_is_the_tree_acceptance_over_the_measured_step_costs(tmp_path):
    # two prompts' tree steps: 3 steps of 1 token, 2 of 3, 1 of 6 -> 15 tokens in 6 steps; AR rows ignored
    tree = [[0, 2, 0, 2], [0, 1, 0, 0, 0, 0, 1]]
    path = _bench_results(tmp_path / "r.json", {"tree": tree, "ar": [[0, 9]]})
    hist = step.accept_histogram_of(path)
    assert hist == [0, 3, 0, 2, 0, 0, 1]
    results = {"engine_step_ms": {"ar_ms": 10.0, "tree_ms": 20.0}, "ar": {"graph_ms": 8.0, "eager_ms": 50.0}}
    p = step.projection(results, hist, "r.json")
    assert p["tree_steps"] == 6 and p["mean_accept_len"] == pytest.approx(2.5)
    assert p["tree_tok_s"] == pytest.approx(2.5 / 20e-3)  # 125 tok/s
    assert p["engine_ar_tok_s"] == pytest.approx(100) and p["plain_ar_tok_s"] == pytest.approx(125)
    assert p["tree_over_engine_ar"] == pytest.approx(1.25) and p["tree_over_plain_ar"] == pytest.approx(1.0)
    assert "AL 2.50" in step.projection_line(p) and "1.25x the engine's AR" in step.projection_line(p)


def test_accept_from_refuses_what_is_not_a_tree_run_before_measuring(tmp_path, pair):
    from flashtree.errors import FlashtreeError

    target, draft = pair
    ar_only = _bench_results(tmp_path / "ar.json", {"ar": [[0, 5]]})
    (tmp_path / "bad.json").write_text("{not json")
    cases = [
        (tmp_path / "none.json", "not found"),
        (tmp_path / "bad.json", "not a `flashtree bench` results"),
        (ar_only, "no tree steps"),
    ]
    for path, message in cases:
        with pytest.raises(FlashtreeError, match=message):
            step.bench_step_command(target, draft, 22, 16, tmp_path / "o.json", "auto", 3, accept_from=path)
    assert not (tmp_path / "o.json").exists()
