import os

# CI has no GPU: Triton kernels run in Triton's CPU interpreter. Set before anything imports triton,
# because triton.jit reads it when a kernel is defined.
os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

# Tiny models: one thread avoids OpenMP spin/oversubscription costs that dwarf the work itself.
torch.set_num_threads(1)


def _order_fixed_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    """The interpreter's tl.dot with each output element summed in one fixed order (k = 0, 1, ...).

    Triton's own interpreter calls numpy's matmul, whose BLAS kernels sum a row differently for different
    row counts on some CPUs (OpenBLAS's Haswell kernels: (a[:M] @ b)[0] changes with M). The kernels'
    batch invariance is a claim about the order of their dots, not about the host's BLAS, so the tests
    model a dot as the GPU's tensor cores run it: every element's terms in an order that does not depend
    on the other rows. Integer dots are exact and keep numpy's matmul."""
    out = d.data.dtype
    if np.issubdtype(out, np.integer):
        return interpreter.TensorHandle(np.matmul(a.data, b.data, dtype=out) + d.data, d.dtype.scalar)
    terms = _as_float(a)[..., :, :, None].astype(out) * _as_float(b)[..., None, :, :].astype(out)
    sums = np.add.accumulate(terms, axis=-2)[..., -1, :]  # (..., M, N): strictly left to right over k
    return interpreter.TensorHandle(sums + d.data, d.dtype.scalar)


def _as_float(t):
    """A dot operand as numpy floats (the interpreter keeps bf16 as raw uint16 bits, fp8 as bytes)."""
    dtype = t.dtype.scalar
    if dtype.is_bf16():
        return (t.data.astype(np.uint32) << 16).view(np.float32)
    if dtype.is_floating() and dtype.primitive_bitwidth == 8:
        return interpreter._convert_float(t.data, dtype, interpreter.tl.float16, None).view(np.float16)
    return t.data


interpreter.InterpreterBuilder.create_dot = _order_fixed_dot


@pytest.fixture
def kernels_path(monkeypatch):
    """`kernels_path("triton")`: this test's models run the Triton kernels (in the interpreter) where they
    would run the torch reference on the CPU; "torch" or "auto" as FLASHTREE_KERNELS says (settings.py)."""
    return lambda path: monkeypatch.setenv("FLASHTREE_KERNELS", path)


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    """Directory for tiny converted models, shared by the whole test session."""
    return tmp_path_factory.mktemp("tiny-models")
