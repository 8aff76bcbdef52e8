import os

# CI has no GPU: Triton kernels run in Triton's CPU interpreter. Set before anything imports triton,
# because triton.jit reads it when a kernel is defined.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Tiny models: one thread avoids OpenMP spin/oversubscription costs that dwarf the work itself.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    """Directory for tiny converted models, shared by the whole test session."""
    return tmp_path_factory.mktemp("tiny-models")
