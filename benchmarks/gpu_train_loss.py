"""Draft training's LM head + cross-entropy (forward and backward) on the GPU, three ways side by side at
the SmolLM2 runs' shapes (32,768 block tokens x 576, vocabulary 49,152, bf16):
- `autograd`: bf16 logits of all tokens, fp32 cross-entropy through autograd (the fourth run's loss);
- `chunked torch`: FrozenHeadCrossEntropy's torch path (fp32 chunks, gradient in the forward);
- `chunked kernel`: the same with kernels/cross_entropy.py (what CUDA runs).

    python3 -m benchmarks.gpu_train_loss [--tokens 32768] [--out F.json]

Prints the median ms of each and the kernel path's largest differences from the torch path.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

import torch
import torch.nn.functional as F

from benchmarks import knobs
from flashtree.bench.roofline import measure_ceilings
from flashtree.train.loss import FrozenHeadCrossEntropy


def median_ms(fn, n: int = 7) -> float:
    fn()
    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[n // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--out")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, hidden, vocab = args.tokens, 576, 49152
    weight = (torch.randn(vocab, hidden, device="cuda", generator=gen) / 24).bfloat16()
    h = torch.randn(n, hidden, device="cuda", generator=gen).bfloat16().requires_grad_(True)
    labels = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    w = torch.rand(n, device="cuda", generator=gen)
    w /= w.sum()

    def autograd():
        logits = h @ weight.t()
        ((F.cross_entropy(logits.float(), labels, reduction="none") * w).sum()).backward()

    def chunked(use_kernel: bool):
        with knobs.triton_kernels(use_kernel):
            loss, _ = FrozenHeadCrossEntropy.apply(h, weight, labels, w)
            loss.backward()
        return loss

    results = {"tokens": n, "hidden": hidden, "vocab": vocab, "ceilings": asdict(measure_ceilings("cuda"))}
    for name, fn in (
        ("autograd", autograd),
        ("chunked torch", lambda: chunked(False)),
        ("chunked kernel", lambda: chunked(True)),
    ):
        h.grad = None
        results[name + " ms"] = median_ms(fn)
        print(f"{name:16s} {results[name + ' ms']:8.2f} ms", flush=True)
    outputs = {}
    for use_kernel in (False, True):
        h.grad = None
        outputs[use_kernel] = chunked(use_kernel).item(), h.grad.float().clone()
    (want_loss, want_grad), (loss, grad) = outputs[False], outputs[True]
    results["loss relative diff"] = abs(loss - want_loss) / abs(want_loss)
    results["grad max abs diff"] = float((grad - want_grad).abs().max())
    results["grad max abs"] = float(want_grad.abs().max())
    print(json.dumps({k: v for k, v in results.items() if k != "ceilings"}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
