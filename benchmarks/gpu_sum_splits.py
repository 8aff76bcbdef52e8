"""The K-splits' summing launch (qmatmul.sum_splits) swept at the 27B's verify shapes (SUM_BLOCK, SUM_WARPS).

    python -m benchmarks.gpu_sum_splits OUT_DIR [--rows 23]  -> OUT_DIR/sum_splits.json; exit 1: a sum differs

Why: a product whose tile leaves its K-splits to a second launch (every M > 1 bucket) writes fp32
partial sums (n_splits, M, N) that `_sum_splits_kernel` adds. In the 27B's bf16 verify 23 on an H100
those 288 launches took 4.2 of its 18.8 ms of kernels (bench/results/attention-rows-2026-12-06), ~10 MB
each at ~0.7 TB/s: a 5120-row matrix's 23 rows are 115 programs of 1024 sums, fewer than the SMs, each
waiting on its rounds of eight L2 loads. Smaller blocks give more programs; warps trade against them.

For each 27B matrix shape (gpu_kernels.SHAPES_27B; its split count from qmatmul.k_splits, as the matmul
cuts it in the bf16 arithmetic) and each (block, warps): the sums must equal the default's bit for bit
(the order of the adds does not depend on the block; tests/gpu/test_sum_splits_gpu.py checks every
(block, warps) of the sweep at 23 rows), then the time per launch from a CUDA graph of 16
launches over 16 partial-sum buffers (written before, as the matmul leaves them; L2-warm), and the
bandwidth of the partial sums read. The totals are over the shapes, each once (the step's counts differ).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

from benchmarks import knobs
from benchmarks.gpu_kernels import SHAPES_27B
from benchmarks.timing import graph_time_us
from flashtree.bench.run import provenance
from flashtree.kernels import qmatmul
from flashtree.quant.formats import block_size

BLOCKS = (128, 256, 512, 1024, 2048)
WARPS = (1, 2, 4, 8)
BUFFERS = 16


def launches() -> list[tuple[int, int]]:
    """The (block, warps) swept: every pair with at least as many sums a program as threads."""
    return [(block, warps) for block, warps in itertools.product(BLOCKS, WARPS) if block >= 32 * warps]


def sums(parts: torch.Tensor) -> torch.Tensor:
    """qmatmul.sum_splits of `parts` (splits, rows, n) under the launch now in force: (rows, n) bf16."""
    y = torch.empty(parts.shape[1:], device=parts.device, dtype=torch.bfloat16)
    knobs.sum_splits(y, parts)
    return y


def shapes(rows: int) -> list[dict]:
    """Each 27B matrix shape that a verify of `rows` rows sums in a second launch: its partial sums."""
    seen, out = set(), []
    for name, qtype, n, k in SHAPES_27B:
        lay = qmatmul.layout(qtype, k)
        target = knobs.shape_split(qmatmul.split_key("bf16", qtype, n, k))  # FLASHTREE_QMM_SPLITS
        n_splits, _ = qmatmul.k_splits(n, k // block_size(qtype) // lay.group, target)
        tile = knobs.qmm_tile_for(rows, "bf16", qtype)
        if n_splits == 1 or tile.fused_sum or (n, k) in seen:
            continue
        seen.add((n, k))
        out.append({"name": name, "rows": n, "cols": k, "splits": n_splits})
    return out


def sweep(rows: int) -> tuple[list[dict], bool]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    results, same = [], True
    for shape in shapes(rows):
        n, s = shape["rows"], shape["splits"]
        parts = [torch.randn(s, rows, n, device="cuda", generator=gen) for _ in range(BUFFERS)]
        ys = [torch.empty(rows, n, device="cuda", dtype=torch.bfloat16) for _ in range(BUFFERS)]
        want = sums(parts[0])  # the default launch's
        for block, warps in launches():
            with knobs.sum_launch_set(block, warps):
                ok = torch.equal(sums(parts[0]), want)
                calls = [lambda y=y, p=p: knobs.sum_splits(y, p) for y, p in zip(ys, parts, strict=True)]
                us = graph_time_us(calls)
            same &= ok
            gb_s = s * rows * n * 4 / us / 1e3
            results.append({**shape, "block": block, "warps": warps, "us": us, "read_gb_s": gb_s, "same": ok})
            print(f"{shape['name']:>16} {n:>6} x {s:>2} splits  block {block:>4} warps {warps}: "
                  f"{us:7.2f} us  {gb_s:6.0f} GB/s  {'same' if ok else 'DIFFERS'}", flush=True)  # fmt: skip
    return results, same


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--rows", type=int, default=23, help="the verify's rows (M)")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    default = knobs.sum_launch()
    results, same = sweep(args.rows)
    totals = {}
    for r in results:
        key = f"{r['block']}x{r['warps']}"
        totals[key] = totals.get(key, 0.0) + r["us"]
    best, mine = min(totals, key=totals.get), f"{default[0]}x{default[1]}"
    print(f"over the shapes: default {mine} {totals[mine]:.1f} us, best {best} {totals[best]:.1f} us; "
          f"sums {'all the same' if same else 'DIFFER'}")  # fmt: skip
    result = {**provenance(), "rows": args.rows, "default": list(default), "totals_us": totals,
              "best": best, "same": same, "results": results}  # fmt: skip
    (args.out_dir / "sum_splits.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
