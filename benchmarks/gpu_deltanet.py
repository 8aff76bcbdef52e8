"""The tree Gated DeltaNet kernel's tile (value columns per program, warps) swept at the 27B's heads (H200).

    python -m benchmarks.gpu_deltanet OUT_DIR     -> OUT_DIR/deltanet.json; exit 1 when a tile fails its check

Why: the 27B's bf16 verify of 23 tokens spent 1.99 ms in this kernel's 48 launches, ~1.8 us a token of a
dependent chain (norms, the state's decay, two reductions over K, the update), the AR step 0.19 ms
(bench/results/h200-launch-cuts-2026-12-03/step_packed_bf16.json). The tile sets how a program's (K, BV)
slice of the state spreads over its threads, so how far each reduction travels (inside one warp: shuffles
only; across warps: shared memory and barriers), and how many programs share the GPU.

Per tile: benchmarks/checks.py's check_tree_deltanet (the torch reference within 1e-5, each token alone
equal to its row of the launch bit for bit, the AR step's in-place write, the verify and the commit's
replay; tests/gpu/test_tree_deltanet_gpu.py at the default tile), then the time per call from CUDA
graphs of 48 calls on 48 layers' own states (151 MB, more than L2 holds, as in a step): the AR step (one
token, its state written in place) and a 23-token tree (a 16-token chain and 7 siblings), the tree also
as the model's verify runs it (`keep`: only the states its siblings restart from written). Apply a choice
with FLASHTREE_DELTA_TILE=BV,WARPS (kernels/tree_deltanet.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from benchmarks import knobs
from benchmarks.checks import DEVICE, check_tree_deltanet
from benchmarks.timing import graph_time_us
from flashtree.bench.run import provenance
from flashtree.kernels.tree_deltanet import tree_gated_delta_rule
from flashtree.models.block import BlockLayout

TILES = [(32, 4), (32, 2), (32, 1), (16, 4), (16, 2), (16, 1), (8, 1), (8, 2), (64, 4), (64, 8), (128, 8)]
NK, NV, KD, VD = 16, 48, 128, 128  # the 27B's heads
LAYERS = 48
TREE = list(range(-1, 15)) + [0, 1, 2, 5, 0, 16, 9]  # 23 nodes: a 16-token chain and 7 siblings


def timings(tile: tuple[int, int]) -> dict:
    gen = torch.Generator().manual_seed(1)
    t = len(TREE)
    conv_out = torch.randn(t, 2 * NK * KD + NV * VD, generator=gen).to(DEVICE)
    projection = (torch.randn(t, 2 * NV, generator=gen) * 3).to(DEVICE)
    alpha, beta = projection[:, :NV], projection[:, NV:]
    dt_bias, ssm_a = torch.randn(NV).to(DEVICE), -torch.rand(NV).to(DEVICE) * 2
    layer_states = [torch.randn(NV, KD, VD, device=DEVICE) * 0.3 for _ in range(LAYERS)]
    tree = torch.tensor(TREE, dtype=torch.int32, device=DEVICE)
    root = tree[:1]
    states = torch.empty(t, NV, KD, VD, device=DEVICE)

    def ar(s):
        return tree_gated_delta_rule(
            conv_out[:1], alpha[:1], beta[:1], dt_bias, ssm_a, s, root, NK, states=s[None], tile=tile
        )

    def verify(s, keep=None):
        return tree_gated_delta_rule(
            conv_out, alpha, beta, dt_bias, ssm_a, s, tree, NK, states=states, tile=tile, keep=keep
        )

    restarts = BlockLayout.from_parents(tree.long()).restart_points().to(torch.int8)  # the model's verify

    return {
        "ar_us": graph_time_us([lambda s=s: ar(s) for s in layer_states]),
        "verify_23_us": graph_time_us([lambda s=s: verify(s) for s in layer_states]),
        "verify_23_restart_states_us": graph_time_us([lambda s=s: verify(s, restarts) for s in layer_states]),
    }


def main(out_dir: Path) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for tile in TILES:
        row = {"tile": list(tile), **check_tree_deltanet(tile), **timings(tile)}
        rows.append(row)
        times = (
            f"AR {row['ar_us']:7.1f} us  verify 23 {row['verify_23_us']:7.1f} us (restart states only "
            f"{row['verify_23_restart_states_us']:7.1f})"
        )
        print(f"tile BV {tile[0]:>3} warps {tile[1]}: err {row['max_abs_err']:.1e} ok {row['ok']} "
              f"rows bitwise {row['rows_bitwise']}  {times}", flush=True)  # fmt: skip
        if not row["rows_bitwise"]:
            print(f"  bitwise, by comparison: {row['bitwise']}", flush=True)
    result = {
        **provenance(),
        "device": str(DEVICE),
        "default_tile": list(knobs.delta_tile()),
        "layers": LAYERS,
        "rows": rows,
    }
    (out_dir / "deltanet.json").write_text(json.dumps(result, indent=2) + "\n")
    failures = [r for r in rows if not (r["ok"] and r["rows_bitwise"])]
    print("FAILURES" if failures else "all ok", len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
