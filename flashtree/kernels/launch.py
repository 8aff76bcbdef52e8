"""Programmatic dependent launch (PDL, compute capability 9.0+) for the decode-path kernels.

A decode step is hundreds of small launches, each paying a launch and a ramp before it reads a byte. With
PDL a kernel's programs may start while the kernel before it is still running, and wait
(`griddepcontrol.wait`) until that kernel has completed and its writes are visible: every kernel launched
with `pdl_options` calls `wait_for_inputs` before touching memory, so the results are the same bits.
`wait_for_inputs` also lets the next kernel launch as soon as every program of this one has passed its
wait (`launch_dependents`), so this kernel's whole run overlaps the next one's launch; that cannot starve
this kernel nor change a result (bench/results/h200-pdl-2026-12-04). On by default; FLASHTREE_PDL=0
(Settings.pdl) turns it off for the process.
"""

from __future__ import annotations

import functools

import torch

from flashtree import settings
from flashtree.kernels import tl, triton


@functools.cache
def _pdl_wanted() -> bool:
    """The process's PDL setting, read at its first launch (the hot path reads no environment)."""
    return settings.current().pdl


@functools.cache
def _supports_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_options(x: torch.Tensor) -> dict:
    """A decode-path kernel's launch options for a launch on x's device: GDC (whether it waits for its
    inputs) and, where PDL runs, launch_pdl."""
    if x.is_cuda and _supports_pdl(x.device.index or 0) and _pdl_wanted():
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
