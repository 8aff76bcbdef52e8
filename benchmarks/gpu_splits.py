"""Per-matrix K-split targets for the quantized matmuls, swept on a model's own matrices (H200).

    python -m benchmarks.gpu_splits OUT_DIR TARGET_GGUF [--arith int8] [--rows 1] [--splits-out FILE]
        [--tiles-out FILE]

Why: one SPLIT_TARGET ((row, split) pairs per matrix) serves every matrix, and the 27B's small ones run
far below the copy ceiling at M = 1 (its 5120 x 6144 output projections at ~0.3 of it, the FFN matrices
at ~0.6: bench/results/h200-layout-2026-12-03/kernels.json): a 5120-row matrix gets one unit per split
and a summing tail. A target per matrix shape is still from the shape only, so batch invariance holds
(qmatmul.SHAPE_SPLITS).

Loads the target packed, groups its QuantLinears by (arithmetic, type, shape) and times, for each group
and each target of TARGETS, one CUDA graph calling the group's matrices back to back at M = --rows (its
own weights: the group's bytes leave L2). Prints per group the default's and the best target's time and
bandwidth fraction, and the step-level sum; writes OUT_DIR/splits.json and, with --splits-out, the
FLASHTREE_QMM_SPLITS JSON of the targets that beat the default by more than MIN_GAIN.

--rows 23 with --arith bf16 tunes the speculative verify: its tensor-core programs take BN rows each, so
the matvec's target (sized for one thread per row) cuts a 5120-row matrix into one 256-value unit per
program, whose fp32 partial sums (23 x 5120 x 4 bytes per split) then cost about what the weights do.
There both ways of adding the splits are swept (the tile's `fused_sum`: fewer splits make the summing
tail short): the way whose chosen targets sum lower over the step's matrices is kept, and --tiles-out
gets its FLASHTREE_QMM_TILES JSON. Targets and tiles are set through benchmarks/knobs.py.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import astuple, replace
from pathlib import Path

import torch

from benchmarks import knobs
from benchmarks.timing import graph_time_us
from flashtree.bench.roofline import measure_ceilings
from flashtree.bench.run import provenance
from flashtree.kernels import qmatmul
from flashtree.kernels.qlinear import QuantLinear, use_arithmetic
from flashtree.kernels.qmatmul import packed_bytes, split_key, tile_key
from flashtree.models.loader import load_target

TARGETS = tuple(1 << s for s in range(10, 20))  # 1K .. 512K (row, split) pairs; runtime only: no compiles
# A target is chosen when it beats the default by more than the noise: one target timed twice differed
# by 5 % (bench/results/h200-fused-quant-2026-12-04/splits.log, the 5120 x 6144 group).
MIN_GAIN = 0.05


def group_time_us(modules: list[QuantLinear], target: int, rows: int) -> float:
    """Median us per call of the group's matrices at M = `rows` with K-split target `target`."""
    first = modules[0]
    key = split_key(first.arithmetic, first.qtype, first.out_features, first.in_features)
    x = torch.randn(rows, first.in_features, device="cuda", dtype=torch.bfloat16)
    calls = [
        lambda m=m: knobs.qmm(x, m.fields, m.qtype, m.out_features, m.in_features, m.arithmetic)
        for m in modules
    ]
    with knobs.shape_split_set(key, target):
        return graph_time_us(calls * max(1, 8 // len(modules)))


def sweep(groups: dict[str, list[QuantLinear]], rows: int, copy_gb_s: float) -> dict:
    """Every group timed under every target at M = `rows`, with the tiles as they are now: per group
    the default's time, the best target, and the target chosen (the best, if it beats the default by
    more than MIN_GAIN); the step-level sums under the default and the chosen targets."""
    records, chosen = [], {}
    total_default = total_chosen = 0.0
    for key, modules in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        nbytes = packed_bytes(modules[0].fields)

        def frac(us: float, nbytes: int = nbytes) -> float:
            return nbytes / us / 1e3 / copy_gb_s

        by_target = {t: group_time_us(modules, t, rows) for t in TARGETS}
        shared = knobs.split_target()
        default = by_target[shared]  # among TARGETS: the default is timed like the others
        best = min(by_target, key=by_target.get)
        if best != shared and by_target[best] < default * (1 - MIN_GAIN):
            chosen[key] = best
        total_default += default * len(modules)
        total_chosen += by_target[chosen.get(key, shared)] * len(modules)  # what the step gets
        records.append({
            "key": key, "matrices": len(modules), "bytes": nbytes, "default_us": default,
            "default_bw_frac": frac(default), "by_target_us": by_target, "best_target": best,
            "best_us": by_target[best], "best_bw_frac": frac(by_target[best]),
        })  # fmt: skip
        print(
            f"{key:28} x{len(modules):3}  default {default:7.1f} us ({frac(default):.2f})  best {best:7} "
            f"{by_target[best]:7.1f} us ({frac(by_target[best]):.2f})",
            flush=True,
        )
    print(f"all matrices once: default {total_default / 1e3:.3f} ms, chosen {total_chosen / 1e3:.3f} ms")
    return {
        "groups": records, "chosen": chosen, "total_default_ms": total_default / 1e3,
        "total_chosen_ms": total_chosen / 1e3,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("--arith", default="int8", choices=qmatmul.ARITHMETICS)
    parser.add_argument("--rows", type=int, default=1, help="M: the rows of x each product is timed at")
    parser.add_argument("--splits-out", type=Path)
    parser.add_argument("--tiles-out", type=Path)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ceilings = measure_ceilings(torch.device("cuda"))
    model, _ = load_target(args.target, device="cuda")
    use_arithmetic(model, args.arith)
    knobs.clear_shape_splits()  # the sweep sets one group's target at a time
    groups: dict[str, list[QuantLinear]] = defaultdict(list)
    for m in model.modules():
        if isinstance(m, QuantLinear):
            groups[split_key(args.arith, m.qtype, m.out_features, m.in_features)].append(m)
    n_matrices = sum(map(len, groups.values()))
    print(f"ceilings: {ceilings}; {n_matrices} matrices in {len(groups)} groups, M = {args.rows}", flush=True)
    bucket = tile_key(args.rows, args.arith)
    tile = knobs.qmm_tiles()[bucket]
    saved = {k: t for k, t in knobs.qmm_tiles().items() if k.partition(":")[0] == bucket}  # types' own too
    by_fused = {}
    for fused in (tile.fused_sum, 1 - tile.fused_sum):  # the default way first: its sums are the baseline
        print(f"{bucket} tile {tile}, fused_sum {fused}:", flush=True)
        knobs.set_qmm_tiles({k: replace(t, fused_sum=fused) for k, t in saved.items()})
        by_fused[fused] = sweep(groups, args.rows, ceilings.copy_gb_s)
    knobs.set_qmm_tiles(saved)
    fused = min(by_fused, key=lambda f: by_fused[f]["total_chosen_ms"])
    best = by_fused[fused]
    print(
        f"M = {args.rows}: default {by_fused[tile.fused_sum]['total_default_ms']:.3f} ms; best "
        f"fused_sum {fused} with its chosen targets {best['total_chosen_ms']:.3f} ms"
    )
    result = provenance() | {
        "ceilings": ceilings.as_dict(), "arithmetic": args.arith, "rows": args.rows, "tile_key": bucket,
        "split_target": knobs.split_target(), "default_fused_sum": tile.fused_sum, "chosen_fused_sum": fused,
        "by_fused_sum": by_fused, "chosen": best["chosen"],
        "total_default_ms": by_fused[tile.fused_sum]["total_default_ms"],
        "total_chosen_ms": best["total_chosen_ms"],
    }  # fmt: skip
    (args.out / "splits.json").write_text(json.dumps(result, indent=2) + "\n")
    if args.splits_out:
        args.splits_out.write_text(json.dumps(best["chosen"]))
    if args.tiles_out:
        args.tiles_out.write_text(json.dumps({bucket: list(astuple(replace(tile, fused_sum=fused)))}))


if __name__ == "__main__":
    main()
