"""The decode attention kernel's sm_90 SASS a cache value, by KV type (kernels/attention.py, kv_tiles.py).

    python -m benchmarks.sm90_attention_opcodes OUT.json [TRITON_DIR]

At long contexts the AR step's attention over a quantized cache runs far below the bytes it reads (the 27B
at 64K cached tokens: tq3_0 slower than bf16 with 4.6x fewer bytes, bench/results/h100-device-2026-12-07),
so what the loop over the cache issues per value it dequantizes is the number to cut. `tree_attention` is
recorded under Triton's interpreter at the 27B's heads (24 query heads of 256, 4 KV heads) over a cache
of each type (K and V alike), for the AR step (1 row) and a 23-node verify (in the tile of a short
context and in the wider one of a long context), with the bf16 dots a CUDA bf16 model takes, compiled for
sm_90 (flashtree/kernels/sm90.py; TRITON_DIR: under the Triton installed there), and its loop over committed
tiles (one 64-position tile of K and V; the loop whose K/V loads are cp.async copies, not the kernel's
longest: that can be the rows' own tiles or the combine) counted by benchmarks/sm90_opcodes.py's KINDS:
instructions x threads / (64 positions x 256 values x 2) a value.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # record the launches on the CPU; sm90.py compiles without it

import torch  # noqa: E402

from benchmarks import sm90_opcodes  # noqa: E402
from flashtree.kernels import attention  # noqa: E402
from flashtree.kernels.attention import tree_attention  # noqa: E402
from flashtree.kernels.sm90 import compile_for_sm90, recording  # noqa: E402
from flashtree.quant.kv import quantize  # noqa: E402

SLOTS, HEAD_DIM, KV_HEADS, GROUP = 1024, 256, 4, 6  # the 27B's heads; the loop is the same at any length
KV_TYPES = ("bf16", "q8_0", "q4_0", "tq3_0")
ROWS = (1, 23)  # the AR step, the verify of the default budget
LONG_KEYS = attention.UNPACKED_FROM_KEYS  # ... and that verify's tile from this many keys
UNPACKED = attention.UNPACKED_TYPES


def records() -> list[tuple[str, int, dict]]:
    """(KV type, rows, launch) of `tree_attention` over each type's cache: the AR step, the verify in the
    tile it takes at SLOTS keys and in the one it takes at LONG_KEYS (`row_group`)."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for kind in KV_TYPES:
        k, v = (torch.randn(KV_HEADS, SLOTS, HEAD_DIM, generator=gen) for _ in range(2))
        k, v = (x.bfloat16() if kind == "bf16" else quantize(x, kind) for x in (k, v))
        for t in ROWS:
            q = torch.randn(t, KV_HEADS * GROUP, HEAD_DIM, generator=gen).bfloat16()
            path = torch.tril(torch.ones(t, t, dtype=torch.int32))
            depths = torch.arange(t, dtype=torch.int32)
            start, scale = torch.tensor(SLOTS - t), HEAD_DIM**-0.5
            tiles = [None] if t == 1 else [None, attention.row_group(GROUP, t, LONG_KEYS, kind in UNPACKED)]
            for tile in tiles:
                with recording() as found:
                    tree_attention(q, k, v, start, path, depths, SLOTS, scale, tile=tile, dots="bf16")
                out += [(kind, t, r) for r in found if r["name"] == "_split_kernel"]
    return out


def main(out: Path) -> int:
    typed = records()
    compiled = compile_for_sm90([r for *_, r in typed], also="registers,sass")
    rows = []
    for (kind, t, record), facts in zip(typed, compiled, strict=True):
        if facts["failure"]:
            print(f"{record['name']} {kind}: did not compile\n{facts['failure']}")
            return 1
        c, warps = record["constexprs"], record["options"]["num_warps"]
        values = c["BLOCK"] * c["HD"] * 2 / (32 * warps)  # a tile's K and V values per thread
        row = {"kv_type": kind, "rows": t, "program_rows": c["R"], "queries": c["QB"], "warps": warps,
               **sm90_opcodes.loop_facts(facts, values, "pipelined_loop")}  # fmt: skip
        rows.append(row)
        label = f"{kind}, {t} rows ({c['R']} a program, {c['QB']} queries), {warps} warps"
        sm90_opcodes.print_row(label, row, per="value")
    sm90_opcodes.save(out, compiled, rows, slots=SLOTS, head_dim=HEAD_DIM)
    return 0


if __name__ == "__main__":
    sm90_opcodes.run(main, "sm90_attention_opcodes.json")
