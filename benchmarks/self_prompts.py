"""Self-written prompts (issue #43, part 3; flashtree/train/self_prompts.py): write a pool of them with
the target, and measure a draft's tree acceptance length on their held-out split.

    python -m benchmarks.self_prompts write --out DIR [--n 1000] [--minutes 35] [--seed 0] [--batch N]
    python -m benchmarks.self_prompts al --out DIR [--n 15] [--max-tokens 64] [--draft PATH]

`write` (--batch N: N turns a generation, train/data.py's batched decoding, the GPU's way; else one at a
time through the Engine) appends each raw turn to DIR/raw.jsonl as it comes (a stopped run goes on where
it stopped, and its turns are usable), then filters them all into DIR/prompts.jsonl (records {"text", "index",
"n_tokens", "held_out"}; `flashtree train-draft --self-prompts` reads it) and DIR/provenance.json (the
settings, the counts after each filter, the rate). `al`: tree decoding (greedy, the draft: the shipped one
unless --draft) on the first --n held-out prompts, each output checked token-identical to AR; the mean
acceptance length pools every decode step, as `flashtree bench` does. DIR/al.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from itertools import islice
from pathlib import Path

import torch

from benchmarks.kv_quality import decode, git_commit, say
from flashtree.bench.datasets import DATASETS, question_texts
from flashtree.bench.hf_baseline import hf_model_from
from flashtree.config import SpecConfig
from flashtree.engine.generate import Engine
from flashtree.train import self_prompts as S

RAW, PROMPTS, PROVENANCE, AL = "raw.jsonl", "prompts.jsonl", "provenance.json", "al.json"


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write(args: argparse.Namespace) -> None:
    settings = S.SampleSettings(args.seed, args.temperature, args.top_p, args.max_tokens)
    raw_path = args.out / RAW
    done = read_jsonl(raw_path)
    engine = Engine.load(target=args.target, draft="none", mode="ar", device=args.device)
    t0, start = time.perf_counter(), len(done)
    if args.batch:
        turns = S.sample_user_turns_batched(hf_model_from(engine.target), engine.tokenizer, settings, start,
                                            args.batch)  # fmt: skip
    else:
        turns = S.sample_user_turns(engine, settings, start=start)
    with raw_path.open("a") as f:
        for sample in islice(turns, max(args.n - start, 0)):
            f.write(json.dumps(sample) + "\n")
            f.flush()
            done.append(sample)
            made = len(done) - start
            if made % 20 == 0:
                rate = made / (time.perf_counter() - t0) * 60
                say(f"{len(done)} turns ({rate:.1f}/min): {sample['text'][:80]!r}")
            if args.minutes and time.perf_counter() - t0 > args.minutes * 60:
                break
    minutes = (time.perf_counter() - t0) / 60
    benchmark = [t for name in DATASETS for t in question_texts(name)]
    kept, counts = S.filter_prompts(done, S.control_texts(engine.tokenizer), benchmark)
    with (args.out / PROMPTS).open("w") as f:
        for r in kept:
            row = {"text": r["text"], "index": r["index"], "n_tokens": r["n_tokens"]}
            f.write(json.dumps({**row, "held_out": S.is_held_out(r["text"])}, ensure_ascii=False) + "\n")
    _, held = S.split(kept)
    # every run's rate, a re-filtering run's (no turns) included: what the next run can plan by
    earlier = args.out / PROVENANCE
    runs = json.loads(earlier.read_text())["runs"] if earlier.exists() else []
    made = len(done) - start
    run = {"turns": made, "batch": args.batch, "minutes": minutes, "turns_per_minute": made / minutes}
    report = {
        **S.provenance(settings, S.FilterSettings(), counts),
        "target": str(args.target or "default (SmolLM2-135M-Instruct Q4_1)"),
        "user_prefix": S.user_prefix(engine.tokenizer),
        "n_held_out": len(held),
        "runs": [*runs, run],
        "commit": git_commit(), "machine": platform.processor() or platform.machine(),
        "device": str(engine.device), "threads": torch.get_num_threads(),
    }  # fmt: skip
    (args.out / PROVENANCE).write_text(json.dumps(report, indent=1) + "\n")
    say(f"{counts}; {len(held)} held out; wrote {args.out / PROMPTS}")


def accept_lengths(args: argparse.Namespace) -> None:
    held = [r for r in read_jsonl(args.out / PROMPTS) if S.is_held_out(r["text"])][: args.n]
    if not held:
        raise SystemExit(f"{args.out / PROMPTS}: no held-out prompts (run `write` first)")
    tree = Engine.load(target=args.target, draft=args.draft, mode="tree", device=args.device, max_ctx=2048)
    ar = Engine(tree.target, tree.tokenizer, None, SpecConfig(mode="ar"), 2048)
    rows, steps, accepted = [], 0, 0
    for r in held:
        ids = tree.encode(r["text"])
        out, stats = decode(tree, ids, args.max_tokens)
        ref, _ = decode(ar, ids, args.max_tokens)
        steps += stats.steps
        accepted += sum(k * c for k, c in enumerate(stats.accept_hist))
        rows.append({"index": r["index"], "al": stats.mean_accept_len, "tokens": len(out),
                     "identical_to_ar": out == ref})  # fmt: skip
        say(f"  {r['index']}: AL {stats.mean_accept_len:.2f}, identical {out == ref}")
    report = {
        "mean_accept_len": accepted / steps if steps else None,
        "identical_to_ar": sum(x["identical_to_ar"] for x in rows), "n": len(rows),
        "max_tokens": args.max_tokens, "draft": str(args.draft or "shipped"), "device": str(tree.device),
        "commit": git_commit(), "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(), "prompts": rows,
    }  # fmt: skip
    (args.out / AL).write_text(json.dumps(report, indent=1) + "\n")
    say(f"tree AL {report['mean_accept_len']:.3f}, identical to AR {report['identical_to_ar']}/{len(rows)}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=("write", "al"))
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--target", default=None, help="target GGUF (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--n", type=int, default=None, help="turns to write (1000) / prompts to measure (15)")
    parser.add_argument("--minutes", type=float, default=None, help="write: stop after this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=0, help="write: turns a generation (0: one at a time)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="write: per turn (128); al: per reply (64)"
    )
    parser.add_argument("--draft", default=None, help="al: the draft (default: the shipped one)")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.what == "write":
        args.n, args.max_tokens = args.n or 1000, args.max_tokens or 128
        write(args)
    else:
        args.n, args.max_tokens = args.n or 15, args.max_tokens or 64
        accept_lengths(args)


if __name__ == "__main__":
    main()
