"""The quality of each KV cache type on the real model (issue #39, "Quality on the real model"): the
default target, SmolLM2-135M-Instruct Q4_1 (fp32 compute, so f32 is the reference cache, its context
8192), with K and V of one type each run.

1. Perplexity on held-out text: the plain-text pydoc of Python standard-library modules (neither the
   draft's training prompts nor the benchmark prompts), cut into sequences of --ppl-len tokens, each
   prefilled in chunks of --chunk tokens with every position's logits: a chunk writes its K/V in the
   type, then attends to the cache (models/attention.py), so every logit reads the quantized cache.
2. Tree-mode mean acceptance length with the shipped draft (greedy), on --al-n prompts per benchmark
   set (`flashtree bench`'s, seed 0), every output checked token-identical to AR with the same type.
3. Needle in a haystack: "The secret code is 7319." at --depths of pydoc filler of 2K / 4K / 8K tokens
   (prompt + answer), then the question through the chat template; the greedy answer found or not.

    python3 -m benchmarks.kv_quality --out DIR [--types f32,bf16,q8_0,q4_0,tq3_0] [--quick]

Writes DIR/kv_quality.json (kv_quality-PARTS.json for --parts PARTS) after each type's measurements (a
partial run keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import pydoc
import subprocess
import time
from pathlib import Path

import torch

from flashtree.bench.datasets import DATASETS, load_prompts
from flashtree.config import SamplingParams, SpecConfig
from flashtree.engine.generate import Engine, GenerationStats

TYPES = ("f32", "bf16", "q8_0", "q4_0", "tq3_0")
# Held-out text: modules with long prose docstrings; the haystack's filler comes from other modules, so
# the needle's filler is not the text the perplexity is measured on.
PPL_MODULES = ("argparse", "collections", "functools", "itertools", "logging", "re", "typing", "email")
FILLER_MODULES = ("textwrap", "difflib", "heapq", "json", "calendar", "string", "shutil", "pathlib", "os")
NEEDLE, CODE = "The secret code is 7319.", "7319"
QUESTION = "What is the secret code mentioned in the text above? Answer with the number only."
MAX_CTX = 8192  # SmolLM2's context
ANSWER_TOKENS = 16


def say(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)


def doc_text(modules: tuple[str, ...]) -> str:
    """The modules' documentation as pydoc renders it for a terminal, without its bold overstrikes."""
    return "\n\n".join(pydoc.render_doc(name, renderer=pydoc.plaintext) for name in modules)


def held_out(tokenizer, n_seq: int, seq_len: int) -> list[list[int]]:
    ids = tokenizer.encode(doc_text(PPL_MODULES), add_bos=False, parse_special=False)
    if len(ids) < n_seq * seq_len:
        raise SystemExit(f"held-out text has {len(ids)} tokens, fewer than {n_seq} x {seq_len}")
    return [ids[i * seq_len : (i + 1) * seq_len] for i in range(n_seq)]


def kv_pair(kind: str) -> tuple[str, str]:
    """(K type, V type) of `kind`: one type for both, or K/V (e.g. q8_0/tq3_0)."""
    k, _, v = kind.partition("/")
    return k, v or k


def perplexity(target, kind: str, seqs: list[list[int]], chunk: int) -> dict:
    """exp(mean NLL) of every token after the first of each sequence, the logits read chunk by chunk off
    committing forwards (the prefill's own path), so each position attends to the cache in `kind`."""
    target.set_kv_types(*kv_pair(kind))
    nll, count, per_seq = 0.0, 0, []
    for seq in seqs:
        state = target.new_state(len(seq))
        ids = torch.tensor(seq, dtype=torch.long)
        seq_nll = 0.0
        for s in range(0, len(seq), chunk):
            part = ids[s : s + chunk]
            logits = target(part, state, logits="all").logits  # (T, vocab) fp32
            state.advance(part.shape[0])
            nexts = ids[s + 1 : s + chunk + 1]  # the last chunk has no next token for its last row
            logp = torch.log_softmax(logits[: nexts.shape[0]], dim=-1)
            seq_nll -= logp.gather(1, nexts[:, None]).sum().item()
        per_seq.append(math.exp(seq_nll / (len(seq) - 1)))
        nll, count = nll + seq_nll, count + len(seq) - 1
    return {"ppl": math.exp(nll / count), "tokens": count, "ppl_per_seq": per_seq}


def engine_for(base: Engine, kind: str, mode: str, max_ctx: int) -> Engine:
    draft = base.draft if mode != "ar" else None
    return Engine(base.target, base.tokenizer, draft, SpecConfig(mode=mode), max_ctx, kv_types=kv_pair(kind))


def decode(engine: Engine, ids: list[int], max_tokens: int) -> tuple[list[int], GenerationStats]:
    stats = GenerationStats(engine.mode)
    out = [t for step in engine.generate(ids, max_tokens, SamplingParams(), stats=stats) for t in step]
    return out, stats


def accept_lengths(base: Engine, kind: str, n: int, max_tokens: int) -> dict:
    """Tree decoding with the draft vs AR, both with the cache in `kind`: the mean accept length over all
    decode steps of every prompt (as `flashtree bench` pools them) and whether each output is identical."""
    tree, ar = engine_for(base, kind, "tree", 2048), engine_for(base, kind, "ar", 2048)
    rows, steps, accepted = [], 0, 0
    for name in DATASETS:
        for p in load_prompts(name, n, 0):
            ids = tree.encode(p.text)
            out, stats = decode(tree, ids, max_tokens)
            ref, _ = decode(ar, ids, max_tokens)
            steps += stats.steps
            accepted += sum(k * c for k, c in enumerate(stats.accept_hist))
            row = {"dataset": name, "id": p.id, "al": stats.mean_accept_len, "tokens": len(out)}
            diff = next((i for i, (a, b) in enumerate(zip(out, ref, strict=False)) if a != b), None)
            rows.append({**row, "identical_to_ar": out == ref, "first_difference": diff})
            say(f"  AL {kind} {name} {p.id}: {stats.mean_accept_len:.2f}, identical {out == ref}")
    return {"mean_accept_len": accepted / steps, "all_identical": all(r["identical_to_ar"] for r in rows),
            "prompts": rows}  # fmt: skip


def haystack(engine: Engine, filler: list[int], length: int, depth: float) -> list[int]:
    """Chat prompt ids of about `length` - ANSWER_TOKENS tokens: filler with the needle at `depth` of it
    (at the line break nearest that point, so no word is cut), then the question."""
    bare = len(engine.encode(f"\n{NEEDLE}\n\n\n{QUESTION}"))
    n_fill = length - ANSWER_TOKENS - bare
    for _ in range(4):  # decoded filler re-encodes to a few tokens more or less: trim until it fits
        text = engine.tokenizer.decode(filler[:n_fill])
        at = text.rfind("\n", 0, int(depth * len(text))) + 1
        prompt = f"{text[:at]}{NEEDLE}\n{text[at:]}\n\n{QUESTION}"
        ids = engine.encode(prompt)
        if len(ids) <= length - ANSWER_TOKENS:
            return ids
        n_fill -= len(ids) - (length - ANSWER_TOKENS)
    raise RuntimeError(f"cannot fit a {length}-token haystack")


def needles(base: Engine, kind: str, lengths: list[int], depths: list[float], filler: list[int]) -> list:
    engine = engine_for(base, kind, "ar", MAX_CTX)
    rows = []
    for length in lengths:
        for depth in depths:
            ids = haystack(engine, filler, length, depth)
            out, stats = decode(engine, ids, ANSWER_TOKENS)
            answer = engine.tokenizer.decode(out, skip_special=True).strip()
            found = CODE in answer
            rows.append({"length": length, "depth": depth, "n_prompt": len(ids), "answer": answer,
                         "found": found, "prefill_tok_s": stats.prefill_tok_s})  # fmt: skip
            say(f"  needle {kind} {length} @{depth:.0%}: {found} ({answer!r})")
    return rows


def git_commit() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument(
        "--types", default=",".join(TYPES), help="KV types, comma-separated: one for K and V, or K/V"
    )
    parser.add_argument("--parts", default="ppl,al,needle", help="which measurements, comma-separated")
    parser.add_argument("--tables", action="store_true", help="print the tables of the JSONs in --out")
    parser.add_argument("--quick", action="store_true", help="small sizes: a first pass over everything")
    parser.add_argument("--ppl-seqs", type=int, default=2)
    parser.add_argument("--ppl-len", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk (the CPU's largest)")
    parser.add_argument("--al-n", type=int, default=3, help="prompts per benchmark set")
    parser.add_argument("--al-tokens", type=int, default=128)
    parser.add_argument("--lengths", default="2048,4096,8192")
    parser.add_argument("--depths", default="0.1,0.5,0.9")
    args = parser.parse_args()
    if args.quick:
        args.ppl_seqs, args.ppl_len, args.al_n, args.al_tokens = 1, 2048, 1, 64
        args.lengths, args.depths = "2048", "0.1,0.5,0.9"
    return args


def measure(base: Engine, kind: str, args: argparse.Namespace, seqs, filler) -> dict:
    parts, result = args.parts.split(","), {}
    if "ppl" in parts:
        t0 = time.perf_counter()
        result["ppl"] = perplexity(base.target, kind, seqs, args.chunk)
        say(f"{kind}: PPL {result['ppl']['ppl']:.4f} ({time.perf_counter() - t0:.0f} s)")
    if "al" in parts:
        result["al"] = accept_lengths(base, kind, args.al_n, args.al_tokens)
        al = result["al"]
        say(f"{kind}: tree AL {al['mean_accept_len']:.3f}, all identical {al['all_identical']}")
    if "needle" in parts:
        lengths = [int(x) for x in args.lengths.split(",")]
        depths = [float(x) for x in args.depths.split(",")]
        result["needle"] = needles(base, kind, lengths, depths, filler)
    return result


def merged(out: Path) -> dict:
    """Every type's results from the JSONs in `out` (one per set of parts), merged per type."""
    types: dict = {}
    for path in sorted(out.glob("kv_quality*.json")):
        for kind, result in json.loads(path.read_text())["types"].items():
            types.setdefault(kind, {}).update(result)
    return types


def tables(out: Path) -> str:
    """Markdown tables of what `out` holds: PPL (ratio to f32 and bf16), tree AL, needles found."""
    types = merged(out)
    ppl = {k: r["ppl"]["ppl"] for k, r in types.items() if "ppl" in r}
    al = {k: r["al"] for k, r in types.items() if "al" in r}
    lines = ["| KV type | PPL | / f32 | / bf16 | tree AL | / bf16 | identical to AR |", "|---" * 7 + "|"]
    for kind in types:
        p = ppl.get(kind)
        a = al.get(kind, {}).get("mean_accept_len")
        cells = [f"{p:.4f}" if p else "-"]
        cells += [f"{p / ppl[ref]:.4f}" if p and ref in ppl else "-" for ref in ("f32", "bf16")]
        cells += [
            f"{a:.3f}" if a else "-",
            f"{a / al['bf16']['mean_accept_len']:.4f}" if a and "bf16" in al else "-",
        ]
        same = al.get(kind, {}).get("prompts", [])
        cells.append(f"{sum(x['identical_to_ar'] for x in same)}/{len(same)}" if same else "-")
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    needle = {k: r["needle"] for k, r in types.items() if "needle" in r}
    if needle:
        cols = [(row["length"], row["depth"]) for row in next(iter(needle.values()))]
        lines += [
            "",
            "| KV type | " + " | ".join(f"{n} @{d:.0%}" for n, d in cols) + " |",
            "|---" * (len(cols) + 1) + "|",
        ]
        for kind, rows in needle.items():
            lines.append(
                f"| {kind} | " + " | ".join("found" if x["found"] else "not found" for x in rows) + " |"
            )
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if args.tables:
        print(tables(args.out))
        return
    torch.set_grad_enabled(False)
    args.out.mkdir(parents=True, exist_ok=True)
    base = Engine.load(mode="tree", device="cpu", max_ctx=MAX_CTX)
    seqs = held_out(base.tokenizer, args.ppl_seqs, args.ppl_len) if "ppl" in args.parts else []
    filler = base.tokenizer.encode(doc_text(FILLER_MODULES), add_bos=False, parse_special=False)
    report = {"commit": git_commit(), "machine": platform.processor() or platform.machine(),
              "threads": torch.get_num_threads(), "args": {k: str(v) for k, v in vars(args).items()},
              "ppl_modules": PPL_MODULES, "filler_modules": FILLER_MODULES, "needle": NEEDLE,
              "question": QUESTION, "types": {}}  # fmt: skip
    # one file per set of parts, so the measurements can run one after another (each over every type)
    path = args.out / (
        "kv_quality.json" if args.parts == "ppl,al,needle" else f"kv_quality-{args.parts}.json"
    )
    for kind in args.types.split(","):
        say(f"== {kind}")
        report["types"][kind] = measure(base, kind, args, seqs, filler)
        path.write_text(json.dumps(report, indent=1) + "\n")
    say(f"wrote {path}")


if __name__ == "__main__":
    main()
