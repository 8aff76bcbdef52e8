"""Acceptance length of a draft on held-out benchmark prompts, through the real engine.

For each (dataset, mode) the engine decodes every prompt greedily (chat template, the datasets'
prompt formats from bench/datasets.py) and records per-step acceptance. The mean acceptance length
(AL) is pooled over steps: tokens emitted by decode steps / decode steps, each step counting its
accepted draft tokens plus the bonus token. Jobs run in parallel processes (batch-1 decoding is
launch-bound, so several share one GPU well).

    python -m flashtree.train.evaluate --target T.gguf --draft DIR --out eval.json [--workers 6]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

DATASETS = ("humaneval", "gsm8k", "math500")
MODES = ("chain", "tree")


@dataclass(frozen=True)
class EvalJob:
    target: str
    draft: str
    dataset: str
    mode: str
    n: int = 10
    seed: int = 0
    max_new_tokens: int = 256
    block_size: int = 16
    budget: int = 22
    device: str | None = None
    deadline: float | None = None  # time.time() after which no new prompt starts


def run_job(job: EvalJob) -> dict:
    from flashtree.bench.datasets import load_prompts
    from flashtree.config import SpecConfig
    from flashtree.generate import Engine, GenerationStats

    spec = SpecConfig(mode=job.mode, block_size=job.block_size, budget=job.budget)
    engine = Engine.load(job.target, job.draft, mode=job.mode, spec=spec, max_ctx=2048, device=job.device)
    rows = []
    for prompt in load_prompts(job.dataset, job.n, job.seed):
        if job.deadline is not None and time.time() > job.deadline:
            break
        stats = GenerationStats(job.mode)
        tokens = [
            t
            for ids in engine.generate(engine.encode(prompt.text), job.max_new_tokens, stats=stats)
            for t in ids
        ]
        rows.append(
            {
                "id": prompt.id,
                "n_generated": stats.n_generated,
                "steps": stats.steps,
                "mean_accept_len": stats.mean_accept_len,
                "accept_hist": stats.accept_hist,
                "decode_tok_s": stats.decode_tok_s,
                "output_sha1": hashlib.sha1(json.dumps(tokens).encode()).hexdigest(),
            }
        )
    steps = sum(r["steps"] for r in rows)
    emitted = sum(n * c for r in rows for n, c in enumerate(r["accept_hist"]))
    return {
        "dataset": job.dataset,
        "mode": job.mode,
        "n_prompts": len(rows),
        "mean_accept_len": emitted / steps if steps else 0.0,
        "prompts": rows,
    }


def evaluate(jobs: list[EvalJob], workers: int = 1) -> dict:
    """Run the jobs (in `workers` spawned processes when > 1) and summarize AL per mode."""
    if workers > 1:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(run_job, jobs))
    else:
        results = [run_job(j) for j in jobs]
    summary = {}
    for mode in sorted({r["mode"] for r in results}):
        of_mode = [r for r in results if r["mode"] == mode]
        steps = sum(p["steps"] for r in of_mode for p in r["prompts"])
        emitted = sum(n * c for r in of_mode for p in r["prompts"] for n, c in enumerate(p["accept_hist"]))
        summary[mode] = {
            "mean_accept_len": emitted / steps if steps else 0.0,
            "per_dataset": {r["dataset"]: r["mean_accept_len"] for r in of_mode},
        }
    return {"summary": summary, "results": results}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--datasets", default=",".join(DATASETS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--n", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--budget", type=int, default=22)
    p.add_argument("--device", default=None)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--minutes", type=float, default=None, help="No new prompt starts after this.")
    a = p.parse_args()
    deadline = None if a.minutes is None else time.time() + a.minutes * 60
    jobs = [
        EvalJob(
            a.target, a.draft, d, m, a.n, a.seed, a.max_new_tokens, a.block_size, a.budget, a.device, deadline
        )
        for d in a.datasets.split(",")
        for m in a.modes.split(",")
    ]
    report = evaluate(jobs, a.workers)
    a.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["summary"], indent=1))


if __name__ == "__main__":
    main()
