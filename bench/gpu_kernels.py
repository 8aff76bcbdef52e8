"""Quantized-matmul kernels on a real GPU: check against dequantize + matmul, sweep tiles, time 27B shapes.

    python bench/gpu_kernels.py OUT_DIR [--stages checks,sweep,shapes] [--name kernels] [--tiles-out FILE]

1. Checks every kernel type at M in {1, 5, 16, 23, 33, 64, 100} against the reference dequantizer
   (flashtree.quant.dequant) + an fp32 matmul, and the kernels' own dequantizer bit for bit.
2. Sweeps tile configs on the Qwen3.6-27B layer shapes (M = 1 and the tensor-core buckets) and keeps
   the fastest per bucket (written as FLASHTREE_QMM_TILES JSON to --tiles-out).
3. Times every 27B layer shape at M in {1, 16, 23, 32, 64} with the chosen tiles, next to dense bf16
   cuBLAS on the same shape, as achieved bandwidth against the measured copy ceiling.
Timings replay a CUDA graph of back-to-back calls that cycle over enough weight copies to leave L2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import astuple
from pathlib import Path

import numpy as np
import torch

from flashtree.bench.roofline import measure_ceilings
from flashtree.kernels import qmatmul
from flashtree.kernels.qmatmul import TileConfig, dequantize_packed, packed_bytes, quant_matmul, repack
from flashtree.quant.dequant import dequantize
from flashtree.quant.formats import QT, row_bytes
from flashtree.quant.pack import random_blocks

CHECK_M = (1, 5, 16, 23, 33, 64, 100)  # every path: GEMV, the three tensor-core buckets, dequant + cuBLAS
CHECK_M_SHORT = (1, 23, 100)  # the types 27B Q4_K_M does not use: one M per path kind (fewer compiles)
TIME_M = (1, 16, 23, 32, 64)
CHECK_SHAPES = {  # (rows, cols): k-quants need cols % 256 == 0, 576 is SmolLM2's width (18 blocks of 32)
    QT.Q4_K: (1000, 4096), QT.Q5_K: (1000, 4096), QT.Q6_K: (1000, 4096),
    QT.Q8_0: (1000, 576), QT.Q4_0: (1000, 576), QT.Q4_1: (1000, 1536),
}  # fmt: skip
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
SWEEP = {  # few candidates: each one is a Triton compile per type, paid in device time
    "gemv": [TileConfig(*c) for c in ((8, 2, 2), (16, 4, 2), (32, 4, 2), (32, 8, 2))],
    "dot": [TileConfig(*c) for c in ((16, 4, 1), (32, 4, 1), (64, 4, 1))],
}
L2_BYTES = 60 << 20


def weight_copies(qtype: int, rows: int, cols: int, seed: int = 0) -> list[list[torch.Tensor]]:
    """Enough repacked copies of a random (rows, cols) matrix to exceed 3x L2 when cycled.
    Rows are tiled from 256 random ones: timing needs real-looking bytes, not distinct rows."""
    base = torch.from_numpy(random_blocks(qtype, 256, cols, np.random.default_rng(seed))).cuda()
    n = max(2, -(-3 * L2_BYTES // (rows * row_bytes(qtype, cols))))
    reps = -(-rows // 256)
    return [repack(base.roll(i, 0).repeat(reps, 1)[:rows].contiguous(), qtype, cols) for i in range(n)]


def graph_time_us(calls: list, reps: int = 20) -> float:
    """Median time per call (us) of a CUDA graph that runs `calls` back to back."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def quant_time_us(copies, qtype, rows, cols, m, tile: TileConfig | None = None) -> float:
    if tile is not None:
        qmatmul.TILES[qmatmul.tile_key(m)] = tile
    x = torch.randn(m, cols, device="cuda", dtype=torch.bfloat16)
    calls = [lambda f=f: quant_matmul(x, f, qtype, rows, cols) for f in copies] * 2
    return graph_time_us(calls)


def dense_copies(rows, cols) -> list[torch.Tensor]:
    n = max(2, -(-3 * L2_BYTES // (rows * cols * 2)))
    return [torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) for _ in range(n)]


def dense_time_us(weights, m) -> float:
    x = torch.randn(m, weights[0].shape[1], device="cuda", dtype=torch.bfloat16)
    return graph_time_us([lambda w=w: x @ w.t() for w in weights] * 2)


def check_all(types: list[str]) -> list[dict]:
    rows = []
    for qtype, (n, k) in CHECK_SHAPES.items():
        if qtype.name not in types:
            continue
        try:
            rows += check_type(qtype, n, k)
        except Exception as e:  # noqa: BLE001 - report it, check the other types
            rows.append({"type": qtype.name, "error": f"{type(e).__name__}: {e}"[:2000], "ok": False})
            print(f"check {qtype.name} failed: {type(e).__name__}: {e}", flush=True)
    return rows


def check_type(qtype, n: int, k: int) -> list[dict]:
    raw = torch.from_numpy(random_blocks(qtype, n, k, np.random.default_rng(int(qtype)))).cuda()
    fields = repack(raw, qtype, k)
    ref_w = dequantize(raw, qtype, (n, k))  # (n, k) fp32, the reference decoder
    # the kernels' decoder vs the reference: FMA contraction may move a value by 1 ulp
    dq_err = (dequantize_packed(fields, qtype, n, k, torch.float32) - ref_w).abs().max().item()
    rows = []
    for m in CHECK_M if qtype in (QT.Q4_K, QT.Q6_K) else CHECK_M_SHORT:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = torch.full(
            (m, n), float("nan"), device="cuda", dtype=torch.bfloat16
        )  # poison: all must be written
        y = quant_matmul(x, fields, qtype, n, k).float()
        ref = x.float() @ ref_w.t()
        rel = ((y - ref).norm() / ref.norm()).item()
        ok = rel < 1e-2 and bool(torch.isfinite(y).all())
        rows.append({"type": qtype.name, "m": m, "rel_err": rel, "dequant_max_abs_err": dq_err, "ok": ok})
        print(
            f"check {qtype.name:5} M={m:<3} rel err {rel:.2e} dequant max err {dq_err:.1e} ok {ok}",
            flush=True,
        )
    return rows


def sweep() -> dict:
    """The fastest tile per bucket, summed over the sweep shapes."""
    copies = {(qt, r, c): weight_copies(qt, r, c) for _, qt, r, c in SWEEP_SHAPES}
    best, table = {}, []
    # the tensor-core buckets share one choice, swept on the verify sizes (M = 23 and 32)
    for key, ms in (("gemv", (1,)), ("dot32", (23, 32))):
        for tile in SWEEP["gemv" if key == "gemv" else "dot"]:
            try:
                us = sum(
                    quant_time_us(copies[(qt, r, c)], qt, r, c, m, tile)
                    for _, qt, r, c in SWEEP_SHAPES
                    for m in ms
                )
            except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
                print(f"sweep {key} {tile}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            table.append({"bucket": key, "tile": list(astuple(tile)), "us": us})
            print(f"sweep {key:6} {astuple(tile)} {us:9.1f} us", flush=True)
            if key not in best or us < best[key][1]:
                best[key] = (tile, us)
        if key in best:
            for k in ("dot16", "dot32", "dot64") if key == "dot32" else (key,):
                qmatmul.TILES[k] = best[key][0]
    return {"table": table, "best": {k: list(astuple(t)) for k, (t, _) in best.items()}}


def time_shapes(copy_gb_s: float) -> list[dict]:
    rows = []
    for name, qtype, r, c in SHAPES_27B:
        copies, dense = weight_copies(qtype, r, c), dense_copies(r, c)
        nbytes = packed_bytes(copies[0])
        for m in TIME_M:
            q_us = quant_time_us(copies, qtype, r, c, m)
            d_us = dense_time_us(dense, m)
            q_frac, d_frac = nbytes / q_us / 1e3 / copy_gb_s, r * c * 2 / d_us / 1e3 / copy_gb_s
            row = {
                "name": name, "type": qtype.name, "rows": r, "cols": c, "m": m, "packed_bytes": nbytes,
                "quant_us": q_us, "quant_bw_frac": q_frac, "dense_us": d_us, "dense_bw_frac": d_frac,
            }  # fmt: skip
            rows.append(row)
            print(
                f"{name:16} {qtype.name:5} {r:6}x{c:<5} M={m:<3} quant {q_us:8.1f} us ({q_frac:.2f} of copy)"
                f"  dense bf16 {d_us:8.1f} us ({d_frac:.2f})",
                flush=True,
            )
        del copies, dense
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--tiles-out", type=Path)
    parser.add_argument("--stages", default="checks,sweep,shapes")
    parser.add_argument("--name", default="kernels", help="results go to OUT_DIR/NAME.json")
    parser.add_argument("--types", default=",".join(t.name for t in CHECK_SHAPES), help="types to check")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton

    result["triton"] = triton.__version__
    t0 = time.time()
    ceilings = measure_ceilings("cuda")
    result["ceilings"] = ceilings.as_dict()
    print(f"ceilings: {ceilings}", flush=True)
    stages = {
        "checks": lambda: check_all(args.types.split(",")),
        "sweep": sweep,
        "shapes": lambda: time_shapes(ceilings.copy_gb_s),
    }
    for name in args.stages.split(","):
        stage = stages[name]
        try:
            result[name] = stage()
        except Exception as e:  # noqa: BLE001 - keep what the other stages found
            result[name] = f"failed: {type(e).__name__}: {e}"
            print(f"{name} failed: {type(e).__name__}: {e}", flush=True)
        result[f"{name}_s"] = time.time() - t0
        result["tiles"] = {k: list(astuple(t)) for k, t in qmatmul.TILES.items()}
        (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
        if name == "sweep" and args.tiles_out:  # the next run may start before the shapes are timed
            args.tiles_out.write_text(json.dumps(result["tiles"]))
    print(f"tiles {result['tiles']}  total {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
