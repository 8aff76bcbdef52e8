"""The fp32 dense kernel of decode steps (flashtree/kernels/dense_matmul.py) on a real GPU: a tile sweep,
and the default pair's matrices timed against cuBLAS.

    python -m benchmarks.gpu_dense_matmul OUT_DIR [--sweep]  -> OUT_DIR/dense_matmul.json

Its correctness at these shapes (within 2e-6 of the fp64 product, every row of an M-row call equal to the
1-row call on that row bit for bit) is tests/gpu/test_dense_matmul_gpu.py (`python -m benchmarks dense`
runs it first).
- timing: each shape at M = 1 (AR), 16 (draft block) and 23 (tree verify), 30 distinct copies of the
  weight called in a row inside one CUDA graph (as a step's layers: the copies total more than L2, so
  weights come from memory), us per call, for cuBLAS (F.linear) and for our kernel at DEFAULT_TILES
  and, with --sweep, at each tile of SWEEP; the per-step total weights each shape by its calls in one
  default-pair step (30 target layers and the LM head; the draft's 5 layers, its fc and its LM head),
  and each shape's fastest tile for a speculative step (draft + verify calls) is written as
  `tiles_by_shape`, the JSON that FLASHTREE_DENSE_TILES takes (kernels/dense_matmul.SHAPE_TILES);
- the device's copy bandwidth and fp32 matmul rate, measured in the same run.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import knobs
from flashtree.bench.roofline import measure_ceilings
from flashtree.kernels.dense_matmul import DenseTiles, dense_linear

DEVICE = torch.device("cuda")
# (name, N, K, calls in an AR step, in a draft step, in a verify) for SmolLM2-135M + its 5-layer draft
SHAPES = [
    ("qkv", 960, 576, 30, 5, 30),
    ("o", 576, 576, 30, 5, 30),
    ("gate_up", 3072, 576, 30, 5, 30),
    ("down", 576, 1536, 30, 5, 30),
    ("draft_fc", 576, 2880, 0, 1, 0),
    ("lm_head", 49152, 576, 1, 1, 1),
]
ROWS = {"ar": 1, "draft": 16, "verify": 23}  # the phases, in SHAPES' order of call counts
SWEEP = [
    DenseTiles(rows, k_block, warps, stages, programs, fused)
    for rows, k_block, warps, stages, programs, fused in itertools.product(
        (16, 32, 64), (32, 64, 128), (4,), (1, 2), (64, 264), (1,)
    )
] + [DenseTiles(64, 64, 4, 1, 264, 0), DenseTiles(16, 64, 4, 1, 264, 0), DenseTiles(128, 64, 8, 1, 264)]
# more K-splits (fewer K blocks per program, a longer tail): untried in session 12's sweep, which found
# every launch latency-bound at 5-10 us
SWEEP += [
    DenseTiles(rows, k_block, 4, stages, programs, fused)
    for rows, k_block, stages, programs, fused in itertools.product(
        (16, 32, 64), (32, 64), (1, 2), (528, 1056), (1, 0)
    )
]
COPIES_BYTES = 256 << 20  # a graph's weight copies: more than the H200's 50 MB L2


def time_us(fn, weights: list[torch.Tensor], x: torch.Tensor) -> float:
    """us per call of fn(x, w) over the weight copies, replayed from one CUDA graph (best of 5)."""
    for w in weights[:2]:
        fn(x, w)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(x, w)
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (10 * len(weights)))
    return best


def time_shapes(tiles_list: list[DenseTiles]) -> list[dict]:
    rows = []
    for name, n, k, *_ in SHAPES:
        copies = max(2, COPIES_BYTES // (4 * n * k))
        weights = [torch.randn(n, k, device=DEVICE) / k**0.5 for _ in range(copies)]
        for phase, m in ROWS.items():
            x = torch.randn(m, k, device=DEVICE)
            row = {"shape": name, "phase": phase, "m": m, "cublas_us": time_us(F.linear, weights, x)}
            for tiles in tiles_list:
                row[json.dumps(list(tiles.__dict__.values()))] = time_us(
                    lambda x, w, t=tiles: dense_linear(x, w, t), weights, x
                )
            rows.append(row)
            print(name, phase, {key: round(v, 2) for key, v in row.items() if key[0] in "c["})
        del weights
    return rows


def step_totals(timings: list[dict], keys: list[str]) -> dict:
    """us per default-pair step phase (AR, verify, draft) for each timed kernel: calls x us per call."""
    calls = {name: dict(zip(ROWS, counts, strict=True)) for name, _, _, *counts in SHAPES}
    totals = {}
    for key in keys:
        totals[key] = {
            phase: sum(r[key] * calls[r["shape"]][phase] for r in timings if r["phase"] == phase)
            for phase in ROWS
        }
    return totals


def tiles_by_shape(timings: list[dict], keys: list[str]) -> dict[str, list[int]]:
    """Per shape "NxK", the tile with the least time over a speculative step's calls (draft + verify)."""
    chosen = {}
    for name, n, k, _, draft_calls, verify_calls in SHAPES:
        at = {r["phase"]: r for r in timings if r["shape"] == name}
        step_us = {key: draft_calls * at["draft"][key] + verify_calls * at["verify"][key] for key in keys}
        chosen[f"{n}x{k}"] = json.loads(min(keys, key=step_us.get))
    return chosen


def main(out_dir: str, sweep: bool) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ceilings = measure_ceilings(DEVICE)
    default = knobs.dense_default_tiles()
    tiles_list = [default] + ([t for t in SWEEP if t != default] if sweep else [])
    timings = time_shapes(tiles_list)
    keys = ["cublas_us"] + [json.dumps(list(t.__dict__.values())) for t in tiles_list]
    totals = step_totals(timings, keys)
    best = min(keys[1:], key=lambda key: sum(totals[key].values()))
    print("per step (us): cublas", totals["cublas_us"], "default", totals[keys[1]])
    print("best", best, totals[best])
    by_shape = tiles_by_shape(timings, keys[1:])
    shape_key = {name: f"{n}x{k}" for name, n, k, *_ in SHAPES}
    for r in timings:
        r["by_shape_us"] = r[json.dumps(by_shape[shape_key[r["shape"]]])]
    totals["by_shape_us"] = step_totals(timings, ["by_shape_us"])["by_shape_us"]
    print("tiles by shape", json.dumps(by_shape), totals["by_shape_us"])
    result = {
        "ceilings": dataclasses.asdict(ceilings), "timings": timings, "step_totals_us": totals,
        "best_tiles": best, "default_tiles": keys[1], "tiles_by_shape": by_shape,
        "device": torch.cuda.get_device_name(),
    }  # fmt: skip
    (out / "dense_matmul.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], "--sweep" in sys.argv[2:])
