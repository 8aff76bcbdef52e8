"""The Gluon bf16 kernel's sm_90 SASS a weight (kernels/gluon_qmm.py; Q4_K, Q6_K), next to the `tl` kernel's.

    python -m benchmarks.sm90_gluon_opcodes OUT.json [TRITON_DIR]

Both kernels compiled for sm_90 on this machine (flashtree/kernels/sm90.py; TRITON_DIR: under the Triton
installed there, e.g. the device's 3.6) at the same products (a 128 x 1024 Q4_K, then Q6_K matrix, M = 1, 8,
23, 32 rows of x, default tiles; the Gluon kernel's b16 also at 128 rows, as b32, and each also with its
wgmmas synchronous, ASYNC off), and their longest loop (one 256-value unit of every row of the tile) counted
by benchmarks/sm90_opcodes.py's KINDS: instructions x threads / (rows x 256) a weight.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from benchmarks import sm90_opcodes
from flashtree.kernels import gluon_qmm, qmatmul
from flashtree.kernels.sm90 import compile_for_sm90, launch_record, recording
from flashtree.kernels.tiles import DEFAULT_TILES, KernelConfig
from flashtree.quant.formats import QT
from flashtree.quant.pack import random_blocks

ROWS, COLS = 128, 1024
CHECK_M = (1, 8, 23, 32)
TYPES = (QT.Q4_K, QT.Q6_K)
B16_AT_128 = KernelConfig(tiles={**DEFAULT_TILES, "b16": DEFAULT_TILES["b32"]})  # one tile for M <= 32


def records() -> list[tuple[str, dict]]:
    """(type, launch) of each type's `tl` bf16 launches (recorded under the interpreter), then the Gluon
    kernel's."""
    out = []
    for qtype in TYPES:
        raw = torch.from_numpy(random_blocks(qtype, ROWS, COLS, np.random.default_rng(0)))
        fields = qmatmul.repack(raw, qtype, COLS)
        with recording() as found:
            for m in CHECK_M:
                qmatmul.quant_matmul(torch.randn(m, COLS), fields, qtype, ROWS, COLS, "bf16")
        out += [(qtype.name, r) for r in found if r["name"] == "_matmul_kernel"]
        frag = gluon_qmm.fragment_fields(fields, qtype)
        kernel = gluon_qmm._bf16_kernel
        gluon_records = []
        cases = [(m, qmatmul.DEFAULT_KERNELS, True) for m in CHECK_M] + [(8, B16_AT_128, True)]
        for m, kernels, async_mma in cases + [(23, qmatmul.DEFAULT_KERNELS, False), (8, B16_AT_128, False)]:
            x = torch.randn(m, COLS).bfloat16()
            _, args, kwargs, *_ = gluon_qmm.launch_args(x, frag, qtype, ROWS, COLS, kernels, async_mma)
            record = launch_record(kernel.fn, args, kwargs, tuple(kernel.do_not_specialize))
            if record not in gluon_records:
                gluon_records.append(record)
        out += [(qtype.name, r) for r in gluon_records]
    return out


def main(out: Path) -> int:
    typed = records()
    recs = [r for _, r in typed]
    compiled = compile_for_sm90(recs, also="registers,sass")
    rows = []
    for (type_, record), facts in zip(typed, compiled, strict=True):
        if facts["failure"]:
            print(f"{record['name']}: did not compile\n{facts['failure']}")
            return 1
        c = record["constexprs"]
        bn, bm = c["BN"], c.get("BM")
        weights = bn * 256 / (32 * record["options"]["num_warps"])
        row = {
            "kernel": record["name"], "type": type_, "async": c.get("ASYNC"), "rows": bn, "columns": bm,
            "warps": record["options"]["num_warps"], "stages": record["options"].get("num_stages"),
            **sm90_opcodes.loop_facts(facts, weights),
        }  # fmt: skip
        rows.append(row)
        mode = {True: " async", False: " sync"}.get(c.get("ASYNC"), "")
        sm90_opcodes.print_row(
            f"{row['kernel']}{mode} {type_} bf16 b{bm}, {bn} x {row['warps']} x {row['stages']}", row
        )
    sm90_opcodes.save(out, compiled, rows, cols=COLS)
    return 0


if __name__ == "__main__":
    sm90_opcodes.run(main, "sm90_gluon_opcodes.json")
