"""Registers and spills of the packed matmul kernels per tile, compiled for sm_90 on the CPU (no GPU needed).

    python -m benchmarks.sm90_registers OUT.json

Why: the registers a tile takes decide how many programs an SM holds. Since session 23 the compile
mirrors the JIT's alignment specializations (flashtree/kernels/sm90.py) and agrees with Nsight Compute on
the device to a register (bench/results/cpu-sm90-registers-aligned-2026-12-05: the verify's bf16 tile 128
registers here, 127 there; no tile spills). Session 20's run without them reported 255 registers and
spills (bench/results/cpu-sm90-registers-2026-12-05): an artifact of byte-wise loads.
Each tile's launches are recorded under Triton's interpreter (a 27B-width Q4_K and
Q6_K matrix at M = 1, 16 and 23, both arithmetics; the one-row dp4a kernel at its tile) and compiled with
the GPU switches on (flashtree/kernels/sm90.py).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # record the launches on the CPU; sm90.py compiles without it

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks import knobs  # noqa: E402
from flashtree.bench.run import provenance  # noqa: E402
from flashtree.kernels import qmatmul  # noqa: E402
from flashtree.kernels.sm90 import compile_for_sm90, recording  # noqa: E402
from flashtree.quant.formats import QT  # noqa: E402
from flashtree.quant.pack import random_blocks  # noqa: E402

# (rows, warps, stages) for the tensor-core buckets; the defaults are among them
TILES = [(16, 4, 1), (32, 4, 1), (32, 2, 1), (64, 4, 1), (64, 8, 1), (64, 4, 2), (128, 4, 2), (128, 8, 1)]
COLS = 256 * 4  # 4 super-blocks a row: the kernels' code is the same for any width


def records_for(tile: tuple[int, int, int]) -> list[dict]:
    rows, warps, stages = tile
    for key in [k for k in knobs.qmm_tiles() if ":" in k]:  # a type's own tile: this tile for every type
        knobs.set_qmm_tile(key, None)
    knobs.set_qmm_tiles(
        dict.fromkeys(("m16", "m32", "b16", "b32"), qmatmul.TileConfig(rows, warps, stages, 1, 0))
    )
    with recording() as found:
        for qtype in (QT.Q4_K, QT.Q6_K):
            raw = torch.from_numpy(random_blocks(qtype, 128, COLS, np.random.default_rng(0)))
            fields = qmatmul.repack(raw, qtype, COLS)
            for m, arithmetic in (
                (1, "int8"),
                (1, "bf16"),
                (16, "bf16"),
                (23, "bf16"),
                (16, "int8"),
                (23, "int8"),
            ):
                knobs.qmm(torch.randn(m, COLS), fields, qtype, 128, COLS, arithmetic)
    return [r for r in found if r["name"] in ("_matvec_kernel", "_matmul_kernel")]


def main(out: Path) -> None:
    rows = []
    for tile in TILES:
        records = records_for(tile)
        for record, facts in zip(records, compile_for_sm90(records, also="registers"), strict=True):
            c = record["constexprs"]
            row = {
                "kernel": record["name"], "type": QT(c["QTYPE"]).name,
                "arithmetic": "bf16" if c.get("BF16") else "int8", "bm": c.get("BM", 1), "rows": c["BN"],
                "warps": record["options"]["num_warps"],
                "stages": record["options"].get("num_stages"), "registers": facts.get("registers"),
                "spill_bytes": facts.get("spill_bytes"), "failure": facts["failure"],
            }  # fmt: skip
            if row not in rows:  # the one-row kernel's tile does not change with the buckets'
                rows.append(row)
                print(f"{row['kernel']:<15} {row['type']:<5} {row['arithmetic']:<5} M<={row['bm']:<3} "
                      f"{row['rows']:>3} rows x {row['warps']} warps x {row['stages']} stages: "
                      f"{row['registers']} registers, {row['spill_bytes']} bytes spilled",
                      flush=True)  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**provenance(), "cols": COLS, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
