"""Quantized-matmul kernels on a real GPU: a tile sweep, per-type tiles, the 27B layer shapes timed.

    python -m benchmarks.gpu_kernels OUT_DIR [--stages sweep,shapes] [--name kernels] [--tiles-out FILE]
                                     [--own-tiles b32:Q6_K,...]

Their correctness (every type against the reference math and x @ W^T, batch invariance, the dequantizer,
the inline PTX against its emulation) is tests/gpu/test_quant_matmul_gpu.py; `python -m benchmarks
kernels` runs it first (--kernel-parts with checks).
1. sweep: a few tiles per bucket on the 27B shapes, then the K-split target (qmatmul.SPLIT_TARGET); the
   fastest tiles are kept (and written as FLASHTREE_QMM_TILES JSON to --tiles-out).
2. types: per GGUF type of the 27B shapes and per bucket, tiles timed on that type's matrices alone; a
   type's winner becomes its own tile ("b32:Q6_K") where it beats the type's current tile by 2 %.
3. shapes: every 27B layer shape at M in {1, 16, 23, 32, 64} next to dense bf16 cuBLAS, as achieved
   bandwidth against the copy ceiling measured in the same run.
Timings replay a CUDA graph of back-to-back calls that cycle over enough weight copies to leave L2.
Tiles and targets are set through benchmarks/knobs.py. Needs torch, triton, numpy and gguf.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import astuple
from pathlib import Path

import numpy as np
import torch
import triton

from benchmarks import knobs
from benchmarks.timing import graph_time_us
from flashtree.bench.roofline import measure_ceilings
from flashtree.kernels import qmatmul
from flashtree.kernels.qmatmul import TileConfig, packed_bytes, repack
from flashtree.quant.formats import QT, row_bytes
from flashtree.quant.pack import random_blocks

TIME_M = (1, 16, 23, 32, 64)
SHAPES_27B = [  # (name, type, rows, cols): every matrix one Qwen3.6-27B Q4_K_M decode step multiplies
    ("ffn_gate/up", QT.Q4_K, 17408, 5120),
    ("ffn_down", QT.Q4_K, 5120, 17408),
    ("ffn_down", QT.Q6_K, 5120, 17408),
    ("attn_qkv", QT.Q4_K, 10240, 5120),
    ("attn_qkv", QT.Q6_K, 10240, 5120),
    ("attn_q", QT.Q4_K, 12288, 5120),
    ("attn_gate", QT.Q4_K, 6144, 5120),
    ("ssm_out/attn_out", QT.Q4_K, 5120, 6144),
    ("attn_k/v", QT.Q4_K, 1024, 5120),
    ("output", QT.Q6_K, 248320, 5120),
]
SWEEP_SHAPES = [SHAPES_27B[i] for i in (0, 1, 2, 4)]
SWEEP = {  # bucket -> (the M timed, candidate tiles (rows, warps, stages, unroll, fused_sum)): few, each
    # compiles; fused_sum 1 / 0: the K-splits added in the matmul kernel / by a second kernel
    "m1": ((1,), [TileConfig(*c) for c in ((64, 2, 1, 2, 1), (64, 2, 1, 2, 0), (128, 4, 1, 2, 1))]),
    # 16 x 4 x 1 and 64 x 8 x 1: the tiles that compile without spilling (benchmarks/sm90_registers.py; not
    # yet timed in this arithmetic; in bf16 they ran 1.7-2.5x slower than the defaults:
    # bench/results/h100-checks-2026-12-05)
    "m16": ((16,), [TileConfig(*c) for c in (
        (128, 4, 2, 1, 0), (128, 4, 2, 1, 1), (64, 4, 1, 1, 0), (16, 4, 1, 1, 0), (64, 8, 1, 1, 0))]),
    "m32": ((23, 32), [TileConfig(*c) for c in (
        (64, 4, 2, 1, 0), (64, 4, 2, 1, 1), (128, 4, 1, 1, 0), (16, 4, 1, 1, 0), (64, 8, 1, 1, 0))]),
}  # fmt: skip
SWEEP_BF16 = {  # FLASHTREE_QMM_ARITH=bf16 (its buckets include M = 1): 4 warps or more, so that every bucket
    # runs the same tensor-core instruction (wgmma) and rows stay batch-invariant; 1 stage = plain loads
    # (the no-spill 16 x 4 x 1 and 64 x 8 x 1 ran 1.7-2.5x slower: bench/results/h100-checks-2026-12-05)
    "b16": ((1, 16), [TileConfig(*c) for c in (
        (128, 4, 2, 1, 0), (128, 4, 1, 1, 0), (64, 4, 1, 1, 0), (128, 8, 1, 1, 0), (256, 8, 2, 1, 0),
        (128, 4, 3, 1, 0), (128, 4, 2, 1, 1))]),
    "b32": ((23, 32), [TileConfig(*c) for c in ((128, 4, 2, 1, 0), (128, 4, 1, 1, 0), (256, 8, 2, 1, 0))]),
    "b64": ((64,), [TileConfig(*c) for c in ((128, 4, 2, 1, 0), (128, 8, 2, 1, 0), (256, 8, 2, 1, 0))]),
}  # fmt: skip
# Tiles of fewer than 4 warps run mma.sync, not wgmma (a warpgroup is 4 warps): no shared-memory fences and
# waits around each group's dot (the wgmma kernel's SASS has ~8 barriers a group), but each warp converts
# its operands itself. One such tile serves all three bf16 buckets at once, so that every M runs the same
# instruction (batch invariance across buckets); timed against the per-bucket winners at every M.
UNIFORM_BF16 = [
    TileConfig(*c) for c in ((64, 2, 1, 1, 0), (64, 2, 2, 1, 0), (128, 2, 2, 1, 0), (32, 1, 2, 1, 0))
]
UNIFORM_M = (1, 16, 23, 32, 64)
# Tiles tried per type in each bf16 bucket: Q6_K's matrices ran at 0.33 of copy bandwidth at 23 rows with
# the b32 tile (128 x 4 x 2), where Q4_K's ran at 0.41 and Q6_K's own at 16 rows (64 x 4 x 1) at 0.45
# (bench/results/h100-q6k-tiles-2026-12-05).
TYPE_SWEEP_BF16 = [TileConfig(*c) for c in (
    (64, 4, 1, 1, 0), (64, 4, 2, 1, 0), (128, 4, 1, 1, 0), (128, 4, 2, 1, 0), (64, 8, 2, 1, 0),
    (128, 8, 2, 1, 0), (256, 8, 2, 1, 0))]  # fmt: skip
TYPE_GAIN = 0.98  # a type's new tile is taken if it takes at most this fraction of its current tile's time
SPLIT_TARGETS = (1 << 15, 1 << 16, 1 << 17, 1 << 18)  # runtime only: no compiles
L2_BYTES = 60 << 20
DEVICE = torch.device("cuda")


# --- timing --------------------------------------------------------------------------------------------


def weight_copies(qtype: int, rows: int, cols: int, seed: int = 0) -> list[list[torch.Tensor]]:
    """Enough repacked copies of a random (rows, cols) matrix to exceed 3x L2 when cycled.
    Rows are tiled from 256 random ones: timing needs real-looking bytes, not distinct rows."""
    base = torch.from_numpy(random_blocks(qtype, 256, cols, np.random.default_rng(seed))).to(DEVICE)
    n = max(2, -(-3 * L2_BYTES // (rows * row_bytes(qtype, cols))))
    reps = -(-rows // 256)
    return [repack(base.roll(i, 0).repeat(reps, 1)[:rows].contiguous(), qtype, cols) for i in range(n)]


def quant_time_us(copies, qtype, rows, cols, m) -> float:
    x = torch.randn(m, cols, device=DEVICE, dtype=torch.bfloat16)
    return graph_time_us([lambda f=f: knobs.qmm(x, f, qtype, rows, cols) for f in copies] * 2)


def dense_copies(rows, cols) -> list[torch.Tensor]:
    n = max(2, -(-3 * L2_BYTES // (rows * cols * 2)))
    return [torch.randn(rows, cols, device=DEVICE, dtype=torch.bfloat16) for _ in range(n)]


def dense_time_us(weights, m) -> float:
    x = torch.randn(m, weights[0].shape[1], device=DEVICE, dtype=torch.bfloat16)
    return graph_time_us([lambda w=w: x @ w.t() for w in weights] * 2)


# --- sweep ---------------------------------------------------------------------------------------------


def sweep() -> dict:
    """The fastest tile per bucket, then the fastest K-split target, summed over the sweep shapes."""
    copies = {(qt, r, c): weight_copies(qt, r, c) for _, qt, r, c in SWEEP_SHAPES}

    def total_us(ms) -> float:
        return sum(quant_time_us(copies[(qt, r, c)], qt, r, c, m) for _, qt, r, c in SWEEP_SHAPES for m in ms)

    table, best = [], {}
    for key, (ms, candidates) in (SWEEP_BF16 if knobs.qmm_arithmetic() == "bf16" else SWEEP).items():
        for tile in candidates:
            knobs.set_qmm_tile(key, tile)
            try:
                us = total_us(ms)
            except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
                print(f"sweep {key:4} {astuple(tile)} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            table.append({"bucket": key, "tile": list(astuple(tile)), "m": list(ms), "us": us})
            print(f"sweep {key:4} {astuple(tile)} M={ms}: {us:9.1f} us over the sweep shapes", flush=True)
            if key not in best or us < best[key][1]:
                best[key] = (tile, us)
        knobs.set_qmm_tile(key, best[key][0] if key in best else knobs.qmm_default_tile(key))
    if knobs.qmm_arithmetic() == "bf16":
        table += sweep_uniform_bf16(total_us)
    splits = []
    for target in SPLIT_TARGETS:
        knobs.set_split_target(target)
        us = {m: total_us((m,)) for m in (1, 23)}
        splits.append({"split_target": target, "us_m1": us[1], "us_m23": us[23]})
        print(f"sweep SPLIT_TARGET {target:7}: M=1 {us[1]:8.1f} us  M=23 {us[23]:8.1f} us", flush=True)
    chosen = min(splits, key=lambda s: s["us_m1"] + s["us_m23"])
    knobs.set_split_target(chosen["split_target"])
    print(f"sweep chose tiles {_tiles()} and SPLIT_TARGET {knobs.split_target()}", flush=True)
    return {"tiles": table, "splits": splits, "best": _tiles(), "split_target": knobs.split_target()}


def sweep_uniform_bf16(total_us) -> list[dict]:
    """UNIFORM_BF16's tiles, each for all bf16 buckets at once, against the per-bucket winners now in
    force, summed over UNIFORM_M; the fastest is kept if it beats them."""
    buckets = ("b16", "b32", "b64")
    winners = {key: knobs.qmm_tiles()[key] for key in buckets}
    best, best_us = winners, total_us(UNIFORM_M)
    print(f"sweep bf16 per-bucket winners M={UNIFORM_M}: {best_us:9.1f} us over the sweep shapes", flush=True)
    table = []
    for tile in UNIFORM_BF16:
        knobs.set_qmm_tiles(dict.fromkeys(buckets, tile))
        try:
            us = total_us(UNIFORM_M)
        except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
            print(f"sweep bf16 uniform {astuple(tile)} failed: {type(e).__name__}: {str(e)[:300]}")
            continue
        table.append({"bucket": "b16+b32+b64", "tile": list(astuple(tile)), "m": list(UNIFORM_M), "us": us})
        print(f"sweep bf16 uniform {astuple(tile)} M={UNIFORM_M}: {us:9.1f} us over the sweep shapes")
        if us < best_us:
            best, best_us = dict.fromkeys(buckets, tile), us
    knobs.set_qmm_tiles(best)
    return table


def sweep_types(keys: list[str] | None = None) -> dict:
    """Per type of SHAPES_27B and per bucket (or the "BUCKET:TYPE" keys given): each candidate tile on
    that type's matrices alone (every shape of the type, at the bucket's M), against the type's current
    tile (its own or the bucket's); a clear winner becomes the type's own tile in the tiles in force
    ("BUCKET:TYPE"), and a type whose tile is the bucket's has no key of its own."""
    arithmetic = knobs.qmm_arithmetic()
    buckets = SWEEP_BF16 if arithmetic == "bf16" else SWEEP
    table, chosen = [], {}
    for qtype in sorted({qt for _, qt, _, _ in SHAPES_27B}):
        wanted = [key for key in buckets if keys is None or f"{key}:{qtype.name}" in keys]
        if not wanted:
            continue
        shapes = [(r, c) for _, qt, r, c in SHAPES_27B if qt == qtype]
        copies = {shape: weight_copies(qtype, *shape) for shape in shapes}
        for key in wanted:
            ms, candidates = buckets[key]
            own = f"{key}:{qtype.name}"
            current = knobs.qmm_tile_for(ms[0], arithmetic, qtype)  # its own tile if it has one
            tiles = TYPE_SWEEP_BF16 if arithmetic == "bf16" else candidates
            timed = {}
            for tile in [current, *(t for t in tiles if t != current)]:
                knobs.set_qmm_tile(own, tile)
                try:
                    timed[tile] = sum(quant_time_us(copies[s], qtype, *s, m) for s in shapes for m in ms)
                except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
                    print(f"types {own} {astuple(tile)} failed: {type(e).__name__}: {str(e)[:200]}")
                    continue
                table.append({"key": own, "tile": list(astuple(tile)), "m": list(ms), "us": timed[tile]})
                print(f"types {own:10} {astuple(tile)} M={ms}: {timed[tile]:9.1f} us", flush=True)
            best = min(timed, key=timed.get)
            keep = best if timed[best] <= TYPE_GAIN * timed[current] else current
            if keep == knobs.qmm_tiles()[key]:
                knobs.set_qmm_tile(own, None)
            else:
                knobs.set_qmm_tile(own, keep)
                chosen[own] = keep
            print(f"types {own}: {astuple(keep)} ({timed[keep]:.1f} us; the current tile "
                  f"{timed[current]:.1f})", flush=True)  # fmt: skip
        del copies
    return {"tiles": table, "chosen": {k: list(astuple(t)) for k, t in chosen.items()}}


def _tiles() -> dict:
    return {k: list(astuple(t)) for k, t in knobs.qmm_tiles().items()}


# --- shapes --------------------------------------------------------------------------------------------


def quantize_time_us(cols: int, m: int) -> float:
    """The activation quantization alone: one of the launches inside every quant_matmul call."""
    x = torch.randn(m, cols, device=DEVICE, dtype=torch.bfloat16)
    rows = 1 if m == 1 else max(16, triton.next_power_of_2(m))
    return graph_time_us([lambda: qmatmul.quantize_activations(x, rows)] * 20)


def time_shapes(copy_gb_s: float) -> dict:
    rows = []
    for name, qtype, r, c in SHAPES_27B:
        copies, dense = weight_copies(qtype, r, c), dense_copies(r, c)
        nbytes = packed_bytes(copies[0])
        for m in TIME_M:
            q_us, d_us = quant_time_us(copies, qtype, r, c, m), dense_time_us(dense, m)
            q_frac, d_frac = nbytes / q_us / 1e3 / copy_gb_s, r * c * 2 / d_us / 1e3 / copy_gb_s
            rows.append({
                "name": name, "type": qtype.name, "rows": r, "cols": c, "m": m, "packed_bytes": nbytes,
                "quant_us": q_us, "quant_bw_frac": q_frac, "dense_us": d_us, "dense_bw_frac": d_frac,
            })  # fmt: skip
            print(
                f"time {name:16} {qtype.name:5} {r:6}x{c:<5} M={m:<2}  quant {_cell(q_us, q_frac)}"
                f"  dense bf16 {_cell(d_us, d_frac)}  (us, fraction of copy bandwidth)",
                flush=True,
            )
        del copies, dense
    print_shape_table(rows)
    quantize = {f"K={c} M={m}": quantize_time_us(c, m) for c in (5120, 17408) for m in (1, 23)}
    print("activation quantization alone: " + ", ".join(f"{k} {us:.1f} us" for k, us in quantize.items()))
    return {"matrices": rows, "quantize_us": quantize}


def _cell(us: float, frac: float) -> str:
    return f"{us:8.1f} ({frac:.2f})"


def print_shape_table(rows: list[dict]) -> None:
    """Two lines per matrix, quantized then dense bf16: us (fraction of copy bandwidth) per M."""
    head = "".join(f"{'M=' + str(m):>16}" for m in TIME_M)
    print(f"\n{'matrix':16} {'type':5} {'rows x cols':12} {'kernel':6}{head}")
    for key in dict.fromkeys((r["name"], r["type"], r["rows"], r["cols"]) for r in rows):
        cells = {r["m"]: r for r in rows if (r["name"], r["type"], r["rows"], r["cols"]) == key}
        for kind in ("quant", "dense"):
            label = f"{key[0]:16} {key[1]:5} {f'{key[2]}x{key[3]}':12}" if kind == "quant" else " " * 35
            line = "".join(
                f"{_cell(cells[m][kind + '_us'], cells[m][kind + '_bw_frac']):>16}" for m in TIME_M
            )
            print(f"{label} {kind:6}{line}")
    total = {m: sum(r["quant_us"] for r in rows if r["m"] == m) for m in TIME_M}
    print("one of each matrix, quantized: " + ", ".join(f"M={m} {us:.0f} us" for m, us in total.items()))


def main() -> None:
    stages = ("sweep", "types", "shapes")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tiles-out", type=Path)
    parser.add_argument("--stages", default="sweep,shapes", help=f"some of {', '.join(stages)}, in order")
    parser.add_argument("--name", default="kernels", help="results go to OUT_DIR/NAME.json")
    parser.add_argument("--own-tiles", help="the types stage's BUCKET:TYPE keys (default: all)")
    args = parser.parse_args()
    if unknown := sorted(set(args.stages.split(",")) - set(stages)):
        parser.error(f"--stages: unknown {unknown} (the checks are tests/gpu/test_quant_matmul_gpu.py)")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(DEVICE), "torch": torch.__version__}
    result["triton"] = triton.__version__
    t0 = time.time()
    ceilings = measure_ceilings(DEVICE)
    result["ceilings"] = ceilings.as_dict()
    result["arithmetic"] = knobs.qmm_arithmetic()
    print(f"ceilings: {ceilings}", flush=True)
    run = {
        "sweep": sweep,
        "types": lambda: sweep_types(args.own_tiles.split(",") if args.own_tiles else None),
        "shapes": lambda: time_shapes(ceilings.copy_gb_s),
    }
    for name in args.stages.split(","):
        started = time.time()
        try:
            result[name] = run[name]()
        except Exception as e:  # noqa: BLE001 - keep what the other stages found
            result[name] = f"failed: {type(e).__name__}: {e}"
            print(f"{name} failed: {type(e).__name__}: {e}", flush=True)
        result[f"{name}_s"] = time.time() - started
        print(f"--- stage {name}: {result[f'{name}_s']:.0f} s", flush=True)
        result["tiles"], result["split_target"] = _tiles(), knobs.split_target()
        (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
        if name in ("sweep", "types") and args.tiles_out:  # a next run may start before the shapes are timed
            args.tiles_out.write_text(json.dumps(result["tiles"]))
    print(f"tiles {result['tiles']}  SPLIT_TARGET {knobs.split_target()}  total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
