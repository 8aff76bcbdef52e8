"""The decode/verify attention's settings swept at the 27B's heads and SmolLM2's (kernels/attention.py:
MAX_SPLIT, the longest split; TILE_POSITIONS, the inner step; BF16_DOTS, the dots' operands of bf16
models; NUM_WARPS, for 256-dim heads; NUM_STAGES, the K/V tiles in flight; MAX_ROWS, SHORT_ROWS and
ROWS_FROM_KEYS, a verify's rows a program; WIDE_FROM_KEYS, the key positions from which a verify takes
VERIFY_QUERIES queries a program where that computes fewer).

    python -m benchmarks.gpu_attention OUT_DIR  -> OUT_DIR/attention.json; exit 1 when a value fails its check
    ATTN_SETTINGS='[{}, {"MAX_ROWS": 1}]' ATTN_HEADS=SmolLM2 ATTN_CONTEXTS=128,512 ATTN_SLOTS=8215 python ...
        other settings (a JSON list of changes, {} = the defaults), heads, contexts, and the cache's slots
        (default: the context + 1024; the default pair's engine holds 8215: SmolLM2's 8192 + a tree)

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

import itertools
import json
import os
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

HEADS = {"27B": (4, 24, 256, torch.bfloat16), "SmolLM2": (3, 9, 64, torch.float32)}  # KV heads, heads, dim
LAYERS = 16
CONTEXTS = tuple(int(c) for c in os.environ.get("ATTN_CONTEXTS", "512,2048,4096,8192,32768").split(","))
SLOTS = int(os.environ.get("ATTN_SLOTS", "0"))  # 0: context + 1024
SETTINGS = json.loads(  # each a change from the defaults
    os.environ.get(
        "ATTN_SETTINGS",  # by default: the verify's wider tile at every length (where it computes fewer
        '[{"WIDE_FROM_KEYS": 0}, {"WIDE_FROM_KEYS": 1099511627776}]',  # queries), and never
    )
)
if unknown := sorted({knob for change in SETTINGS for knob in change} - set(knobs.ATTENTION_KNOBS)):
    sys.exit(f"ATTN_SETTINGS: unknown settings {unknown} (known: {', '.join(knobs.ATTENTION_KNOBS)})")
TIMED_HEADS = os.environ.get("ATTN_HEADS", ",".join(HEADS)).split(",")
if unknown := sorted(set(TIMED_HEADS) - set(HEADS)):
    sys.exit(f"ATTN_HEADS: unknown heads {unknown} (known: {', '.join(HEADS)})")


def timings(heads: str, context: int, paths: torch.Tensor, depths: torch.Tensor) -> dict:
    """AR and verify 23 times per layer (us) at `context` cached tokens under the current settings."""
    n_kv, n_heads, hd, dtype = HEADS[heads]
    slots = SLOTS or context + 1024  # an engine's cache past the context: its split size follows the slots
    gen = torch.Generator().manual_seed(context)
    shape = (n_kv, slots, hd)
    caches = [[torch.randn(shape, generator=gen).to(DEVICE, dtype) for _ in range(2)] for _ in range(LAYERS)]
    q = torch.randn(len(TREE), n_heads, hd, generator=gen).to(DEVICE, dtype)
    start = torch.tensor(context, device=DEVICE)
    n_keys = context + 32  # the step's key bucket

    def verify(k, v, t=len(TREE)):
        return attention.tree_attention(q[:t], k, v, start, paths[:t, :t], depths[:t], n_keys, hd**-0.5)

    return {
        "heads": heads,
        "context": context,
        "split": attention.split_positions(slots),
        "ar_us": graph_time_us([lambda c=c: verify(*c, t=1) for c in caches]),
        "verify_23_us": graph_time_us([lambda c=c: verify(*c) for c in caches]),
    }


def main(out_dir: Path) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    layout = BlockLayout.from_parents(torch.tensor(TREE, device=DEVICE))
    paths, depths = layout.paths().to(torch.int32), layout.depths.to(torch.int32)
    default, rows = knobs.attention_settings(), []
    for change in SETTINGS:
        try:
            with knobs.attention_set(change) as setting:
                checks = check_attention()
                ok = all(c["ok"] and c["rows_bitwise"] for c in checks)
                row = {"setting": setting, "ok": ok, "checks": checks}
                times = itertools.product(TIMED_HEADS, CONTEXTS)
                row["times"] = [timings(h, c, paths, depths) for h, c in times]
        except triton.runtime.errors.OutOfResources as e:  # a setting the GPU cannot hold: not a failure
            print(f"{change}: {e}", flush=True)
            continue
        rows.append(row)
        err = max(c["max_abs_err"] for c in checks)
        print(f"{change or 'defaults'}: checks ok {ok} (err {err:.1e})", flush=True)
        for t in row.get("times", []):
            times = f"AR {t['ar_us']:6.1f} verify 23 {t['verify_23_us']:7.1f} us (split {t['split']})"
            print(f"  {t['heads']:>8} {t['context']:>6}: {times}", flush=True)
    heads = {name: [*shape[:3], str(shape[3])] for name, shape in HEADS.items()}
    result = {**provenance(), "device": str(DEVICE), "heads": heads, "layers": LAYERS,
              "default": default, "rows": rows}  # fmt: skip
    (out_dir / "attention.json").write_text(json.dumps(result, indent=2) + "\n")
    failures = [r for r in rows if not r["ok"]]
    print("FAILURES" if failures else "all ok", len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
