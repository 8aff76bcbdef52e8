"""Programmatic dependent launch (PDL, compute capability 9.0+) for the decode-path kernels.

A decode step is hundreds of small launches (a 27B AR step 1294, the default pair's tree step 530:
bench/results/h200-combine-2026-12-04), each paying a launch and a ramp before it reads a byte. With
PDL a kernel's programs may start while the kernel before it in the stream is still running, and
wait (`griddepcontrol.wait`) until that kernel has completed and its writes are visible; the launch
and the ramp then overlap the previous kernel. Every kernel launched with `pdl_options` calls
`wait_for_inputs` before touching memory, so it reads and writes exactly what it would after a plain
launch: the results are the same bits. Kernels launched without PDL (torch's) keep full stream order.

Opt-in (FLASHTREE_PDL=1) until it pays on the H200. Measured with the next kernel let in only when
this one's programs exit (the implicit trigger): no gain on the default pair's graphed steps (AR, chain
and tree within the spread between rounds, kernel time +1-2 %; bench/results/h200-pdl-2026-12-04/).
So `wait_for_inputs` now also lets the next kernel launch as soon as every program of this one has
passed its wait (`griddepcontrol.launch_dependents`): this kernel's whole run, not only its exit,
overlaps the next one's launch. That cannot starve this kernel (the trigger fires only once all of its
programs are resident) nor change a result (the next kernel still waits for this one to complete).
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
    has completed and its memory writes are visible, then let the kernel after this one launch."""
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
