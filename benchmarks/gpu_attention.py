"""The decode/verify attention's settings swept at the 27B's heads and SmolLM2's (kernels/attention.py:
MAX_SPLIT, the longest split; TILE_POSITIONS, the inner step; BF16_DOTS, the dots' operands of bf16
models; NUM_WARPS, for 256-dim heads; NUM_STAGES, the K/V tiles in flight; MAX_ROWS, SHORT_ROWS and
ROWS_FROM_KEYS, a verify's rows a program; WIDE_FROM_KEYS, the key positions from which a verify takes
VERIFY_QUERIES queries a program where that computes fewer; UNPACKED_FROM_KEYS and UNPACKED_QUERIES, the
same over a q4_0 / tq3_0 cache where that takes fewer programs, each a read and unpack of the cache;
COMBINE_SLOTS, the splits' partial outputs the combine loads at once).

    python -m benchmarks.gpu_attention OUT_DIR  -> OUT_DIR/attention.json; exit 1 when a value fails its check
    python -m benchmarks.gpu_attention OUT_DIR --settings '[{}, {"MAX_ROWS": 1}]' --heads SmolLM2
        --contexts 128,512 --slots 8215 --kv-types bf16,tq3_0
        other settings (a JSON list of changes, {} = the defaults), heads, contexts, the cache's slots
        (default: the context + 1024; the default pair's engine holds 8215: SmolLM2's 8192 + a tree) and
        KV types (default: the heads' own dtype; a quantized type is read in the kernel, as the engine does)

Why: a split is one program's serial walk over its positions, one tile a step, and the program that
finishes a row's splits last combines them in rounds of L2 loads: the settings decide how long those
walks are, what each step costs, how many programs an SM holds and how many partial outputs the combine
adds. A setting holds for the AR step and every verify alike, so rows keep agreeing bit for bit whatever
it is, but it changes the outputs' last bits, so each is checked on its own: benchmarks/checks.py's
check_attention (verify rows = the AR step, bit for bit; SDPA within rounding; at the defaults:
tests/gpu/test_attention_gpu.py). The settings are set through benchmarks/knobs.py. Times per call from CUDA
graphs of 16 calls (16 attention layers), each on its own cache (the 27B's at 32K: 4.3 GB, more than L2
holds), for the AR step (one row) and a 23-node tree (a 16-token chain and 7 siblings), at 512, 8192 and
32768 cached tokens; the 27B's heads in bf16, SmolLM2's in fp32 (as the engine runs each). A setting
the GPU cannot hold (shared memory) is reported and skipped.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton

from benchmarks import knobs
from benchmarks.checks import DEVICE, check_attention
from benchmarks.gpu_deltanet import TREE  # 23 nodes: a 16-token chain and 7 siblings
from benchmarks.timing import graph_time_us
from flashtree.bench.run import provenance
from flashtree.kernels import attention
from flashtree.models.block import BlockLayout
from flashtree.quant.kv import KV_TYPES, KVPlane, quantize

HEADS = {"27B": (4, 24, 256, torch.bfloat16), "SmolLM2": (3, 9, 64, torch.float32)}  # KV heads, heads, dim
LAYERS = 16
# by default: the verify's wider tile at every length (where it computes fewer queries), and never
DEFAULT_SETTINGS = '[{"WIDE_FROM_KEYS": 0}, {"WIDE_FROM_KEYS": 1099511627776}]'


def options(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_attention", description=__doc__.split("\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--settings", type=json.loads, default=DEFAULT_SETTINGS, help="JSON list of changes")
    p.add_argument("--heads", default=",".join(HEADS), help="heads timed (%(default)s)")
    p.add_argument("--contexts", default="512,2048,4096,8192,32768", help="cached tokens (%(default)s)")
    p.add_argument("--slots", type=int, default=0, help="the cache's slots (0: the context + 1024)")
    p.add_argument("--kv-types", default="bf16", help="KV cache types timed (%(default)s: the heads' dtype)")
    args = p.parse_args(argv)
    if unknown := sorted({knob for change in args.settings for knob in change} - set(knobs.ATTENTION_KNOBS)):
        p.error(f"--settings: unknown settings {unknown} (known: {', '.join(knobs.ATTENTION_KNOBS)})")
    args.heads = args.heads.split(",")
    if unknown := sorted(set(args.heads) - set(HEADS)):
        p.error(f"--heads: unknown heads {unknown} (known: {', '.join(HEADS)})")
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.kv_types = args.kv_types.split(",")
    if unknown := sorted(set(args.kv_types) - set(KV_TYPES)):
        p.error(f"--kv-types: unknown types {unknown} (known: {', '.join(KV_TYPES)})")
    return args


def timings(
    heads: str, kv_type: str, context: int, slots: int, paths: torch.Tensor, depths: torch.Tensor
) -> dict:
    """AR and verify 23 times per layer (us) at `context` cached tokens of `kv_type` (bf16: the heads'
    own dtype) under the current settings."""
    n_kv, n_heads, hd, dtype = HEADS[heads]
    slots = slots or context + 1024  # an engine's cache past the context: its split size follows the slots
    gen = torch.Generator().manual_seed(context)
    shape = (n_kv, slots, hd)

    def cache() -> torch.Tensor | KVPlane:
        x = torch.randn(shape, generator=gen).to(DEVICE, dtype)
        return x if kv_type == "bf16" else quantize(x, kv_type)

    caches = [[cache() for _ in range(2)] for _ in range(LAYERS)]
    q = torch.randn(len(TREE), n_heads, hd, generator=gen).to(DEVICE, dtype)
    start = torch.tensor(context, device=DEVICE)
    n_keys = context + 32  # the step's key bucket

    def verify(k, v, t=len(TREE)):
        return attention.tree_attention(q[:t], k, v, start, paths[:t, :t], depths[:t], n_keys, hd**-0.5)

    return {
        "heads": heads,
        "kv_type": kv_type,
        "context": context,
        "split": attention.split_positions(slots),
        "ar_us": graph_time_us([lambda c=c: verify(*c, t=1) for c in caches]),
        "verify_23_us": graph_time_us([lambda c=c: verify(*c) for c in caches]),
    }


def main(args: argparse.Namespace) -> int:
    out_dir = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    layout = BlockLayout.from_parents(torch.tensor(TREE, device=DEVICE))
    paths, depths = layout.paths().to(torch.int32), layout.depths.to(torch.int32)
    default, rows = knobs.attention_settings(), []
    for change in args.settings:
        try:
            with knobs.attention_set(change) as setting:
                checks = check_attention()
                ok = all(c["ok"] and c["rows_bitwise"] for c in checks)
                row = {"setting": setting, "ok": ok, "checks": checks}
                times = itertools.product(args.heads, args.kv_types, args.contexts)
                row["times"] = [timings(h, kv, c, args.slots, paths, depths) for h, kv, c in times]
        except triton.runtime.errors.OutOfResources as e:  # a setting the GPU cannot hold: not a failure
            print(f"{change}: {e}", flush=True)
            continue
        rows.append(row)
        err = max(c["max_abs_err"] for c in checks)
        print(f"{change or 'defaults'}: checks ok {ok} (err {err:.1e})", flush=True)
        for t in row.get("times", []):
            times = f"AR {t['ar_us']:6.1f} verify 23 {t['verify_23_us']:7.1f} us (split {t['split']})"
            print(f"  {t['heads']:>8} {t['kv_type']:>6} {t['context']:>6}: {times}", flush=True)
    heads = {name: [*shape[:3], str(shape[3])] for name, shape in HEADS.items()}
    result = {**provenance(), "device": str(DEVICE), "heads": heads, "layers": LAYERS,
              "default": default, "rows": rows}  # fmt: skip
    (out_dir / "attention.json").write_text(json.dumps(result, indent=2) + "\n")
    failures = [r for r in rows if not r["ok"]]
    print("FAILURES" if failures else "all ok", len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(options()))
