"""Mean greedy accept length of drafts and tree settings on the benchmark sets, by replayed decoding
(flashtree/train/replay.py): the target's greedy outputs once, then each (draft, setting) in one batched
draft pass per prompt, equal step for step to what `flashtree bench` measures, minutes on the CPU where a
decode of every mode takes most of an hour. For tuning tree settings and comparing drafts without a GPU.

    python -m benchmarks.replay_al OUT.json [--set draft_temperature=1.0,0.8] [--draft D ...] [--n 10]
        [--max-tokens 256] [--seed 1] [--outputs RESULTS.json] [--target T.gguf] [--fp8]

Prompts: --n per set (HumanEval, GSM8K, MATH-500) chosen by --seed; the default seed 1 keeps them apart
from the held-out report's (seed 0). Greedy outputs: batched greedy decoding of the target as a
transformers model (train/data.generate_responses), or the AR rows of a `flashtree bench` run
(--outputs, its prompts and settings). Rows: chain at the draft's defaults, then tree at the defaults
and with each value of --set (a SpecConfig field: draft_temperature, tree_top_k, budget, chain_seed); with
--fp8 every draft in each fp8 mode too: its matrices, and those and the LM head (kernels/fp8.py).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import fields, replace
from pathlib import Path
from statistics import fmean

import torch

from flashtree.bench.datasets import DATASETS, load_prompts
from flashtree.bench.hf_baseline import hf_model_from
from flashtree.bench.run import provenance
from flashtree.config import SpecConfig
from flashtree.defaults import default_draft_path, default_target_path
from flashtree.gguf.tokenizer import Tokenizer
from flashtree.kernels import fp8
from flashtree.models.dflash import load_draft
from flashtree.models.loader import load_target
from flashtree.train import data as D
from flashtree.train.replay import replay_draft


def parse_setting(text: str) -> tuple[str, list]:
    name, _, values = text.partition("=")
    kinds = {f.name: str(f.type) for f in fields(SpecConfig) if f.name != "mode"}
    if name not in kinds or not values:
        raise SystemExit(f"--set {text!r}: expected FIELD=v1,v2 with FIELD one of {', '.join(kinds)}")
    cast = {"float": float, "bool": lambda v: v.lower() in ("1", "true", "yes")}.get(kinds[name], int)
    return name, [cast(v) for v in values.split(",")]


def greedy_outputs(args, model, gguf) -> list[dict]:
    """[{dataset, id, ids (prompt + output), first}]: a bench run's AR outputs (--outputs, whose --n,
    --seed and --max-tokens then hold), else batched greedy decoding here."""
    bench_rows = None
    if args.outputs:
        run = json.loads(args.outputs.read_text())
        args.n, args.seed, args.max_tokens = (run["options"][k] for k in ("n", "seed", "max_tokens"))
        bench_rows = {
            (r["dataset"], r["prompt_id"]): r["output_ids"] for r in run["rows"] if r["mode"] == "ar"
        }
    tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    chosen = [p for ds in DATASETS for p in load_prompts(ds, args.n, args.seed)]
    prompt_ids = [D.chat_prompt_ids(tokenizer, p.text) for p in chosen]
    if bench_rows is not None:
        outputs = [bench_rows[(p.dataset, p.id)] for p in chosen]
    else:
        stop_ids = [tokenizer.eos_id] + sorted(tokenizer.stop_ids - {tokenizer.eos_id})
        t0 = time.time()
        outputs = D.generate_responses(hf_model_from(model), prompt_ids, args.max_tokens, stop_ids)
        print(f"greedy outputs of {len(chosen)} prompts in {time.time() - t0:.0f} s", flush=True)
    return [
        {"dataset": p.dataset, "id": p.id, "ids": torch.tensor(ids + out), "first": len(ids)}
        for p, ids, out in zip(chosen, prompt_ids, outputs, strict=True)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--set", help="FIELD=v1,v2,... of SpecConfig: tree rows under each value")
    ap.add_argument(
        "--draft", action="append", help="draft dir or GGUF (repeatable; default: the shipped one)"
    )
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--outputs", type=Path, help="a `flashtree bench` results.json: its AR rows' outputs")
    ap.add_argument("--target")
    ap.add_argument("--fp8", action="store_true", help="also replay each draft in each fp8 mode")
    args = ap.parse_args()
    made_by = provenance()  # git, settings: as the run starts
    torch.set_grad_enabled(False)

    model, gguf = load_target(args.target or default_target_path(), device="cpu", dtype=torch.float32)
    sequences = greedy_outputs(args, model, gguf)
    settings = {"chain": SpecConfig(mode="chain"), "tree": SpecConfig(mode="tree")}
    if args.set:
        name, values = parse_setting(args.set)
        settings |= {f"tree {name}={v}": replace(SpecConfig(mode="tree"), **{name: v}) for v in values}
    labels, specs = list(settings), list(settings.values())
    rows = []
    modes = fp8.MODES if args.fp8 else ("off",)
    runs = [(path, mode) for path in args.draft or [default_draft_path()] for mode in modes]
    for draft_path, fp8_mode in runs:
        draft = load_draft(draft_path, model, fp8_mode)
        block = draft.config.block_size
        start, per_prompt = time.time(), []
        for seq in sequences:
            feats = model(
                seq["ids"], model.new_state(len(seq["ids"]) + 8), capture=draft.config.target_layer_ids
            )
            stats = replay_draft(draft, feats.features, seq["ids"], seq["first"], specs, block)
            per_prompt.append([st.mean_accept_len for st in stats])
        for j, label in enumerate(labels):
            row = {
                "draft": str(draft_path),
                "fp8": fp8_mode,
                "setting": label,
                "al": [p[j] for p in per_prompt],
            }
            for ds in DATASETS:
                row[ds] = fmean(
                    p[j] for p, s in zip(per_prompt, sequences, strict=True) if s["dataset"] == ds
                )
            row["mean_al"] = fmean(row["al"])
            rows.append(row)
            name = Path(draft_path).name + ("" if fp8_mode == "off" else f" (fp8 {fp8_mode})")
            print(f"{name:40s} {label:32s} mean AL {row['mean_al']:.3f}  "
                  + "  ".join(f"{ds} {row[ds]:.2f}" for ds in DATASETS), flush=True)  # fmt: skip
        print(f"({time.time() - start:.0f} s)", flush=True)
    result = {
        "n_per_set": args.n, "max_tokens": args.max_tokens, "seed": args.seed,
        "outputs": str(args.outputs) if args.outputs else "batched greedy (transformers)",
        "prompts": [f"{s['dataset']}/{s['id']}" for s in sequences], **made_by, "rows": rows,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
