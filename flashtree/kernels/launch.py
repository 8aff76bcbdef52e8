"""Programmatic dependent launch (PDL, compute capability 9.0+) for the decode-path kernels.

A decode step is hundreds of small launches (a 27B AR step 1294, the default pair's tree step 530:
bench/results/h200-combine-2026-12-04), each paying a launch and a ramp before it reads a byte. With
PDL a kernel's programs may start while the kernel before it in the stream is still running, and
wait (`griddepcontrol.wait`) until that kernel has completed and its writes are visible; the launch
and the ramp then overlap the previous kernel. Every kernel launched with `pdl_options` calls
`wait_for_inputs` before touching memory, so it reads and writes exactly what it would after a plain
launch: the results are the same bits. Kernels launched without PDL (torch's) keep full stream order.

On by default on sm_90+ (FLASHTREE_PDL=0 turns it off). Measured with the next kernel let in only
when this one's programs exit (the implicit trigger): no gain on the default pair's graphed steps
(bench/results/h200-pdl-2026-12-04/). So `wait_for_inputs` also lets the next kernel launch as soon as
every program of this one has passed its wait (`griddepcontrol.launch_dependents`): this kernel's whole
run, not only its exit, overlaps the next one's launch. That cannot starve this kernel (the trigger
fires only once all of its programs are resident) nor change a result (the next kernel still waits for
this one to complete). With it the 27B AR step took 7.21 ms instead of 7.85 (0.54 of the roofline
instead of 0.48), the pair's AR step 1.32-1.35 ms instead of 1.41-1.48, its tree step the same
(bench/results/h200-pdl-2026-12-04/early-trigger/).

Tried and removed: asking L2 for a kernel's first weight units before its wait (weights are constants),
against the ~5-7 us floor of a small matrix at M = 1. It gained nothing on the default pair's graphed
steps (bench/results/h200-draft-run12-2026-12-05/) nor on the 27B AR step (8.41 vs 8.38 ms,
bench/results/h100-step-2026-12-05/).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


def enabled_from_env() -> bool:
    """FLASHTREE_PDL: on unless set to 0."""
    return os.environ.get("FLASHTREE_PDL", "1") != "0"


ENABLED = enabled_from_env()


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
    """Before every decode-path kernel's first read or write (only index math comes before it): under
    PDL, wait until the kernel before this one has completed and its memory writes are visible, then let
    the kernel after this one launch."""
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
