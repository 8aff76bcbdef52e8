"""Response generation for draft training, side by side on the GPU: transformers' `generate` (what the
trainer used through session 8) vs flashtree.train.batch_decode, on a random model of SmolLM2-135M's
shape in bf16, the trainer's batch size, greedy, token 0 the only stop (a random model seldom emits it,
so nearly every row runs max_new_tokens).

    python3 -m benchmarks.gpu_batch_decode [--batch 2048] [--prompt 96,160] [--new 128] [--out F.json]

Prints tokens/s of each and how many rows the two produce identically (bf16: kernels differ, so
greedy paths may part where two logits tie within rounding).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import transformers as tf

from flashtree.config import SamplingParams
from flashtree.train import batch_decode


def smollm2_shape() -> tf.LlamaConfig:
    return tf.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e5},
    )  # fmt: skip


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def hf_generate(model, prompts, new):
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device="cuda")
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                         pad_token_id=0, eos_token_id=[0])  # fmt: skip
    return [batch_decode.cut_at_stop(row, [0]) for row in out[:, width:].tolist()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--prompt", default="96,160", help="prompt lengths: min,max")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(smollm2_shape()).to("cuda", torch.bfloat16).eval()
    lo, hi = map(int, args.prompt.split(","))
    lengths = torch.randint(lo, hi + 1, (args.batch,)).sort().values.tolist()  # the trainer sorts too
    prompts = [torch.randint(1, 49152, (n,)).tolist() for n in lengths]
    greedy = SamplingParams()
    with torch.no_grad():
        batch_decode.decode_batch(model, prompts[:64], 8, [0], greedy)  # warm-up
        ours, ours_s = timed(lambda: batch_decode.decode_batch(model, prompts, args.new, [0], greedy))
        theirs, theirs_s = timed(lambda: hf_generate(model, prompts, args.new))
    rows = {}
    runs = (("flashtree batch_decode", ours, ours_s), ("transformers generate", theirs, theirs_s))
    for name, out, s in runs:
        n_tokens = sum(map(len, out))
        rows[name] = {"seconds": s, "tokens": n_tokens, "tok_s": n_tokens / s}
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    first_same = sum(a[:16] == b[:16] for a, b in zip(ours, theirs, strict=True))
    print(f"batch {args.batch}, prompts {lo}..{hi} tokens, {args.new} new tokens a row, bf16, greedy")
    for name, r in rows.items():
        print(f"  {name:24s} {r['seconds']:7.2f} s  {r['tok_s']:9.0f} tok/s")
    print(f"  speed-up {theirs_s / ours_s:.2f}x; rows identical {same}/{args.batch}, first 16: {first_same}")
    print(f"  peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    if args.out:
        result = {"args": vars(args), "device": torch.cuda.get_device_name(), "rows": rows,
                  "identical_rows": same, "identical_first16": first_same}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
