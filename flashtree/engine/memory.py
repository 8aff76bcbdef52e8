"""Memory budget: how many context tokens fit, decided before anything is allocated."""

from __future__ import annotations

import torch

from flashtree.config import DEFAULT_CONTEXT_CAP, check_max_ctx
from flashtree.errors import FlashtreeError

USABLE = 0.9  # leave room for activations and the allocator's slack


def free_bytes(device: torch.device) -> int:
    """Free memory on `device`: the GPU's (within a cap set by torch.cuda.set_per_process_memory_fraction,
    which a run that emulates a smaller card sets), or the host's MemAvailable for the CPU."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        index = torch.cuda.current_device() if device.index is None else device.index
        cap = int(torch.cuda.get_per_process_memory_fraction(index) * total)
        return max(0, min(free, cap - torch.cuda.memory_reserved(device)))
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62  # unknown: do not limit


def use_expandable_segments(on: bool) -> None:
    """Let the CUDA allocator grow segments in place: the default one keeps cached blocks of other sizes,
    which put a 262K-token run 1.06 GiB over its plan (bench/results/h100-long-context-2026-12-06)."""
    if on:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")


def check_free(need: int, device: torch.device, what: str, hint: str) -> None:
    """A FlashtreeError unless `need` bytes fit in the usable free memory of `device`."""
    budget = USABLE * free_bytes(device)
    if need > budget:
        free = f"{budget / 2**30:.2f} GiB is free on {device}"
        raise FlashtreeError(f"{what} needs {need / 2**30:.2f} GiB but only {free}; {hint}")


def plan_context(model, requested: int | None, extra_tokens: int = 0, verify_tokens: int = 0) -> int:
    """The context length to allocate: `requested` (an error if it is out of range or its state does not
    fit), or the model's own context length capped at DEFAULT_CONTEXT_CAP and shrunk to what fits in
    free memory: a context length read from a file never sizes the cache by itself. extra_tokens: spare
    slots past the context; verify_tokens: the largest speculative verify block, whose pending recurrent
    state (model.pending_bytes) is allocated at the first verify and must fit too."""
    limit = model.config.context_length
    if requested is not None:
        check_max_ctx(requested)
        if requested > limit:
            raise FlashtreeError(f"--max-ctx {requested} exceeds the model's context length of {limit}")
    per_token = model.state_bytes(1) - model.state_bytes(0)
    pending = model.pending_bytes(verify_tokens) if verify_tokens else 0
    fixed = model.state_bytes(0) + per_token * extra_tokens + pending
    verify_note = f" (of which {pending / 2**30:.2f} GiB the verify's pending state)" if pending else ""
    if requested is not None:
        what = f"a {requested}-token context's cache and state{verify_note}"
        check_free(fixed + per_token * requested, model.device, what, "lower --max-ctx")
        return requested
    budget = USABLE * free_bytes(model.device)
    default = min(limit, DEFAULT_CONTEXT_CAP)
    fits = int((budget - fixed) // per_token) if per_token else default
    if fits < 1:
        raise FlashtreeError(
            f"no room for any context on {model.device}: {budget / 2**30:.2f} GiB free, "
            f"{fixed / 2**30:.2f} GiB of fixed state{verify_note}"
        )
    return min(default, fits)
