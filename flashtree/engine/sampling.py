"""Token selection, one function for every mode (AR, chain, tree, draft training eval).

Sampling uses Gumbel-max with noise that is a pure hash of (seed, sequence position, token id).
The token chosen for position p therefore depends only on the target's distribution there and
on (seed, p), never on how many random numbers were drawn before. Two consequences:
  * speculative decoding (chain or tree) emits exactly the tokens plain sampling would, for
    the same seed: each emitted token is the target's own sample given the accepted prefix;
  * it needs no host sync and no RNG state, so it can live inside a captured CUDA graph.
Since positions never repeat along one output sequence, the noise is fresh for every emitted
token, so the output is distributed exactly as the target's (temperature, top-k, top-p).
"""

from __future__ import annotations

import torch

from flashtree.config import SamplingParams

_M32 = 0xFFFFFFFF
SEED_MASK = (1 << 63) - 1  # seeds fit an int64 tensor


def _mul32(x: torch.Tensor | int, c: int) -> torch.Tensor | int:
    """(x * c) mod 2^32 for x in [0, 2^32) without int64 overflow (16-bit halves); tensors or ints."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor | int) -> torch.Tensor | int:
    """A 32-bit integer hash with good avalanche (the 'lowbias32' constants)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_noise(seed: int | torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """(N, vocab) uniforms in (0, 1), a deterministic function of (seed, position, token id). The seed
    (taken mod 2^63) is a Python int or a 0-d int64 device tensor (a CUDA graph's input); either way
    nothing is copied from the host."""
    device = positions.device
    seed = seed & SEED_MASK
    s = _mix32((seed & _M32) ^ _mix32((seed >> 32) & _M32))
    row = _mix32(s ^ _mix32(positions.long() & _M32))  # (N,)
    col = _mix32(torch.arange(vocab, dtype=torch.int64, device=device) + 0x9E3779B9)  # (V,)
    h = _mix32(row[:, None] ^ col[None, :])
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus); removed tokens get -inf. (N, V) fp32."""
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p (the top-1 always stays).
        drop_sorted = (probs.cumsum(-1) - probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The exact distribution `sample` draws from (one-hot argmax when greedy)."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return filter_logits(logits, params).softmax(-1)


def sample(
    logits: torch.Tensor, params: SamplingParams, positions: torch.Tensor, seed: torch.Tensor | None = None
) -> torch.Tensor:
    """One token per row. logits: (N, V); positions: (N,) sequence position each token will occupy;
    seed: a device tensor holding params.seed, for steps replayed from a CUDA graph."""
    if params.greedy:
        return logits.argmax(-1)
    u = uniform_noise(params.seed if seed is None else seed, positions, logits.shape[-1])
    gumbel = -torch.log(-torch.log(u))
    return (filter_logits(logits, params) + gumbel).argmax(-1)
