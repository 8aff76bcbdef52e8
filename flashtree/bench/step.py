"""`flashtree bench-step`: what one step of each kind costs on a target + draft, next to the device ceilings.

Measured in one run: copy bandwidth and bf16 matmul rate (roofline.py); the AR step (a 1-token forward,
eager and, on CUDA, replayed from a CUDA graph, at a fixed position); verify forwards of tree layouts with
N = 16, 23, 32, 64 tokens (eager and graphed); the draft step (DFlash propose + tree build), also with
the draft in fp8 where the device has fp8 (`draft_step_fp8_matrices`, `_all`: kernels/fp8.py); the engine's
own decode steps end to end (AR, and tree: draft + verify + accept + commit, one host read each; CUDA
graphs on CUDA, exactly as `flashtree run` does them); prefill tok/s at 512 and 8192 tokens (in the
engine's chunks); peak memory; and a kernel-time profile of the AR step, the 23-token verify and the draft
steps, so a missed target says what bounds it. Times are medians of CUDA-event timings after warm-up.
AR roofline ratio = (weight bytes read per token / copy bandwidth) / AR step time.

Long context (`--context 8192,65536,262144`): the suite above runs at the first length, and each length
gets a row: the engine's prefill of a prompt that long (tok/s of the whole prompt, in its chunks), then
its AR step and tree step there, each against its own roofline: the bytes that step must read (the
target's weights, the draft's for the tree step, and the KV cache at that length in its type,
`quant/kv.py: vector_bytes`) at the measured copy bandwidth. With --attn-window the decode steps attend
to that many positions only, and the JSON says "lossy".
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import astuple
from pathlib import Path

import torch

from flashtree.bench.roofline import measure_ceilings, weight_bytes
from flashtree.bench.run import device_info, provenance, versions
from flashtree.config import MAX_CONTEXT, SpecConfig, check_attn_window, check_kv_names, lossy_label
from flashtree.convert.inspect import describe
from flashtree.engine.cuda_graphs import kv_bucket
from flashtree.engine.generate import Engine, GenerationStats
from flashtree.engine.memory import free_bytes
from flashtree.engine.prefill import prefill_chunk
from flashtree.errors import FlashtreeError
from flashtree.kernels import fp8
from flashtree.models.attention import Attention
from flashtree.models.dflash import load_draft
from flashtree.models.layers import use_dense_kernel, use_kernels
from flashtree.models.loader import default_device, load_target
from flashtree.quant.kv import vector_bytes
from flashtree.settings import current as current_settings
from flashtree.spec.tree import build_tree

SCHEMA = "flashtree-bench-step/1"
VERIFY_SIZES = (16, 23, 32, 64)
PREFILL_SIZES = (512, 8192)
DEFAULT_CONTEXT = 512  # tokens prefilled before the decode-step measurements (--context)
DRAFT_RING = SpecConfig().draft_ctx  # the draft-step measurements' ring: the engine's default
TREE_TOP_K = 8
PROFILE_TOP = 12


def time_ms(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median wall time of fn() in ms: CUDA events on a GPU (GPU idle gaps included), perf_counter on CPU."""
    for _ in range(warmup):
        fn()
    _sync(device)
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)
    ]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(end) for start, end in events)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def capture_graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """Capture fn() (already warmed up, so kernels are compiled) into a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # PyTorch wants one run on a side stream before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def tree_block(n_tokens: int, block_size: int, vocab: int, device: torch.device, seed: int):
    """A DDTree verify block of `n_tokens` (root + n_tokens - 1 nodes) built from random draft logits."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(block_size - 1, vocab, generator=gen).mul_(4).to(device)  # peaked, like a draft
    tree = build_tree(torch.zeros((), dtype=torch.long, device=device), logits, n_tokens - 1, TREE_TOP_K)
    tokens = torch.randint(0, vocab, (tree.tokens.shape[0],), generator=gen).to(device)
    return tokens, tree.layout


def profile_kernels(fn: Callable[[], object], device: torch.device) -> dict:
    """One call of fn under torch.profiler: total kernel time by category, the top kernels, and wall time.
    Kernel time far below wall time means the step is bound by launches (the Python loop), not the GPU."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        wall_ms = (time.perf_counter() - t0) * 1e3
    kernels = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None)
        us = us if us is not None else getattr(e, "cuda_time_total", 0)
        if e.device_type.name == "CUDA" and us > 0:
            kernels.append({"name": e.key[:120], "calls": e.count, "ms": us / 1e3})
    kernels.sort(key=lambda k: -k["ms"])
    by_category: dict[str, float] = {}
    for k in kernels:
        by_category[_category(k["name"])] = by_category.get(_category(k["name"]), 0.0) + k["ms"]
    return {
        "wall_ms": wall_ms,
        "kernel_ms": sum(k["ms"] for k in kernels),
        "launches": sum(k["calls"] for k in kernels),
        "by_category_ms": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
        "top": kernels[:PROFILE_TOP],
    }


def _category(name: str) -> str:
    n = name.lower()
    for category, keys in (
        ("quant matmul", ("_qmm_kernel",)),
        ("dequant", ("_dequant_kernel",)),
        ("dense gemm", ("gemm", "gemv", "cutlass", "xmma", "sm90_")),
        ("attention", ("flash", "fmha", "attention", "sdpa")),
        ("copy", ("copy", "memcpy", "memset", "fill")),
        ("reduce", ("reduce",)),
    ):
        if any(key in n for key in keys):
            return category
    return "elementwise/other"


def kv_cache_bytes(model, n_tokens: int, k_type: str = "bf16", v_type: str = "bf16") -> int:
    """Bytes of every attention layer's K and V of `n_tokens` positions, in those KV cache types: what a
    decode step at that length reads of the cache."""
    return sum(
        m.n_kv_heads * n_tokens * (vector_bytes(k_type, m.head_dim) + vector_bytes(v_type, m.head_dim))
        for m in model.mixers
        if isinstance(m, Attention)
    )


def parse_contexts(text: str) -> tuple[int, ...]:
    """--context: one length or a comma-separated list, each 1 to MAX_CONTEXT."""
    try:
        contexts = tuple(int(part) for part in str(text).split(","))
    except ValueError:
        raise FlashtreeError(
            f"--context must be a token count or a comma-separated list, not {text!r}"
        ) from None
    for n in contexts:
        if not 1 <= n <= MAX_CONTEXT:
            raise FlashtreeError(f"--context must be >= 1 and <= {MAX_CONTEXT}, got {n}")
    return contexts


class StepBench:
    """The measurements, sharing one loaded target + draft."""

    def __init__(
        self, target: Path, draft: Path, quantized: bool, budget: int, block_size: int, repeats: int,
        context: int = DEFAULT_CONTEXT, longest: int = 0, attn_window: int = 0,
    ):  # fmt: skip
        """longest: the longest prompt a context row prefills; attn_window: the decode steps' window."""
        self.device = default_device()
        self.model, self.gguf = load_target(target, device=self.device, quantized=quantized)
        self.kernels = current_settings().kernels
        self.use_suite_kernels()
        self.draft = load_draft(draft, self.model, fp8_mode="off")
        # the same draft in each fp8 mode (kernels/fp8.py), timed next to it where the device has fp8
        modes = fp8.MODES[1:] if fp8.supported(self.device) else ()
        self.fp8_drafts = {mode: load_draft(draft, self.model, fp8_mode=mode) for mode in modes}
        self.n_quant_linears = sum(type(m).__name__ == "QuantLinear" for m in self.model.modules())
        self.budget, self.block_size, self.repeats, self.context = budget, block_size, repeats, context
        self.attn_window = attn_window
        self.vocab = self.model.config.vocab
        self.capture = self.draft.config.target_layer_ids
        gen = torch.Generator(device="cpu").manual_seed(0)
        n_prompt = max(*PREFILL_SIZES, context, longest)
        self.prompt = torch.randint(0, self.vocab, (n_prompt,), generator=gen).to(self.device)

    def use_suite_kernels(self) -> None:
        """The settings' kernels for the suite's steps: the arithmetic theirs or the plain AR engine's (int8
        unless set), decode rows of fp32 matrices in our kernel."""
        use_kernels(self.model, self.kernels, speculative=False)
        use_dense_kernel(self.model, self.kernels.dense_kernel_for(speculative=True))

    def time(self, fn: Callable[[], object], repeats: int | None = None) -> float:
        return time_ms(fn, self.device, repeats or self.repeats)

    def chunk(self, n_prompt: int) -> int:
        """The engine's prefill chunk for a prompt of n_prompt tokens here (flashtree/engine/prefill.py)."""
        free, fixed = free_bytes(self.device), current_settings().prefill_chunk
        return prefill_chunk(self.model.config, n_prompt, free, self.device.type, fixed)

    def decode_state(self):
        """A state holding `context` prompt tokens (prefilled in the engine's chunks), and the draft
        features of the last DRAFT_RING of them."""
        state = self.model.new_state(self.context + 4 * self.repeats + 256)
        chunk = self.chunk(self.context)
        features = []
        for s in range(0, self.context, chunk):
            end = min(s + chunk, self.context)
            out = self.model(self.prompt[s:end], state, logits="none", capture=self.capture)
            state.advance(end - s)
            if end > self.context - DRAFT_RING:
                features.append(out.features)
        return state, torch.cat(features)[-DRAFT_RING:]

    def n_keys(self, state) -> int | None:
        """The KV read length a graphed engine step uses here (its bucket), None on the CPU."""
        if self.device.type != "cuda":
            return None
        return kv_bucket(self.context + 1 + self.budget, state.max_ctx)

    def ar_step(self, state) -> tuple[Callable[[], object], float]:
        token = self.prompt[:1].clone()
        n_keys = self.n_keys(state)

        def step():
            state.seq_len = self.context  # every call (and replay) decodes at the same position
            state.position.fill_(self.context)
            return self.model(token, state, logits="last", n_keys=n_keys, window=self.attn_window)

        return step, self.time(step)

    def graph_ms(self, step: Callable[[], object]) -> float:
        graph = capture_graph(step)
        return self.time(graph.replay)

    def verify(self, state, n_tokens: int) -> tuple[Callable[[], object], dict]:
        tokens, layout = tree_block(n_tokens, self.block_size, self.vocab, self.device, seed=n_tokens)
        n_keys = self.n_keys(state)
        step = lambda: self.model(  # noqa: E731
            tokens, state, layout, commit=False, capture=self.capture, n_keys=n_keys, window=self.attn_window
        )
        found = {"eager_ms": self.time(step, max(3, self.repeats // 4))}
        if self.device.type == "cuda":
            found["graph_ms"] = _try(lambda: self.graph_ms(step))
        return step, found

    def draft_step(self, features: torch.Tensor, state, draft) -> tuple[Callable[[], object], dict]:
        ctx = draft.new_context(DRAFT_RING, block=self.block_size)
        draft.append_context(ctx, features)
        root = torch.zeros((), dtype=torch.long, device=self.device)
        n_keys = self.n_keys(state)  # the ring read the engine's step makes at this length
        logits = draft.propose(ctx, root, self.block_size, n_keys)
        propose = lambda: draft.propose(ctx, root, self.block_size, n_keys)  # noqa: E731
        tree = lambda: build_tree(root, logits, self.budget, TREE_TOP_K)  # noqa: E731
        found = {"propose_ms": self.time(propose), "tree_ms": self.time(tree)}
        found["total_ms"] = found["propose_ms"] + found["tree_ms"]
        if self.device.type == "cuda":
            found["graph_ms"] = _try(lambda: self.graph_ms(lambda: (propose(), tree())))
        return lambda: (propose(), tree()), found

    def engine_steps(self, context: int | None = None) -> dict:
        """Per-step time of the engine's own decoding (Engine.generate, greedy, stop tokens off) from
        `context` prompt tokens (default: the suite's): AR, and tree mode with this draft (random
        weights accept little, so the tree step costs what it costs whatever the acceptance); and each
        engine's prefill of the prompt (`{mode}_prefill_ms`). Each engine in its own kernels, as
        Engine.load gives them (the tree's arithmetic is the speculating engine's: bf16 unless set). One
        engine at a time holds a cache."""
        found = {}
        for mode in ("ar", "tree"):
            use_kernels(self.model, self.kernels, speculative=mode != "ar")
            found |= self._engine_step(mode, context or self.context)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # the next engine's cache where this one's was
        self.use_suite_kernels()
        return found

    def engine_step_count(self) -> int:
        """Steps an engine row runs: a warm-up pair, then the timed ones."""
        return 2 + self.repeats

    def engine_slots(self) -> int:
        """The cache slots an engine row needs past its prompt: its steps' tokens and two spare steps'."""
        return (self.engine_step_count() + 2) * (self.budget + 1)

    def check_contexts(self, contexts: tuple[int, ...]) -> None:
        """Before any measurement: each row's prompt and engine steps within the model's context length."""
        limit = self.model.config.context_length
        longest = limit - self.engine_slots()
        for n in contexts:
            if n > longest:
                raise FlashtreeError(
                    f"--context {n} leaves no room for the timed steps within the model's context length "
                    f"of {limit}: at most {longest} at --budget {self.budget} and --repeats {self.repeats}"
                )

    def _engine_step(self, mode: str, context: int) -> dict:
        spec = SpecConfig(mode=mode, budget=self.budget, block_size=self.block_size)
        steps = self.engine_step_count()
        max_ctx = context + self.engine_slots()
        draft = self.draft if mode == "tree" else None
        engine = Engine(self.model, None, draft, spec, max_ctx, current_settings(), self.attn_window)
        stats = GenerationStats(mode)
        prompt = self.prompt[:context].tolist()
        tokens = engine.generate(prompt, max_tokens=steps * (self.budget + 1), stop_ids=(), stats=stats)
        next(tokens)  # prefill
        step_ms = _try(lambda: self.time(lambda: next(tokens)))
        return {f"{mode}_prefill_ms": stats.prefill_s * 1e3, f"{mode}_ms": step_ms}

    def context_row(self, n_tokens: int, copy_gb_s: float, weights: int) -> dict:
        """Prefill of an n_tokens prompt, then the engine's AR and tree steps there, each against its
        roofline: (the weights it reads + the KV cache at n_tokens in the model's KV types) / copy
        bandwidth."""
        steps = self.engine_steps(n_tokens)
        k_type, v_type = self.model.resolved_kv_types
        kv_type = k_type if k_type == v_type else f"K {k_type} V {v_type}"
        kv = kv_cache_bytes(self.model, n_tokens, k_type, v_type)
        ar_roofline = (weights + kv) / (copy_gb_s * 1e9) * 1e3
        tree_roofline = ar_roofline + weight_bytes(self.draft) / (copy_gb_s * 1e9) * 1e3
        row = {"context": n_tokens, "kv_type": kv_type, "kv_bytes": kv, "prefill_chunk": self.chunk(n_tokens)}
        for mode in ("ar", "tree"):
            prefill_ms = steps[f"{mode}_prefill_ms"]
            row[f"{mode}_prefill_tok_s"] = n_tokens / prefill_ms * 1e3 if prefill_ms else None
        row |= {"ar_ms": steps["ar_ms"], "ar_roofline_ms": ar_roofline}
        row |= {"tree_ms": steps["tree_ms"], "tree_roofline_ms": tree_roofline}
        for mode, roofline in (("ar", ar_roofline), ("tree", tree_roofline)):
            ms = steps[f"{mode}_ms"]
            row[f"{mode}_roofline_ratio"] = roofline / ms if isinstance(ms, float) else None
        return row

    def prefill(self, n_tokens: int) -> dict:
        state = self.model.new_state(n_tokens + 1)
        chunk = self.chunk(n_tokens)

        def run():
            state.reset()
            for s in range(0, n_tokens, chunk):
                last = s + chunk >= n_tokens
                part = self.prompt[s : min(s + chunk, n_tokens)]
                self.model(part, state, logits="last" if last else "none")
                state.advance(part.shape[0])  # the next chunk reads this one's keys, as the engine's does

        ms = time_ms(run, self.device, repeats=3, warmup=1)
        return {"tokens": n_tokens, "ms": ms, "tok_s": n_tokens / ms * 1e3}


def _best(found: dict, eager_key: str = "eager_ms") -> float:
    """The graphed time when it was measured, else the eager one."""
    graph = found.get("graph_ms")
    return graph if isinstance(graph, float) else found[eager_key]


def _try(fn: Callable[[], object]):
    """fn(), or the error as text: one failed measurement must not lose the others."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - reported in the results
        return f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def run_bench_step(
    target: Path,
    draft: Path,
    budget: int,
    block_size: int,
    quantized: bool | None,
    repeats: int,
    verify_sizes: tuple[int, ...] = VERIFY_SIZES,
    prefill_sizes: tuple[int, ...] = PREFILL_SIZES,
    context: int = DEFAULT_CONTEXT,
    contexts: tuple[int, ...] = (),
    kv_type: str | None = None,
    attn_window: int = 0,
) -> dict:
    """Every measurement of one run, as a JSON-ready dict (`quantized`: see loader.Weights); a row per
    length of `contexts` (StepBench.context_row); every cache in KV type kv_type (K and V; None: the
    model's compute dtype)."""
    made_by = provenance()
    device = default_device()
    ceilings = measure_ceilings(device)
    longest = max(contexts, default=0)
    bench = StepBench(target, draft, quantized, budget, block_size, repeats, context, longest, attn_window)
    bench.check_contexts(contexts)
    bench.model.set_kv_types(kv_type, kv_type)  # every state from here: the suite's, the rows' engines'
    results = _measure(bench, device, verify_sizes, prefill_sizes)
    info = describe(bench.gguf)
    results["ratios"] = _ratios(results, bench, info["bytes_per_token"] / (ceilings.copy_gb_s * 1e9) * 1e3)
    weights = info["bytes_per_token"]
    results["contexts"] = [bench.context_row(n, ceilings.copy_gb_s, weights) for n in contexts]
    results["kv_types"] = list(bench.model.resolved_kv_types)
    results["lossy"] = lossy_label(attn_window)
    if bench.n_quant_linears:
        results["tiles"] = {key: list(astuple(tile)) for key, tile in bench.kernels.tiles.items()}
        results["arithmetic"] = bench.kernels.arithmetic_for(speculative=False)
        results["engine_arithmetic"] = {
            "ar": results["arithmetic"],
            "tree": bench.kernels.arithmetic_for(True),
        }
    return {
        "schema": SCHEMA,
        **made_by,  # git, settings
        "device": device_info(device),
        "versions": versions(),
        "ceilings": ceilings.as_dict(),
        "weights": "quantized" if bench.n_quant_linears else "dense",
        "quant_linears": bench.n_quant_linears,
        "target": {
            "file": str(target),
            "bytes_per_token": info["bytes_per_token"],
            "file_bytes": info["file_bytes"],
        },
        "draft_model": {"dir": str(draft), "layers": bench.draft.config.n_layers},
        "budget": budget,
        "block_size": block_size,
        "context_tokens": context,
        **results,
    }


def _measure(bench: StepBench, device: torch.device, verify_sizes, prefill_sizes) -> dict:
    """The step timings (eager and graphed), the engine's steps, prefill, kernel profiles, peak memory."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    state, features = bench.decode_state()
    ar_fn, ar_ms = bench.ar_step(state)
    ar_graph_ms = _try(lambda: bench.graph_ms(ar_fn)) if device.type == "cuda" else None
    verify = {n: bench.verify(state, n) for n in verify_sizes}
    drafts = {"draft_step": bench.draft} | {f"draft_step_fp8_{m}": d for m, d in bench.fp8_drafts.items()}
    draft_steps = {name: bench.draft_step(features, state, d) for name, d in drafts.items()}
    profiled = {"ar_step": ar_fn, f"verify_{verify_sizes[1]}": verify[verify_sizes[1]][0]}
    profiled |= {name: fn for name, (fn, _) in draft_steps.items()}
    return {
        "ar": {"eager_ms": ar_ms, "graph_ms": ar_graph_ms},
        "verify_ms": {str(n): _best(found) for n, (_, found) in verify.items()},
        "verify": {str(n): found for n, (_, found) in verify.items()},
        **{name: found for name, (_, found) in draft_steps.items()},
        "engine_step_ms": bench.engine_steps(),
        "prefill": [bench.prefill(n) for n in prefill_sizes],
        "profile": {name: _try(lambda fn=fn: profile_kernels(fn, device)) for name, fn in profiled.items()},
        "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
    }


def _ratios(results: dict, bench: StepBench, roofline_ms: float) -> dict:
    """The AR step against the roofline; verify and draft steps against the AR step."""
    ar_ms, ar_graph_ms = results["ar"]["eager_ms"], results["ar"]["graph_ms"]
    best_ar = ar_graph_ms if isinstance(ar_graph_ms, float) else ar_ms
    ratios = {
        "ar_roofline_ms": roofline_ms,
        "ar_roofline_ratio": roofline_ms / best_ar,
        "ar_roofline_ratio_eager": roofline_ms / ar_ms,
        "verify_23_over_ar": results["verify_ms"].get("23", float("nan")) / best_ar,
        "draft_over_ar": _best(results["draft_step"], "total_ms") / best_ar,
    }
    for mode in bench.fp8_drafts:
        ratios[f"draft_fp8_{mode}_over_ar"] = _best(results[f"draft_step_fp8_{mode}"], "total_ms") / best_ar
    return ratios


def _context_line(row: dict) -> str:
    ratios = [row[f"{mode}_roofline_ratio"] for mode in ("ar", "tree")]
    ar_ratio, tree_ratio = (f"{x:.2f}" if isinstance(x, float) else "-" for x in ratios)
    prefill = row["ar_prefill_tok_s"]
    return (
        f"context {row['context']:>7} ({row['kv_type']}): prefill {prefill or 0:8.0f} tok/s,"
        f" AR {_ms(row['ar_ms'])} ({ar_ratio} of roofline), tree {_ms(row['tree_ms'])} ({tree_ratio})"
    )


def _ms(value) -> str:
    return f"{value:8.3f} ms" if isinstance(value, float) else str(value)


def _arithmetic(r: dict) -> str:
    return f" ({r['arithmetic']} arithmetic, FLASHTREE_QMM_ARITH)" if "arithmetic" in r else ""


def _engine_arithmetic(arithmetic: dict, mode: str) -> str:
    return f" ({arithmetic[mode]})" if mode in arithmetic else ""


def summary_lines(r: dict) -> list[str]:
    ar = r["ratios"]
    best = ar["ar_roofline_ms"] / ar["ar_roofline_ratio"]
    lines = [
        f"ceilings: copy {r['ceilings']['copy_gb_s']:.0f} GB/s,"
        f" {r['ceilings']['matmul_dtype']} matmul {r['ceilings']['matmul_tflops']:.0f} TFLOP/s",
        f"weights: {r['weights']}{_arithmetic(r)},"
        f" {r['target']['bytes_per_token'] / 1e9:.2f} GB read per token",
        f"AR step eager     {_ms(r['ar']['eager_ms'])}",
        f"AR step graph     {_ms(r['ar']['graph_ms'])}",
        f"AR roofline       {_ms(ar['ar_roofline_ms'])}  ratio {ar['ar_roofline_ratio']:.2f}"
        f" (eager {ar['ar_roofline_ratio_eager']:.2f})",
    ]
    lines += [f"verify N={n:<3}      {_ms(ms)}  {ms / best:5.2f}x AR" for n, ms in r["verify_ms"].items()]
    fp8_rows = [(f"draft_step_fp8_{m}", f"draft, fp8 {m}") for m in fp8.MODES[1:]]
    for key, label in [("draft_step", "draft step"), *fp8_rows]:
        if key in r:
            d = r[key]
            lines.append(
                f"{label:<18}{_ms(_best(d, 'total_ms'))}  {_best(d, 'total_ms') / best:5.2f}x AR"
                f" (eager: propose {d['propose_ms']:.3f} + tree {d['tree_ms']:.3f})"
            )
    e, arith = r["engine_step_ms"], r.get("engine_arithmetic", {})
    lines.append(
        f"engine AR step    {_ms(e['ar_ms'])}{_engine_arithmetic(arith, 'ar')}   "
        f"engine tree step {_ms(e['tree_ms'])}{_engine_arithmetic(arith, 'tree')}"
    )
    lines += [f"prefill {p['tokens']:>5}     {p['tok_s']:8.0f} tok/s" for p in r["prefill"]]
    if r["peak_memory_gb"] is not None:
        lines.append(f"peak memory       {r['peak_memory_gb']:.1f} GB")
    lines += [_context_line(row) for row in r.get("contexts", [])]
    if "projection" in r:
        lines.append(projection_line(r["projection"]))
    if r.get("lossy"):
        lines.append(f"LOSSY: {r['lossy']} (the decode steps' attention is not the full model's)")
    for name, prof in r["profile"].items():
        if isinstance(prof, dict):
            cats = ", ".join(f"{k} {v:.2f}" for k, v in prof["by_category_ms"].items())
            lines.append(
                f"profile {name}: wall {prof['wall_ms']:.2f} ms, kernels {prof['kernel_ms']:.2f} ms"
                f" in {prof['launches']} launches ({cats})"
            )
    return lines


WEIGHTS = {"auto": None, "packed": True, "dense": False}  # --weights -> load_target's `quantized`


def accept_histogram_of(path: Path) -> list[int]:
    """The tree steps' histogram of a `flashtree bench` results.json (report.accept_histogram: steps by
    tokens emitted), or a FlashtreeError naming what is wrong with the file."""
    from flashtree.bench.report import accept_histogram

    try:
        rows = json.loads(Path(path).read_text(encoding="utf-8"))["rows"]
        hist = accept_histogram(rows, "tree")
    except FileNotFoundError:
        raise FlashtreeError(f"--accept-from {path}: not found") from None
    except (ValueError, KeyError, TypeError) as e:
        raise FlashtreeError(f"--accept-from {path}: not a `flashtree bench` results.json ({e})") from None
    if not sum(hist[1:]):
        raise FlashtreeError(f"--accept-from {path}: no tree steps (run `flashtree bench --modes tree`)")
    return hist


def projection(results: dict, hist: list[int], source: str) -> dict:
    """What a run with histogram `hist` (steps by tokens emitted) would decode at the step costs of
    `results` (a bench-step JSON): each tree step emits its accepted tokens at the engine's tree-step cost;
    AR emits one token a step, in the speculative engine's arithmetic and in plain decoding's."""
    steps = sum(hist[1:])
    accept_len = sum(n * count for n, count in enumerate(hist)) / steps
    engine = results["engine_step_ms"]
    plain_ms = results["ar"]["graph_ms"] or results["ar"]["eager_ms"]
    tree = accept_len * 1e3 / engine["tree_ms"]
    return {
        "source": source,
        "tree_steps": steps,
        "mean_accept_len": accept_len,
        "tree_tok_s": tree,
        "engine_ar_tok_s": 1e3 / engine["ar_ms"],
        "plain_ar_tok_s": 1e3 / plain_ms,
        "tree_over_engine_ar": tree * engine["ar_ms"] / 1e3,
        "tree_over_plain_ar": tree * plain_ms / 1e3,
    }


def projection_line(p: dict) -> str:
    return (
        f"projected at {p['source']}'s acceptance (AL {p['mean_accept_len']:.2f}): tree {p['tree_tok_s']:.0f}"
        f" tok/s = {p['tree_over_engine_ar']:.2f}x the engine's AR, {p['tree_over_plain_ar']:.2f}x plain AR"
    )


def bench_step_command(
    target: Path, draft: Path, budget: int, block_size: int, out: Path, weights: str, repeats: int,
    context: str | int = DEFAULT_CONTEXT, attn_window: int = 0, kv_type: str | None = None,
    accept_from: Path | None = None,
) -> None:  # fmt: skip
    """context: a length or a comma-separated list of them: the suite runs at the first, and each gets a
    long-context row. accept_from: a `flashtree bench` results.json whose tree acceptance projects the
    measured steps into a throughput (`projection`)."""
    if weights not in WEIGHTS:
        raise FlashtreeError(f"--weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    for path in (target, draft):
        if not Path(path).exists():
            raise FlashtreeError(f"{path}: not found")
    if repeats < 1:
        raise FlashtreeError(f"--repeats must be >= 1, got {repeats}")
    contexts = parse_contexts(str(context))
    check_attn_window(attn_window)
    check_kv_names(kv_type)
    hist = accept_histogram_of(accept_from) if accept_from is not None else None
    result = run_bench_step(
        target, draft, budget, block_size, WEIGHTS[weights], repeats, context=contexts[0], contexts=contexts,
        kv_type=kv_type, attn_window=attn_window,
    )  # fmt: skip
    flags = ["--budget", str(budget), "--block-size", str(block_size), "--weights", weights]
    flags += ["--context", ",".join(map(str, contexts)), "--attn-window", str(attn_window)]
    flags += ["--kv-type", kv_type] if kv_type else []
    if hist is not None:
        result["projection"] = projection(result, hist, str(accept_from))
        flags += ["--accept-from", str(accept_from)]
    result["command"] = " ".join(
        ["flashtree", "bench-step", "--target", str(target), "--draft", str(draft), *flags]
        + ["--repeats", str(repeats), "--out", str(out)]
    )
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print("\n".join(summary_lines(result)))
