"""CUDA-graph decode steps on a real GPU: the same tokens as eager steps, and what each step costs.

    python bench/gpu_graphs.py OUT_DIR

For tiny random targets of each family (synth, q4_k_m and f32) with a random 1-layer draft, on CUDA:
plain eager AR gives the reference tokens; AR, chain and tree engines replaying CUDA graphs must emit
exactly them (greedy and sampled). The eager and graphed per-step times are printed next to each
other. Exits non-zero on any mismatch. Writes OUT_DIR/gpu_graphs.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from flashtree.config import SamplingParams, SpecConfig
from flashtree.convert.synth import synth_draft, synth_model
from flashtree.cuda_graphs import StepRunner
from flashtree.generate import Engine
from flashtree.models.dflash import load_draft
from flashtree.models.loader import load_target

N_NEW = 64
CONFIGS = [
    dict(mode="ar"),
    dict(mode="chain", block_size=16),
    dict(mode="tree", block_size=16, budget=22),
    dict(mode="tree", block_size=8, budget=40),
]
SAMPLINGS = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.95, seed=5)]


def decode(engine: Engine, prompt: list[int], sampling: SamplingParams) -> tuple[list[int], float]:
    """Tokens and seconds per decode step (after prefill)."""
    steps = engine.generate(prompt, N_NEW, sampling, stop_ids=())
    tokens = list(next(steps))
    torch.cuda.synchronize()
    t0, n = time.perf_counter(), 0
    for step in steps:
        tokens += step
        n += 1
    torch.cuda.synchronize()
    return tokens, (time.perf_counter() - t0) / max(n, 1)


def tiny_pair(shape: str, qtype: str):
    """A random `shape` target of `qtype` on CUDA and a random 1-layer draft for it, synthesized once."""
    work = Path("/tmp/gpu_graphs")
    work.mkdir(exist_ok=True)
    gguf, draft_dir = work / f"{shape}-{qtype}.gguf", work / f"{shape}-{qtype}-draft"
    if not gguf.exists():
        synth_model(shape, qtype, gguf, seed=1)
        synth_draft(gguf, 1, draft_dir, seed=1)
    target, _ = load_target(gguf, device="cuda")
    return target, load_draft(draft_dir, target)


TARGETS = (("tiny-llama", "f32"), ("tiny-qwen3", "q4_k_m"), ("tiny-qwen35", "q4_k_m"))


def main(out_dir: Path, only: list[str]) -> int:
    """Every target of TARGETS, or those named in `only`; the JSON is rewritten after every row, so a
    run cut short still reports what it checked."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, failures = [], 0
    for shape, qtype in (t for t in TARGETS if not only or t[0] in only):
        target, draft = tiny_pair(shape, qtype)
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, target.config.vocab, (n,), generator=gen).tolist() for n in (5, 37, 300)]
        for sampling in SAMPLINGS:
            ref_engine = Engine(target, None, None, SpecConfig(mode="ar"), max_ctx=1024)
            ref_engine.runner = StepRunner(ref_engine.state, graphs=False)
            refs = [decode(ref_engine, p, sampling) for p in prompts]
            for config in CONFIGS:
                engine = Engine(
                    target,
                    None,
                    None if config["mode"] == "ar" else draft,
                    SpecConfig(**config),
                    max_ctx=1024,
                )
                assert engine.runner.enabled, "CUDA graphs are off"
                got = [decode(engine, p, sampling) for p in prompts]
                same = [g[0] == r[0] for g, r in zip(got, refs, strict=True)]
                failures += not all(same)
                row = {
                    "target": f"{shape} {qtype}", "sampling": "greedy" if sampling.greedy else "sampled",
                    **config, "identical": same, "graphs": len(engine.runner.graphs),
                    "eager_ar_step_ms": 1e3 * sum(r[1] for r in refs) / len(refs),
                    "graph_step_ms": 1e3 * sum(g[1] for g in got) / len(got),
                }  # fmt: skip
                rows.append(row)
                (out_dir / "gpu_graphs.json").write_text(json.dumps(rows, indent=2) + "\n")
                print(
                    f"{row['target']:<20} {row['sampling']:<8} {json.dumps(config):<52} identical {same}"
                    f"  ms/step: eager AR {row['eager_ar_step_ms']:6.2f}, graphed {row['graph_step_ms']:6.2f}"
                )
    print("FAILURES" if failures else "all identical", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2:]))
