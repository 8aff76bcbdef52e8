"""`flashtree bench`: AR vs chain vs tree decoding (and optionally transformers) on benchmark prompts.

One target + draft is loaded once; each mode gets its own `Engine` around the same weights. Each mode
first runs the longest prompt untimed at full length, so every shape the run meets (KV or static cache
sizes, compiled graphs, kernel choices) has been seen once. Then every prompt goes through every mode,
greedy, and the chain/tree outputs must equal AR's token for token: speculative decoding is lossless,
so any difference is a bug, which fails the run (the results are written first). Writes results.json,
results.md and two PNG plots.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import json
import platform
import shlex
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import flashtree
from flashtree.bench.datasets import REPORT_N, REPORT_SEED, Prompt, load_prompts, parse_dataset_names
from flashtree.bench.report import summarize, write_report
from flashtree.bench.roofline import Ceilings, measure_ceilings, weight_bytes
from flashtree.cli.commands import engine_from_options
from flashtree.config import MODES, EngineConfig, SamplingParams
from flashtree.engine.generate import Engine, GenerationStats
from flashtree.errors import FlashtreeError
from flashtree.settings import current as current_settings

SCHEMA = "flashtree-bench/1"
BASELINES = ("hf", "plain")

Runner = Callable[[list[int], int], tuple[list[int], GenerationStats]]


def parse_modes(modes: str) -> list[str]:
    chosen = list(dict.fromkeys(m.strip() for m in modes.split(",") if m.strip()))
    unknown = [m for m in chosen if m not in MODES]
    if unknown or not chosen:
        raise FlashtreeError(f"--modes: unknown {unknown or modes!r} (choose from {', '.join(MODES)})")
    return chosen


def parse_baselines(baseline: str | None) -> list[str]:
    """--baseline: none, or a comma-separated choice of BASELINES."""
    chosen = list(dict.fromkeys(b.strip() for b in (baseline or "").split(",") if b.strip()))
    unknown = [b for b in chosen if b not in BASELINES]
    if unknown:
        raise FlashtreeError(f"--baseline: unknown {unknown!r} (choose from {', '.join(BASELINES)})")
    return chosen


def engine_runner(engine: Engine) -> Runner:
    def run(prompt_ids: list[int], max_tokens: int) -> tuple[list[int], GenerationStats]:
        stats = GenerationStats(engine.mode)
        steps = engine.generate(prompt_ids, max_tokens, SamplingParams(), stats=stats)  # greedy
        return [t for step in steps for t in step], stats

    return run


def plain_runner(engine: Engine) -> Runner:
    """AR as plain decoding runs it (`flashtree run --mode ar`): the target's matmuls in the kernels
    `Engine.load` picks for a non-speculative engine (cuBLAS's GEMV for dense fp32 weights, the int8
    arithmetic for packed ones, the CPU's plain torch calls), set for each call and put back after it. Its
    CUDA graphs are its own, captured under those kernels. The speculative engines' AR (mode `ar`) is what
    chain/tree must reproduce; this is the fastest AR a user gets, the honest denominator of a speedup."""
    from flashtree.kernels.qlinear import arithmetic_of, use_arithmetic
    from flashtree.models.layers import use_dense_kernel, use_row_invariant

    run_ar = engine_runner(engine)
    target, kernels = engine.target, engine.settings.kernels
    flags = ("dense_kernel", "row_invariant")
    flagged = [m for m in target.modules() if any(hasattr(m, flag) for flag in flags)]

    def run(prompt_ids: list[int], max_tokens: int) -> tuple[list[int], GenerationStats]:
        kept = [{flag: getattr(m, flag) for flag in flags if hasattr(m, flag)} for m in flagged]
        arithmetic = arithmetic_of(target)
        use_dense_kernel(target, kernels.dense_kernel_for(speculative=False))
        use_row_invariant(target, False)
        if arithmetic:
            use_arithmetic(target, kernels.arithmetic_for(speculative=False))
        try:
            return run_ar(prompt_ids, max_tokens)
        finally:  # the speculative engines' kernels back
            for m, values in zip(flagged, kept, strict=True):
                for flag, on in values.items():
                    setattr(m, flag, on)
            if arithmetic:
                use_arithmetic(target, arithmetic)

    return run


def make_runners(base: Engine, modes: list[str], baselines: list[str], max_ctx: int) -> dict[str, Runner]:
    """One runner per mode sharing `base`'s weights, plus the baselines'."""
    if base.draft is None and any(m != "ar" for m in modes):
        raise FlashtreeError("--modes chain/tree need a draft: pass --draft DIR (or --modes ar)")
    runners = {}
    for mode in modes:
        draft = base.draft if mode != "ar" else None
        spec = replace(base.spec, mode=mode)
        engine = Engine(base.target, base.tokenizer, draft, spec, max_ctx, base.settings, base.attn_window)
        runners[mode] = engine_runner(engine)
    if "plain" in baselines:
        ar = replace(base.spec, mode="ar")
        plain = Engine(base.target, base.tokenizer, None, ar, max_ctx, base.settings, base.attn_window)
        runners["plain"] = plain_runner(plain)
    if "hf" in baselines:
        from flashtree.bench.hf_baseline import HFBaseline

        runners["hf"] = HFBaseline(base.target, base.tokenizer.stop_ids, max_ctx).generate
    return runners


def context_for(prompts: list[Prompt], encoded: list[list[int]], max_tokens: int, limit: int) -> int:
    """Context the engines need: the longest prompt plus max_tokens, checked against the target's."""
    longest = max(range(len(prompts)), key=lambda i: len(encoded[i]))
    need = len(encoded[longest]) + max_tokens
    if need > limit:
        p = prompts[longest]
        raise FlashtreeError(
            f"{p.dataset} prompt {p.id} has {len(encoded[longest])} tokens: with --max-tokens {max_tokens} "
            f"it needs {need}, more than the target's context of {limit}"
        )
    return need


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where a and b differ (a shorter one differs where it ends)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_identity(rows: list[dict]) -> list[dict]:
    """Mark every non-AR row with identical_to_ar; return the chain/tree rows that differ (bugs)."""
    reference = {(r["dataset"], r["prompt_id"]): r["output_ids"] for r in rows if r["mode"] == "ar"}
    mismatches = []
    for r in rows:
        ar = reference.get((r["dataset"], r["prompt_id"]))
        if r["mode"] == "ar" or ar is None:
            r["identical_to_ar"] = r["first_difference"] = None
            continue
        r["first_difference"] = first_difference(r["output_ids"], ar)
        r["identical_to_ar"] = r["first_difference"] is None
        if not r["identical_to_ar"] and r["mode"] in MODES:  # a peer's rounding may differ; ours may not
            mismatches.append(
                {
                    "dataset": r["dataset"],
                    "prompt_id": r["prompt_id"],
                    "mode": r["mode"],
                    "at": r["first_difference"],
                }
            )
    return mismatches


def logit_gap(target, prompt_ids: list[int], ar_ids: list[int], at: int, other_ids: list[int]):
    """How far AR's token led the other output's token at their first difference (None past the end of
    either), in the target's logits after the prompt and AR's tokens before it (one fresh forward). A gap
    near zero is a near-tie that rounding can flip (bf16 blocks vs single tokens); a large one, a bug."""
    if at >= min(len(ar_ids), len(other_ids)):
        return None
    ids = torch.tensor(prompt_ids + ar_ids[:at], device=target.device)
    logits = target(ids, target.new_state(len(ids)), logits="last").logits[0]  # (vocab,) fp32
    return float(logits[ar_ids[at]] - logits[other_ids[at]])


def add_logit_gaps(rows: list[dict], mismatches: list[dict], target, prompt_ids: dict) -> None:
    """Every row's logit gap at its first difference from AR (None where it has none), also on mismatches."""
    ar = {(r["dataset"], r["prompt_id"]): r["output_ids"] for r in rows if r["mode"] == "ar"}
    for r in rows:
        key = (r["dataset"], r["prompt_id"])
        differs = r["identical_to_ar"] is False
        at = r["first_difference"]
        r["logit_gap"] = logit_gap(target, prompt_ids[key], ar[key], at, r["output_ids"]) if differs else None
    gaps = {(r["dataset"], r["prompt_id"], r["mode"]): r["logit_gap"] for r in rows}
    for m in mismatches:
        m["logit_gap"] = gaps[m["dataset"], m["prompt_id"], m["mode"]]


def make_row(prompt: Prompt, mode: str, ids: list[int], stats: GenerationStats, tokenizer) -> dict:
    """One prompt's row under the runner's name `mode`: the plain baseline's engine is an AR engine whose
    stats say "ar", and its rows must not count as the AR mode's."""
    total_s = stats.prefill_s + stats.decode_s
    return {
        "dataset": prompt.dataset,
        "prompt_id": prompt.id,
        **stats.as_dict(),
        "mode": mode,
        "ttft_s": stats.prefill_s,
        "prefill_s": stats.prefill_s,
        "decode_s": stats.decode_s,
        "e2e_tok_s": stats.n_generated / total_s if total_s else 0.0,
        "output_ids": ids,
        "text": tokenizer.decode(ids),
    }


def run_all(
    runners: dict[str, Runner], prompts: list[Prompt], encoded: list[list[int]], max_tokens: int, tokenizer
) -> list[dict]:
    """Warm each runner up on the shortest and the longest prompt; then run every prompt through each.
    Why both: an engine captures a CUDA graph for each KV-length bucket its steps reach (and compiles
    kernels for new shapes); the longest prompt alone never reached the shortest prompts' buckets, so
    the first dataset's first prompts paid captures inside their timed decode
    (bench/results/h200-launch-cuts-2026-12-03)."""
    shortest, longest = min(encoded, key=len), max(encoded, key=len)
    warm_ups = [shortest] if shortest is longest else [shortest, longest]
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    rows = []
    with Progress(*columns, console=Console(stderr=True)) as progress:
        task = progress.add_task("warm-up", total=len(runners) * (len(prompts) + len(warm_ups)))
        for (mode, run), ids in itertools.product(runners.items(), warm_ups):
            progress.update(task, description=f"warm-up {mode}")
            run(ids, max_tokens)
            progress.advance(task)
        for prompt, ids in zip(prompts, encoded, strict=True):
            for mode, run in runners.items():
                progress.update(task, description=f"{prompt.dataset} {prompt.id} {mode}")
                output, stats = run(ids, max_tokens)
                rows.append(make_row(prompt, mode, output, stats, tokenizer))
                progress.advance(task)
    return rows


# --- provenance ---------------------------------------------------------------------------------------


def command_line(options: dict) -> str:
    """The `flashtree bench` command that reproduces this run."""
    args = ["flashtree", "bench"]
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is not None and value is not False:
            args += [flag, str(value)]
    return shlex.join(args)


def settings() -> dict:
    """This run's FLASHTREE_* environment settings that pick kernels, tiles or arithmetic (the cache path
    and the commit left out), so that results measured under other settings can be told apart."""
    return current_settings().explicit()


def provenance() -> dict:
    """The code and settings a run is made with, taken when it starts: the checkout may move on while a
    long run goes (a run on the CPU once recorded a commit made during it)."""
    return {"git": git_info(), "settings": settings()}


def git_info() -> dict:
    """The checkout's commit and whether tracked files differ from it. FLASHTREE_GIT_COMMIT overrides
    both: the device machine's copy of the tree may carry a stale .git, or none."""
    if commit := current_settings().git_commit:
        return {"commit": commit, "dirty": False}
    root = Path(flashtree.__file__).resolve().parent.parent

    def git(*args: str) -> str | None:
        # safe.directory: a copied checkout (another owner, e.g. on a lent GPU machine) is still ours to read
        command = ["git", "-c", "safe.directory=*", "-C", str(root), *args]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": bool(status)}


def device_info(device: torch.device) -> dict:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"
    return {"type": device.type, "name": name}


def versions() -> dict:
    found = {"python": platform.python_version(), "torch": torch.__version__}
    found["flashtree"] = flashtree.__version__
    for package in ("triton", "transformers", "gguf"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


def model_info(base: Engine) -> tuple[dict, dict | None]:
    from flashtree.kernels.qlinear import arithmetic_of
    from flashtree.models.layers import Linear

    c = base.target.config
    arithmetic = arithmetic_of(base.target)
    weights = "dense"
    if base.device.type == "cuda" and isinstance(base.target.lm_head, Linear):  # decode rows' matmuls
        weights += ", batch-invariant kernel" if base.target.lm_head.dense_kernel else ", cuBLAS"
    target = {"name": c.name, "arch": c.arch, "dtype": str(base.target.dtype).removeprefix("torch."),
              "weight_bytes": weight_bytes(base.target),
              "weights": f"packed, {arithmetic} arithmetic" if arithmetic else weights}  # fmt: skip
    if base.draft is None:
        return target, None
    d = base.draft.config
    return target, {
        "n_layers": d.n_layers,
        "block_size": d.block_size,
        "target_layer_ids": list(d.target_layer_ids),
    }


def results_document(
    options: dict, made_by: dict, base: Engine, modes: list[str], ceilings: Ceilings, rows: list[dict],
    mismatches: list,
) -> dict:  # fmt: skip
    """Everything results.json holds: how the run was made, on what, and what it measured."""
    target_info, draft_info = model_info(base)
    return {
        "schema": SCHEMA,
        "command": command_line(options),
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in options.items()},
        "modes": modes,
        **made_by,  # git, settings
        "device": device_info(base.device),
        "versions": versions(),
        "target": target_info,
        "draft": draft_info,
        "kv_types": list(base.kv_types),  # the KV cache's K and V types (every mode's engine shares them)
        "lossy": base.lossy,  # e.g. "attn-window 4096": the outputs are not the full-attention model's
        "ceilings": ceilings.as_dict(),
        "weight_read_tok_s": ceilings.weight_read_tok_s(target_info["weight_bytes"]),
        "rows": rows,
        "summary": summarize(rows, modes),
        "mismatches": mismatches,
        "passed": not mismatches,
    }


# --- the command --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchConfig:
    """The `flashtree bench` options beside the engine's (--target, --draft, --budget, ...)."""

    out: Path  # directory for results.json, results.md and the plots
    datasets: str = "humaneval,gsm8k,math500"
    n: int = REPORT_N
    max_tokens: int = 256
    modes: str = "ar,chain,tree"
    baseline: str | None = None
    raw: bool = False
    seed: int = REPORT_SEED


def bench_options(engine: EngineConfig, bench: BenchConfig) -> dict:
    """Every option of the run by its flag's name, in the command's order (results.json, command_line)."""
    b, spec = bench, engine.spec
    return {"target": engine.target, "draft": engine.draft, "datasets": b.datasets, "n": b.n,
            "max_tokens": b.max_tokens, "modes": b.modes, "budget": spec.budget,
            "block_size": spec.block_size, "baseline": b.baseline, "raw": b.raw, "seed": b.seed,
            "device": engine.device, "attn_window": engine.attn_window or None, "out": b.out}  # fmt: skip


def bench_command(engine: EngineConfig, bench: BenchConfig) -> None:
    options = bench_options(engine, bench)
    made_by = provenance()
    mode_list = parse_modes(bench.modes)
    baselines = parse_baselines(bench.baseline)
    max_tokens, raw = bench.max_tokens, bench.raw
    if max_tokens < 1:
        raise FlashtreeError(f"--max-tokens must be >= 1, got {max_tokens}")
    out = Path(bench.out)
    if out.exists() and not out.is_dir():
        raise FlashtreeError(f"--out {out}: exists and is not a directory")
    # Prompts first: a missing dataset should fail before minutes of model loading.
    names = parse_dataset_names(bench.datasets)
    prompts = [p for name in names for p in load_prompts(name, bench.n, bench.seed, raw)]

    # The loading engine only lends its target, tokenizer and draft to the per-mode engines: tiny cache.
    # Loaded as a speculative engine when a chain/tree mode runs (mode None: tree with a draft), so that
    # every mode, the AR baseline included, computes in the speculative engine's arithmetic (packed
    # weights) and matmul kernel (dense fp32 weights): its AR is what chain/tree must reproduce.
    speculative = any(m != "ar" for m in mode_list)
    base = engine_from_options(engine, mode=None if speculative else "ar", max_ctx=1)
    encoded = [base.encode(p.text, chat=not raw) for p in prompts]
    max_ctx = context_for(prompts, encoded, max_tokens, base.target.config.context_length)
    runners = make_runners(base, mode_list, baselines, max_ctx)
    ceilings = measure_ceilings(base.device)
    rows = run_all(runners, prompts, encoded, max_tokens, base.tokenizer)
    mismatches = check_identity(rows)
    prompt_ids = {(p.dataset, p.id): ids for p, ids in zip(prompts, encoded, strict=True)}
    add_logit_gaps(rows, mismatches, base.target, prompt_ids)

    results = results_document(options, made_by, base, list(runners), ceilings, rows, mismatches)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    paths = write_report(results, out)
    print((out / "results.md").read_text(encoding="utf-8"))
    written = ", ".join(str(p) for p in [out / "results.json", *paths])
    Console(stderr=True).print(f"wrote {written}", style="dim")
    if mismatches:
        Console(stderr=True).print(
            f"[bold red]IDENTITY CHECK FAILED:[/] {len(mismatches)} chain/tree outputs differ from AR "
            "(greedy speculative decoding must reproduce AR exactly)"
        )
        raise FlashtreeError(f"{len(mismatches)} outputs differ from AR; see {out / 'results.md'}")
