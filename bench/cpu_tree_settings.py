"""Mean tree acceptance length of the default pair (or any pair) under other tree-building settings, on
the CPU: greedy AL does not depend on the device, so tree shapes can be tuned without a GPU.

    python bench/cpu_tree_settings.py OUT.json --set draft_temperature=1.0,0.6,1.5 [--n 5] [--max-tokens 128]
        [--seed 1] [--target T.gguf --draft D]

Prompts: --n per benchmark set (HumanEval, GSM8K, MATH-500), chosen by --seed; the default seed 1 keeps
them apart from the held-out report's (seed 0). Each value of the --set field (a SpecConfig field:
draft_temperature, tree_top_k, budget, block_size) decodes every prompt; the table and OUT.json give
the mean AL and the per-prompt ALs.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import fields, replace
from pathlib import Path
from statistics import fmean

from flashtree.bench.datasets import DATASETS, load_prompts
from flashtree.bench.run import provenance
from flashtree.config import SamplingParams, SpecConfig
from flashtree.generate import Engine, GenerationStats


def parse_setting(text: str) -> tuple[str, list]:
    name, _, values = text.partition("=")
    kinds = {f.name: f.type for f in fields(SpecConfig)}
    if name not in kinds or not values:
        raise SystemExit(f"--set {text!r}: expected FIELD=v1,v2 with FIELD one of {', '.join(kinds)}")
    cast = float if "float" in str(kinds[name]) else int
    return name, [cast(v) for v in values.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--set", required=True, help="FIELD=v1,v2,... of SpecConfig")
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--target")
    ap.add_argument("--draft")
    args = ap.parse_args()
    name, values = parse_setting(args.set)
    made_by = provenance()  # git, settings: as the run starts

    base = Engine.load(args.target, args.draft, mode="tree", max_ctx=4096, device="cpu")
    prompts = [p for ds in DATASETS for p in load_prompts(ds, args.n, args.seed)]
    encoded = [base.encode(p.text) for p in prompts]
    rows = []
    for value in values:
        engine = Engine(base.target, base.tokenizer, base.draft, replace(base.spec, **{name: value}), 4096)
        start, als = time.time(), []
        for ids in encoded:
            stats = GenerationStats("tree")
            list(engine.generate(ids, args.max_tokens, SamplingParams(), stats=stats))
            als.append(stats.mean_accept_len)
        rows.append({name: value, "mean_al": fmean(als), "al": als, "seconds": time.time() - start})
        print(f"{name}={value}: mean AL {fmean(als):.3f} ({time.time() - start:.0f} s)", flush=True)
    result = {
        "setting": name, "n_per_set": args.n, "max_tokens": args.max_tokens, "seed": args.seed,
        "prompts": [f"{p.dataset}/{p.id}" for p in prompts], **made_by, "rows": rows,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
