"""Where the packed matmul kernels' instructions go, from their sm_90 SASS (no GPU needed).

    python -m benchmarks.sm90_opcodes OUT.json

The bf16 verify matmul is issue-bound (session 23's Nsight Compute: 5.6 instructions a weight), so what
its loop issues per weight is the number to cut. Each kernel is recorded under Triton's interpreter at a
27B-width Q4_K and Q6_K matrix (the verify's 23 rows in bf16, the AR step's one row in int8) at the
default tiles, compiled for sm_90 as the JIT compiles it (flashtree/kernels/sm90.py), and its SASS read:
printed, the instructions of its longest loop (one unit of 256 values a row) per opcode, PRMT by selector,
and per weight (a unit's rows x 256 values over the program's threads).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # record the launches on the CPU; sm90.py compiles without it

import numpy as np  # noqa: E402
import torch  # noqa: E402

from flashtree.bench.run import provenance  # noqa: E402
from flashtree.kernels import qmatmul  # noqa: E402
from flashtree.kernels.sm90 import compile_for_sm90, recording  # noqa: E402
from flashtree.quant.formats import QT  # noqa: E402
from flashtree.quant.pack import random_blocks  # noqa: E402

COLS = 256 * 4  # 4 super-blocks a row: the kernels' code is the same for any width
CASES = [(23, "bf16"), (1, "int8")]  # the verify's matmul, the AR step's matvec
SHOWN = 24  # opcodes printed per kernel


def records() -> list[dict]:
    with recording() as found:
        for qtype in (QT.Q4_K, QT.Q6_K):
            raw = torch.from_numpy(random_blocks(qtype, 128, COLS, np.random.default_rng(0)))
            fields = qmatmul.repack(raw, qtype, COLS)
            for m, arithmetic in CASES:
                qmatmul.quant_matmul(torch.randn(m, COLS), fields, qtype, 128, COLS, arithmetic)
    return [r for r in found if r["name"] in ("_matvec_kernel", "_matmul_kernel")]


def main(out: Path) -> int:
    rows = []
    recs = records()
    for record, facts in zip(recs, compile_for_sm90(recs, also="sass"), strict=True):
        if facts["failure"]:
            print(f"{record['name']}: did not compile\n{facts['failure']}")
            return 1
        c, options = record["constexprs"], record["options"]
        threads = 32 * options["num_warps"]
        loop = facts["opcodes"]["loop"]
        per_weight = sum(loop.values()) * threads / (c["BN"] * 256)
        row = {
            "kernel": record["name"], "type": QT(c["QTYPE"]).name,
            "arithmetic": "bf16" if c.get("BF16") else "int8", "rows": c["BN"], "warps": options["num_warps"],
            "kernel_instructions": sum(facts["opcodes"]["kernel"].values()),
            "loop_instructions": sum(loop.values()), "loop_per_weight": round(per_weight, 2), "loop": loop,
        }  # fmt: skip
        rows.append(row)
        print(f"{row['kernel']} {row['type']} {row['arithmetic']}, {row['rows']} x {row['warps']} warps: "
              f"{row['kernel_instructions']} instructions, the unit loop {row['loop_instructions']} "
              f"= {per_weight:.2f} a weight")  # fmt: skip
        top = sorted(loop.items(), key=lambda kv: -kv[1])[:SHOWN]
        print("   " + ", ".join(f"{op} {n}" for op, n in top))
    out.write_text(json.dumps({**provenance(), "cols": COLS, "kernels": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "sm90_opcodes.json")))
