"""Where a graphed decode step's time goes, per mode (H200 diagnosis).

    python -m benchmarks.gpu_profile_steps OUT_DIR [TARGET_GGUF DRAFT]

Runs AR, chain and tree engines (CUDA graphs) on a target + draft (default: tiny-llama f32 + a random
draft), then profiles a few decode steps: GPU kernel time by kernel name, launches, and wall time per
step. Writes OUT_DIR/profile_steps.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.tiny import tiny_pair
from flashtree.bench.run import provenance
from flashtree.config import SpecConfig
from flashtree.engine.generate import Engine
from flashtree.models.dflash import load_draft
from flashtree.models.loader import load_target

STEPS = 20


def main(out_dir: Path, files: list[str]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    if files:
        target, _ = load_target(files[0], device="cuda")
        draft = load_draft(files[1], target)
    else:
        target, draft = tiny_pair("tiny-llama", "f32")
    prompt = list(range(3, 40))
    report = provenance()  # git, settings (FLASHTREE_PDL, say)
    for config in (
        dict(mode="ar"),
        dict(mode="chain", block_size=16),
        dict(mode="tree", block_size=16, budget=22),
    ):
        mode = config["mode"]
        engine = Engine(target, None, None if mode == "ar" else draft, SpecConfig(**config), max_ctx=2048)
        steps = engine.generate(prompt, 2000, stop_ids=())
        for _ in range(5):
            next(steps)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(STEPS):
            next(steps)
        wall = (time.perf_counter() - t0) / STEPS * 1e3
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(STEPS):
                next(steps)
        kernels = [
            (e.key[:90], e.count / STEPS, e.device_time_total / STEPS)
            for e in prof.key_averages()
            if e.device_type.name == "CUDA" and e.device_time_total > 0
        ]
        kernels.sort(key=lambda k: -k[2])
        total = sum(k[2] for k in kernels)
        launches = sum(k[1] for k in kernels)
        print(
            f"== {mode}: wall {wall:.2f} ms/step, kernels {total / 1e3:.2f} ms/step, {launches:.0f} launches"
        )
        for name, n, us in kernels[:15]:
            print(f"   {us:9.1f} us  {n:6.1f}x  {name}")
        report[mode] = {"wall_ms": wall, "kernel_ms": total / 1e3, "launches": launches, "top": kernels[:30]}
    (out_dir / "profile_steps.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
