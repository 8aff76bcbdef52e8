"""Where the packed matmul kernels' instructions go, from their sm_90 SASS (no GPU needed).

    python -m benchmarks.sm90_opcodes OUT.json [TRITON_DIR]

The bf16 verify matmul is issue-bound (session 23's Nsight Compute: 5.6 instructions a weight), so what
its loop issues per weight is the number to cut. Each kernel is recorded under Triton's interpreter on a
matrix of every packed type (`TYPES` x `CASES`: the verify's 23 rows and 64 rows in bf16, the AR step's
one row in bf16 and int8, 23 rows in int8) at the default tiles, compiled for sm_90 as the JIT compiles
it (flashtree/kernels/sm90.py), and its SASS read: printed, the instructions of its longest loop (one
unit of 256 values a row) per weight (a unit's rows x 256 values over the program's threads), by kind
(`KINDS`) and by opcode (PRMT by selector), with the tile's registers, spills and shared memory.
TRITON_DIR: compile under the Triton installed there (`pip install --target TRITON_DIR triton==3.6.0`, the
device's), the launches still recorded under this environment's.
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
TYPES = (QT.Q4_K, QT.Q6_K, QT.Q5_K, QT.Q4_0, QT.Q4_1, QT.Q8_0)  # the 27B's Q4_K_M types first
CASES = [(23, "bf16"), (1, "bf16"), (64, "bf16"), (1, "int8"), (23, "int8")]
SHOWN = 24  # opcodes printed per kernel
# kind: opcodes (the first word of the SASS instruction); PRMT 0x5140 / 0x7362 are the bf16 decode's
# magic-number byte moves, every other PRMT selector a byte shuffle (ops not listed: "other")
KINDS = {
    "global load": ("LDG", "LDGSTS", "LDGDEPBAR", "DEPBAR"),
    "bit ops": ("LOP3", "SHF", "SGXT", "BMSK", "PRMT"),
    "decode": ("HFMA2", "HADD2", "HMUL2", "FMUL", "FFMA", "FADD", "F2FP", "I2F", "I2FP", "F2F", "IDP"),
    "shared memory": ("STS", "LDS", "BAR", "MEMBAR", "FENCE"),
    "tensor core": ("HGMMA", "HMMA", "IMMA", "LDSM", "WARPGROUP", "WARPSYNC"),
    "integer/address": (
        "IMAD", "IADD3", "LEA", "VIADD", "ISETP", "SEL", "MOV", "IABS", "IMNMX", "VIMNMX",
        "UIADD3", "ULEA", "UIMAD", "UMOV", "USHF", "ULOP3", "UISETP", "USEL", "R2UR", "S2UR", "UPRMT",
    ),
}  # fmt: skip
KIND_OF = {op: kind for kind, ops in KINDS.items() for op in ops}


def kind_counts(loop: dict[str, int]) -> dict[str, int]:
    """The loop's instructions per kind (opcodes as `sass_opcodes` keys them: PRMT with its selector)."""
    out = dict.fromkeys([*KINDS, "other"], 0)
    for op, n in loop.items():
        out[KIND_OF.get(op.split()[0], "other")] += n
    return out


def loop_facts(facts: dict, weights: float, which: str = "loop") -> dict:
    """A compiled kernel's resources and its unit loop's instructions, in all and per weight (`weights`:
    the weights a thread decodes in one unit); the unit loop is `sass_opcodes`' `which` (its longest
    loop, or "pipelined_loop": its longest with cp.async copies)."""
    loop = facts["opcodes"][which]
    return {
        **{k: facts[k] for k in ("registers", "spill_bytes", "shared_bytes")},
        "kernel_instructions": sum(facts["opcodes"]["kernel"].values()),
        "loop_instructions": sum(loop.values()), "loop_per_weight": round(sum(loop.values()) / weights, 2),
        "kinds_per_weight": {k: round(n / weights, 3) for k, n in kind_counts(loop).items()}, "loop": loop,
    }  # fmt: skip


def print_row(label: str, row: dict, per: str = "weight") -> None:
    """One kernel's lines: resources and loop length, the kinds per weight (or what `per` names: the value
    a thread handles), the commonest opcodes."""
    print(f"{label}: {row['registers']} registers, {row['spill_bytes']} B spilled, {row['shared_bytes']} B "
          f"shared; the unit loop {row['loop_instructions']} = {row['loop_per_weight']:.2f} a "
          f"{per}")  # fmt: skip
    print(f"   per {per}: " + ", ".join(f"{k} {v:.2f}" for k, v in row["kinds_per_weight"].items()))
    top = sorted(row["loop"].items(), key=lambda kv: -kv[1])[:SHOWN]
    print("   " + ", ".join(f"{op} {n}" for op, n in top))


def records() -> list[dict]:
    with recording() as found:
        for qtype in TYPES:
            raw = torch.from_numpy(random_blocks(qtype, 128, COLS, np.random.default_rng(0)))
            fields = qmatmul.repack(raw, qtype, COLS)
            for m, arithmetic in CASES:
                qmatmul.quant_matmul(torch.randn(m, COLS), fields, qtype, 128, COLS, arithmetic)
    return [r for r in found if r["name"] in ("_matvec_kernel", "_matmul_kernel")]


def main(out: Path) -> int:
    rows = []
    recs = records()
    compiled = compile_for_sm90(recs, also="registers,sass")
    for record, facts in zip(recs, compiled, strict=True):
        if facts["failure"]:
            print(f"{record['name']}: did not compile\n{facts['failure']}")
            return 1
        c, options = record["constexprs"], record["options"]
        weights = c["BN"] * 256 / (32 * options["num_warps"])  # a unit's weights per thread
        row = {
            "kernel": record["name"], "type": QT(c["QTYPE"]).name,
            "arithmetic": "bf16" if c.get("BF16") else "int8", "rows": c["BN"], "warps": options["num_warps"],
            "stages": options.get("num_stages"), **loop_facts(facts, weights),
        }  # fmt: skip
        rows.append(row)
        print_row(f"{row['kernel']} {row['type']} {row['arithmetic']}, {row['rows']} x {row['warps']} x "
                  f"{row['stages']}", row)  # fmt: skip
    save(out, compiled, rows, cols=COLS)
    return 0


def save(out: Path, compiled: list[dict], rows: list[dict], **about) -> None:
    """The report: provenance, the compiling Triton, `about` (the recorded launches' sizes), the rows."""
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {**provenance(), "triton": compiled[0]["triton"], **about, "kernels": rows}
    out.write_text(json.dumps(report, indent=1) + "\n")


def run(main, default_out: str) -> None:
    """`python -m SCRIPT [OUT.json] [TRITON_DIR]`: main(OUT), compiling under TRITON_DIR's Triton if given."""
    if len(sys.argv) > 2:  # compile under the Triton in this folder (pip install --target DIR triton==X)
        os.environ["PYTHONPATH"] = sys.argv[2]  # the child's only: this process recorded under its own
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else default_out)))


if __name__ == "__main__":
    run(main, "sm90_opcodes.json")
