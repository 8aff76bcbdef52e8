"""Programmatic dependent launch (PDL, compute capability 9.0+) for the decode-path kernels.

A decode step is hundreds of small launches (a 27B AR step 1294, the default pair's tree step 530:
bench/results/h200-combine-2026-12-04), each paying a launch and a ramp before it reads a byte. With
PDL a kernel's programs may start while the kernel before it in the stream is still finishing, and
wait (`griddepcontrol.wait`) until that kernel has completed and its writes are visible; the launch
and the ramp then overlap the previous kernel's tail. Every kernel launched with `pdl_options` calls
`wait_for_inputs` before touching memory, so it reads and writes exactly what it would after a plain
launch: the results are the same bits. Kernels launched without PDL (torch's) keep full stream order.

Opt-in (FLASHTREE_PDL=1) until measured on the H200 against the plain launches.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("FLASHTREE_PDL") == "1"


@functools.cache
def _supports_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_options(x: torch.Tensor) -> dict:
    """A decode-path kernel's launch options for a launch on x's device: GDC (whether it waits for its
    inputs) and, where PDL runs, launch_pdl."""
    if ENABLED and x.is_cuda and _supports_pdl(x.device.index or 0):
        return {"GDC": True, "launch_pdl": True}
    return {"GDC": False}


@triton.jit
def wait_for_inputs(GDC: tl.constexpr):
    """The first statement of every decode-path kernel: under PDL, wait until the kernel before this one
    has completed and its memory writes are visible."""
    if GDC:
        tl.extra.cuda.gdc_wait()
