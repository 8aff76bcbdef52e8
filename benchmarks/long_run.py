"""A real run at a long context (GPU): an engine of --max-ctx tokens prefills a prompt that fills it
(random token ids: the 27B is random too) and decodes at least --steps tree steps; the peak GPU memory
(`torch.cuda.max_memory_reserved`, the load included) is written next to `flashtree plan`'s total for the
same options, as JSON. The draft's matrices are fp8 when FLASHTREE_DRAFT_FP8=matrices (plan: --draft-dtype).

    python3 -m benchmarks.long_run --target Q27 --draft DRAFT --max-ctx 262144 --kv-type tq3_0 --out F.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from flashtree.config import EngineConfig
from flashtree.engine.generate import Engine, GenerationStats
from flashtree.engine.memory import use_expandable_segments
from flashtree.settings import current


def planned(args: argparse.Namespace, draft_dtype: str) -> dict:
    """`flashtree plan --json` for the run's options."""
    cmd = [sys.executable, "-m", "flashtree", "plan", "--target", args.target, "--draft", args.draft,
           "--max-ctx", str(args.max_ctx), "--kv-type", args.kv_type, "--draft-dtype", draft_dtype,
           "--gpu-memory", str(args.gpu_memory), "--json"]  # fmt: skip
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


class PrefillProgress:
    """An `on_prefill` callback keeping the engine's chunk and about `points` (tokens done, seconds) pairs
    along the prompt, the device synchronized at each: where a long prefill slows down."""

    def __init__(self, n_prompt: int, device: torch.device, points: int = 32):
        self.every, self.device, self.t0 = max(1, n_prompt // points), device, time.perf_counter()
        self.chunk: int | None = None
        self.points: list[tuple[int, float]] = [(0, 0.0)]

    def __call__(self, done: int, total: int) -> None:
        self.chunk = self.chunk or done
        if done == total or done // self.every > self.points[-1][0] // self.every:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.points.append((done, round(time.perf_counter() - self.t0, 3)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--max-ctx", type=int, default=262144)
    parser.add_argument("--kv-type", default="tq3_0")
    parser.add_argument("--steps", type=int, default=16, help="tree steps after the prefill, at least")
    parser.add_argument(
        "--gpu-memory", type=float, default=22.0, help="GiB the run may take: a smaller card's budget"
    )
    parser.add_argument(
        "--prompt-tokens", type=int, default=0, help="prompt length (0: fill the context but the steps)"
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    draft_dtype = "fp8" if current().draft_fp8 == "matrices" else "bf16"
    plan = planned(args, draft_dtype)
    use_expandable_segments(current().expandable_segments)  # before the allocator's first use
    # the allocator fails past the budget, and the prefill chunk rule sees only the budget's free memory
    torch.cuda.set_per_process_memory_fraction(args.gpu_memory * 2**30 / torch.cuda.mem_get_info()[1])
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    config = EngineConfig(target=args.target, draft=args.draft, mode="tree", max_ctx=args.max_ctx,
                          device="cuda", kv_type_k=args.kv_type, kv_type_v=args.kv_type)  # fmt: skip
    engine = Engine.from_config(config)
    load_s, loaded = time.perf_counter() - t0, torch.cuda.max_memory_reserved()
    print(f"loaded in {load_s:.0f} s, peak {loaded / 2**30:.2f} GiB reserved", flush=True)
    # Room for the steps: each emits at most a block (random weights accept about one token a step).
    new = args.steps * (engine.decoder.max_block + 1)
    generator = torch.Generator().manual_seed(0)
    vocab = engine.target.config.vocab
    n_prompt = min(args.prompt_tokens or engine.max_ctx, engine.max_ctx - new)
    prompt = torch.randint(0, vocab, (n_prompt,), generator=generator).tolist()
    stats = GenerationStats("tree")
    progress = PrefillProgress(len(prompt), engine.device)
    for _ in engine.generate(prompt, max_tokens=new, stop_ids=[], stats=stats, on_prefill=progress):
        if stats.steps >= args.steps:
            break
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_reserved()
    result = {
        "command": " ".join(sys.argv), "device": torch.cuda.get_device_name(), "kv_type": args.kv_type,
        "draft_dtype": draft_dtype, "expandable_segments": current().expandable_segments,
        "gpu_memory_gib": args.gpu_memory, "max_ctx": engine.max_ctx,
        "prompt_tokens": len(prompt),
        "tree_steps": stats.steps, "generated": stats.n_generated, "load_s": load_s,
        "prefill_s": stats.prefill_s, "prefill_tok_s": len(prompt) / stats.prefill_s,
        "prefill_chunk": progress.chunk, "prefill_progress": progress.points,
        "decode_s": stats.decode_s, "peak_after_load_bytes": loaded, "peak_reserved_bytes": peak,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(), "plan": plan,
        "peak_over_plan": peak / plan["total_bytes"],
    }  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    gib = 2**30
    print(f"peak {peak / gib:.2f} GiB reserved vs plan {plan['total_bytes'] / gib:.2f} GiB "
          f"({result['peak_over_plan']:.3f}); prefill {result['prefill_tok_s']:.0f} tok/s in chunks of "
          f"{progress.chunk}, "
          f"{stats.steps} steps")  # fmt: skip


if __name__ == "__main__":
    main()
