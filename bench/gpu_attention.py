"""The decode/verify attention's settings swept at the 27B's heads (kernels/attention.py: MAX_SPLIT, the
longest split; TILE_VALUES, the inner tile; BF16_DOTS, the dots' operands; NUM_WARPS; NUM_STAGES).

    python bench/gpu_attention.py OUT_DIR    -> OUT_DIR/attention.json; exit 1 when a value fails its check

Why: at 32K cached tokens the AR step's attention ran at 1.15 TB/s (116 us a layer for its 134 MB of K/V)
and the verify 23's at 983 us a layer (bench/results/h100-attention-tiles-2026-12-05). A split is one
program's serial walk over its positions (16 at a time for 256-dim heads), and the program that finishes
a row's splits last combines them in rounds of L2 loads: the longest split sets how long those walks are,
how many programs share the GPU and how many partial outputs the combine adds (128 at 32K now). A value
holds for the AR step and every verify alike (the split size follows the cache only), so rows keep
agreeing bit for bit whatever it is, but it changes the outputs' last bits, so each value is checked on
its own: gpu_small_kernels.check_attention (verify rows = the AR step, bit for bit; SDPA within
rounding). The inner tile (TILE_VALUES / head_dim positions a step: 16 for the 27B's 256-dim heads) is
swept with it: at 32K cached tokens the verify 23's attention (964 us a layer) is ~20 TFLOP/s of its dots,
a serial walk of 16-position steps. Times per call from CUDA graphs of 16 calls (the 27B's 16 attention
layers), each on its own cache (16 layers at 32K: 4.3 GB, more than L2 holds), for the AR step (one row)
and a 23-node tree (a 16-token chain and 7 siblings), at 512, 8192 and 32768 cached tokens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton
from gpu_deltanet import TREE  # 23 nodes: a 16-token chain and 7 siblings
from gpu_kernels import graph_time_us  # bench/ is on sys.path as the script's dir
from gpu_small_kernels import DEVICE, check_attention

from flashtree.bench.run import provenance
from flashtree.kernels import attention
from flashtree.models.block import BlockLayout

N_KV, N_HEADS, HD = 4, 24, 256  # the 27B's attention heads
LAYERS = 16
CONTEXTS = (512, 8192, 32768)
KNOBS = ("MAX_SPLIT", "TILE_VALUES", "BF16_DOTS", "NUM_WARPS", "NUM_STAGES", "KEYS_FIRST")
SETTINGS = [  # each a change from the defaults
    {"BF16_DOTS": False},
    {},
    {"TILE_VALUES": 8192},
    {"TILE_VALUES": 16384, "NUM_STAGES": 2},
    {"TILE_VALUES": 8192, "BF16_DOTS": False},
    {"TILE_VALUES": 16384, "BF16_DOTS": False, "NUM_STAGES": 2},
    {"TILE_VALUES": 8192, "NUM_STAGES": 1},
    {"TILE_VALUES": 8192, "MAX_SPLIT": 256},
    {"KEYS_FIRST": True},
    {"KEYS_FIRST": True, "TILE_VALUES": 8192},
    {"KEYS_FIRST": True, "TILE_VALUES": 16384, "NUM_STAGES": 2},
    {"KEYS_FIRST": True, "TILE_VALUES": 16384, "NUM_WARPS": 4, "NUM_STAGES": 2},
    {"KEYS_FIRST": True, "TILE_VALUES": 8192, "NUM_WARPS": 4},
]


def timings(context: int, paths: torch.Tensor, depths: torch.Tensor) -> dict:
    """AR and verify 23 times per layer (us) at `context` cached tokens under the current settings."""
    slots = context + 1024  # an engine's cache past the context: its split size follows the slots
    gen = torch.Generator().manual_seed(context)
    caches = [
        [torch.randn(N_KV, slots, HD, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(2)]
        for _ in range(LAYERS)
    ]
    q = torch.randn(len(TREE), N_HEADS, HD, generator=gen).to(DEVICE, torch.bfloat16)
    start = torch.tensor(context, device=DEVICE)
    n_keys = context + 32  # the step's key bucket

    def verify(k, v, t=len(TREE)):
        return attention.tree_attention(q[:t], k, v, start, paths[:t, :t], depths[:t], n_keys, HD**-0.5)

    return {
        "context": context,
        "split": attention.split_positions(slots, HD),
        "ar_us": graph_time_us([lambda c=c: verify(*c, t=1) for c in caches]),
        "verify_23_us": graph_time_us([lambda c=c: verify(*c) for c in caches]),
    }


def main(out_dir: Path) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    layout = BlockLayout.from_parents(torch.tensor(TREE, device=DEVICE))
    paths, depths = layout.paths().to(torch.int32), layout.depths.to(torch.int32)
    default, rows = {knob: getattr(attention, knob) for knob in KNOBS}, []
    for change in SETTINGS if DEVICE.type == "cuda" else ({},):
        setting = {**default, **change}
        for knob, value in setting.items():
            setattr(attention, knob, value)
        try:
            checks = check_attention()
            ok = all(c["ok"] and c["rows_bitwise"] for c in checks)
            row = {"setting": setting, "ok": ok, "checks": checks}
            if DEVICE.type == "cuda":
                row["times"] = [timings(context, paths, depths) for context in CONTEXTS]
        except triton.runtime.errors.OutOfResources as e:  # a setting the GPU cannot hold: not a failure
            print(f"{change}: {e}", flush=True)
            continue
        rows.append(row)
        times = "  ".join(
            f"{t['context']}: AR {t['ar_us']:6.1f} verify 23 {t['verify_23_us']:7.1f} us (split {t['split']})"
            for t in row.get("times", [])
        )
        err = max(c["max_abs_err"] for c in checks)
        print(f"{change or 'defaults'}: checks ok {ok} (err {err:.1e})  {times}", flush=True)
    for knob, value in default.items():
        setattr(attention, knob, value)
    result = {**provenance(), "device": str(DEVICE), "heads": [N_KV, N_HEADS, HD], "layers": LAYERS,
              "default": default, "rows": rows}  # fmt: skip
    (out_dir / "attention.json").write_text(json.dumps(result, indent=2) + "\n")
    failures = [r for r in rows if not r["ok"]]
    print("FAILURES" if failures else "all ok", len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
