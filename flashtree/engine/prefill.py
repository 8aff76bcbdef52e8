"""How a prompt is prefilled: in chunks, each a committing forward, of a size chosen from the prompt's
length and the free memory (`prefill_chunk`), the one rule the engine and bench-step follow.

A chunk's forward holds its tokens' activations, and on the torch path (the CPU) its attention's mask
and scores over every key so far, chunk x prompt of them per head: so the chunk shrinks as the prompt
grows, and a 256K prompt never needs a 256K x 256K anything. On CUDA the prefill attention kernel holds
no scores (kernels/prefill_attention.py), and longer chunks read the weights and the cache fewer times.
"""

from __future__ import annotations

MAX_CHUNK = {"cpu": 256, "cuda": 4096}  # tokens a chunk takes at most, by device type
MIN_CHUNK = 16
# A token's activations in a chunk's forward, in fp32 values of the model's widest layer (hidden or FFN), by
# device type: on the torch path (CPU) an upper bound over the families here (the MLP's gate, up and
# product, the DeltaNet's fp32 copies); on CUDA the 27B's measured growth with a margin, since a looser
# bound shortens chunks at long context, where each costs a pass over the weights
# (bench/results/h100-long-rows-2026-12-08).
ACTIVATION_WIDTHS = {"cpu": 16, "cuda": 6}
FREE_SHARE = 2  # a chunk may take 1 / FREE_SHARE of the free memory


def prefill_chunk(config, n_prompt: int, free: int, device_type: str, fixed: int | None = None) -> int:
    """Tokens per prefill chunk for a prompt of `n_prompt` tokens with `free` bytes free on a device of
    `device_type`: `fixed` (Settings.prefill_chunk) when set; else the largest power of two up to
    MAX_CHUNK whose activations (and, off CUDA, attention mask and fp32 scores over the whole prompt)
    take at most 1 / FREE_SHARE of `free`, at least MIN_CHUNK, and no longer than the prompt."""
    if fixed:
        return fixed
    per_token = activation_bytes(config, device_type)
    if device_type != "cuda":  # the torch path: a bool mask and fp32 scores per head over every key
        per_token += (1 + 4 * config.n_heads) * n_prompt
    fits = max(free // FREE_SHARE // per_token, 1)
    chunk = min(MAX_CHUNK.get(device_type, MAX_CHUNK["cuda"]), 1 << (fits.bit_length() - 1))
    return max(1, min(max(chunk, MIN_CHUNK), n_prompt))


def activation_bytes(config, device_type: str) -> int:
    """A prefill token's activations in a chunk's forward on a device of `device_type` (ACTIVATION_WIDTHS)."""
    widths = ACTIVATION_WIDTHS.get(device_type, ACTIVATION_WIDTHS["cuda"])
    return widths * 4 * max(config.hidden, config.ffn)
