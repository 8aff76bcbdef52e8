"""Triton kernels (quantized matmul, tree DeltaNet, tree conv, rotary), each next to the torch path it
replaces on the GPU.

Triton is needed only where the kernels run (CUDA): `pip install flashtree` without the `gpu` extra runs
the CPU torch path. Every kernel module therefore takes `triton` and `tl` from here, never from `import
triton`: the real modules when Triton is installed, else `_NoTriton` stand-ins that let the modules define
their kernels (`@triton.jit`, `tl.constexpr` at import) and refuse anything else with the install hint
(MISSING_TRITON). `triton_kernels_for` refuses a CUDA tensor without Triton, and `require_triton` lets
the loader refuse a CUDA device before it loads weights."""

from __future__ import annotations

import functools

from flashtree import settings  # no triton there; its module may still be loading (it imports tiles.py)
from flashtree.errors import FlashtreeError

MISSING_TRITON = (
    "the GPU path runs Triton kernels, and triton is not installed: pip install triton "
    "(or pip install 'flashtree[gpu]'), or run on the CPU with --device cpu"
)


class _NoTriton:
    """Stand-in for `triton` and `triton.language` where Triton is not installed: `jit` and `constexpr`
    work as the kernel modules use them at import; a kernel launch or any other attribute raises
    FlashtreeError(MISSING_TRITON)."""

    @staticmethod
    def jit(fn=None, **options):
        return _NoTriton.jit if fn is None else _Unlaunchable(fn)  # @triton.jit and @triton.jit(...)

    @staticmethod
    def constexpr(value=None):
        return value

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise FlashtreeError(MISSING_TRITON)


class _Unlaunchable:
    """A `@triton.jit` function defined without Triton: launching or calling it raises."""

    def __init__(self, fn):
        functools.update_wrapper(self, fn)

    def __getitem__(self, grid):
        raise FlashtreeError(MISSING_TRITON)

    def __call__(self, *args, **kwargs):
        raise FlashtreeError(MISSING_TRITON)


@functools.cache
def _triton() -> dict[str, object]:
    try:
        import triton
        import triton.language as tl
    except ModuleNotFoundError as e:
        if e.name != "triton":  # an installed triton that fails to import: its own error
            raise
        triton = tl = _NoTriton()
    return {"triton": triton, "tl": tl, "HAVE_TRITON": not isinstance(triton, _NoTriton)}


def __getattr__(name: str):
    """`triton`, `tl` and HAVE_TRITON, imported on first use (PEP 562): the settings import this package
    for its tiles.py on every command, and triton brings torch, a second of `flashtree --help`."""
    if name in ("triton", "tl", "HAVE_TRITON"):
        return _triton()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def require_triton() -> None:
    """Raise FlashtreeError(MISSING_TRITON) unless Triton is installed."""
    if not _triton()["HAVE_TRITON"]:
        raise FlashtreeError(MISSING_TRITON)


def triton_kernels_for(x) -> bool:
    """Whether the model's decode/verify paths run our Triton kernels or the torch reference for tensor `x`:
    FLASHTREE_KERNELS (settings.kernel_path) auto, on CUDA; triton, always (tests run the kernels inside a
    model under TRITON_INTERPRET=1); torch, never."""
    path = settings.kernel_path()
    if path == "torch" or (path == "auto" and not x.is_cuda):
        return False
    require_triton()
    return True
