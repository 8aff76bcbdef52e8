"""The prefill attention kernel (kernels/prefill_attention.py) timed at the 27B's heads (24 query heads,
4 KV heads, 256 values, bf16) for a chunk at several starts, next to SDPA with a lower-right causal mask
(torch's flash kernel: a chunk's rows end at the last key) over the same keys, and checked against SDPA;
then the attention time of a whole 64K prompt's prefill on the 27B's 16 attention layers in the engine's
chunks, the share of the issue's 4000 tok/s budget (16.4 s for 65,536 tokens) attention takes. With
--kv-types, the same for K and V caches in each type (quant/kv.py), each checked against SDPA over the
values its cache holds (a tq3_0 cache's rotated: q rotated, the output rotated back, as the kernel does).

    python -m benchmarks.gpu_prefill OUT_DIR                     -> OUT_DIR/prefill.json
    python -m benchmarks.gpu_prefill OUT_DIR --tiles '[[64, 64, 8], [128, 32, 8]]' --stages 2,3 --chunk 4096
        tiles to sweep (query slots a program, key positions a step, warps) and pipeline depths
    python -m benchmarks.gpu_prefill OUT_DIR --kv-types bf16,q8_0,q4_0,tq3_0

A tile the GPU cannot hold (shared memory, registers) is reported and skipped. TFLOP/s count the causal
products only: 4 x heads x head_dim x (keys each row reads).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention.bias import causal_lower_right

from benchmarks.timing import graph_time_us
from flashtree.bench.run import provenance
from flashtree.kernels import prefill_attention as pa
from flashtree.quant.kv import KV_TYPES, KVPlane, check_kv_type, dequantize, quantize, rotate, unrotate

N_HEADS, N_KV, HD, DTYPE = 24, 4, 256, torch.bfloat16
LAYERS, PROMPT = 16, 65536  # the 27B's attention layers; the prefill target length
DEVICE = torch.device("cuda")


def options(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_prefill", description=__doc__.split("\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument(
        "--tiles", type=json.loads, default=[list(pa.TILES[256])], help="JSON [[QB, BLOCK, warps]]"
    )
    p.add_argument("--stages", default=str(pa.NUM_STAGES), help="pipeline depths, comma-separated")
    p.add_argument("--chunk", type=int, default=4096, help="tokens per prefill chunk (%(default)s)")
    p.add_argument(
        "--kv-types", default="bf16", help=f"K and V cache types, comma-separated, of {', '.join(KV_TYPES)}"
    )
    args = p.parse_args(argv)
    args.tiles = [tuple(t) for t in args.tiles]
    args.stages = [int(s) for s in args.stages.split(",")]
    args.kv_types = [check_kv_type(kind, HD) for kind in args.kv_types.split(",")]
    return args


def case(start: int, t: int, kind: str) -> tuple[torch.Tensor, KVPlane, KVPlane]:
    """A chunk's queries and its K and V caches in type `kind`."""
    gen = torch.Generator(device=DEVICE).manual_seed(start)
    q = torch.randn(t, N_HEADS, HD, generator=gen, device=DEVICE).to(DTYPE)
    k, v = (torch.randn(N_KV, start + t, HD, generator=gen, device=DEVICE).to(DTYPE) for _ in range(2))
    return q, quantize(k, kind), quantize(v, kind)


def reference_inputs(q: torch.Tensor, k: KVPlane, v: KVPlane) -> tuple[torch.Tensor, ...]:
    """(q, K, V) of SDPA's attention over the values the caches hold, in bf16 (the kernel's dot operands):
    for a tq3_0 K, q rotated as the kernel rotates it (a tq3_0 V's output is rotated back after)."""
    q = rotate(q).to(DTYPE) if k.kind == "tq3_0" else q
    return q, dequantize(k).to(DTYPE), dequantize(v).to(DTYPE)


def sdpa(q, k, v, start: int) -> torch.Tensor:
    """SDPA's causal attention of the chunk's rows over keys 0 .. start + T - 1 (lower-right aligned)."""
    t = q.shape[0]
    mask = causal_lower_right(t, start + t)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask, scale=HD**-0.5, enable_gqa=True
    )
    return out[0].transpose(0, 1)


def tflops(start: int, t: int, us: float) -> float:
    keys = t * start + t * (t + 1) // 2  # every row's keys
    return 4 * N_HEADS * HD * keys / (us * 1e-6) / 1e12


def measure(start: int, t: int, tile: tuple[int, int, int], stages: int, kind: str) -> dict:
    """The kernel's time (us) at this chunk with `tile` and `stages` over caches of type `kind`, SDPA's
    (over bf16 K and V of the same values), and the kernel's max error."""
    q, k, v = case(start, t, kind)
    ref_q, ref_k, ref_v = reference_inputs(q, k, v)

    def ours() -> torch.Tensor:
        return pa.prefill_attention(q, k, v, start, HD**-0.5, tile=tile, stages=stages)

    want = sdpa(ref_q, ref_k, ref_v, start)
    if v.kind == "tq3_0":
        want = unrotate(want)
    err = (ours().float() - want.float()).abs().max().item()
    row = {"start": start, "tokens": t, "max_abs_err": err}
    row["us"] = graph_time_us([ours], reps=5)
    row["sdpa_us"] = graph_time_us([lambda: sdpa(ref_q, ref_k, ref_v, start)], reps=5)
    row["tflops"], row["sdpa_tflops"] = tflops(start, t, row["us"]), tflops(start, t, row["sdpa_us"])
    return row


def prompt_seconds(by_start: dict[int, float], chunk: int) -> float:
    """The 64K prompt's attention (all layers, every chunk) from the timed starts, each chunk's time
    interpolated linearly in its start (a chunk's work grows linearly with it)."""
    starts = sorted(by_start)
    total = 0.0
    for s in range(0, PROMPT, chunk):
        hi = next((b for b in starts if b >= s), starts[-1])
        lo = max((b for b in starts if b <= s), default=starts[0])
        w = 0.0 if hi == lo else (s - lo) / (hi - lo)
        total += (1 - w) * by_start[lo] + w * by_start[hi]
    return LAYERS * total * 1e-6


def main(args: argparse.Namespace) -> int:
    out_dir, chunk = args.out_dir, args.chunk
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for kind, tiles, stages in itertools.product(args.kv_types, args.tiles, args.stages):
        name = f"{kind} tiles {tiles} stages {stages}"
        try:
            times = [measure(s, chunk, tiles, stages, kind) for s in (0, 8192, 32768, PROMPT - chunk)]
        except triton.runtime.errors.OutOfResources as e:
            print(f"{name}: {e}", flush=True)
            continue
        seconds = prompt_seconds({r["start"]: r["us"] for r in times}, chunk)
        ok = all(r["max_abs_err"] < 2e-2 for r in times)
        row = {"kv_type": kind, "tiles": tiles, "stages": stages, "ok": ok, "times": times}
        rows.append(row | {"prompt_64k_s": seconds})
        print(f"{name}: 64K prompt attention {seconds:.2f} s, ok {ok}", flush=True)
        for r in times:
            sdpa_time = f"SDPA {r['sdpa_us']:9.0f} us {r['sdpa_tflops']:5.0f}"
            ours = f"{r['us']:9.0f} us {r['tflops']:5.0f} TFLOP/s"
            print(f"  start {r['start']:>6}: {ours} ({sdpa_time}), err {r['max_abs_err']:.1e}", flush=True)
    sdpa_s = prompt_seconds({r["start"]: r["sdpa_us"] for r in rows[0]["times"]}, chunk) if rows else None
    shape = {"heads": [N_HEADS, N_KV, HD], "chunk": chunk, "layers": LAYERS, "prompt": PROMPT}
    result = {**provenance(), "device": torch.cuda.get_device_name(), **shape, "sdpa_prompt_64k_s": sdpa_s}
    result["rows"] = rows
    (out_dir / "prefill.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0 if rows and all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(options()))
