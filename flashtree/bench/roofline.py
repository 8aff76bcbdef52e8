"""Device ceilings, measured in the same run as the benchmark they put in context.

- copy bandwidth: a device-to-device tensor copy, counting the bytes read plus the bytes written;
- matmul rate: a square matmul in the engine's compute dtype (bf16 on a GPU, fp32 on a CPU, where
  the engine computes in fp32).
AR decoding reads every weight once per token, so copy bandwidth / weight bytes bounds AR tok/s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

# Big enough to leave the caches and amortize launches, small enough to be quick (CPU: a few 100 ms).
COPY_BYTES = {"cuda": 1 << 30, "cpu": 64 << 20}
MATMUL_N = {"cuda": 8192, "cpu": 1024}
REPEATS = {"cuda": 20, "cpu": 3}


@dataclass(frozen=True)
class Ceilings:
    device: str
    copy_bytes: int  # size of the copied tensor
    copy_gb_s: float  # (read + write) bytes / s / 1e9
    matmul_n: int
    matmul_dtype: str
    matmul_tflops: float

    def as_dict(self) -> dict:
        return asdict(self)

    def weight_read_tok_s(self, weight_bytes: int) -> float:
        """AR tok/s if each token cost exactly one read of the weights at copy bandwidth."""
        return self.copy_gb_s * 1e9 / weight_bytes


def measure_ceilings(
    device: torch.device | str,
    copy_bytes: int | None = None,
    matmul_n: int | None = None,
    repeats: int | None = None,
) -> Ceilings:
    device = torch.device(device)
    kind = "cuda" if device.type == "cuda" else "cpu"
    copy_bytes = copy_bytes or COPY_BYTES[kind]
    matmul_n = matmul_n or MATMUL_N[kind]
    repeats = repeats or REPEATS[kind]
    dtype = torch.bfloat16 if kind == "cuda" else torch.float32  # what large models compute in

    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    copy_s = best_time(lambda: dst.copy_(src), device, repeats)

    a = torch.randn(matmul_n, matmul_n, device=device).to(dtype)
    b = torch.randn(matmul_n, matmul_n, device=device).to(dtype)
    matmul_s = best_time(lambda: a @ b, device, repeats)
    return Ceilings(
        device=str(device),
        copy_bytes=copy_bytes,
        copy_gb_s=2 * copy_bytes / copy_s / 1e9,
        matmul_n=matmul_n,
        matmul_dtype=str(dtype).removeprefix("torch."),
        matmul_tflops=2 * matmul_n**3 / matmul_s / 1e12,
    )


def best_time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Fastest of `repeats` timed calls after one warm-up: a ceiling is the best the device can do."""
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's distinct tensors (a tied LM head shares the embedding's storage)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        key = (t.device, t.untyped_storage().data_ptr())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total
