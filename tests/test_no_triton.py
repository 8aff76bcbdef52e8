"""`pip install flashtree` without the gpu extra has no triton: the CPU path must import and run without it
(flashtree/kernels/__init__.py's stand-ins), and a CUDA run must stop with the install hint."""

import json
import subprocess
import sys
import textwrap

import pytest

from flashtree.convert.synth import synth_draft, synth_model

# Runs first in the child: the path finder no longer finds triton, as where it is not installed (import
# raises ModuleNotFoundError, importlib.util.find_spec gives None).
BLOCK_TRITON = """
import importlib.machinery
import sys

class NoTriton(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            return None
        return super().find_spec(name, path, target)

sys.meta_path = [NoTriton if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
"""


def run_without_triton(code: str) -> subprocess.CompletedProcess:
    script = BLOCK_TRITON + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("no-triton")
    target = root / "t.gguf"
    synth_model("tiny-qwen35", "q4_k_m", target, seed=3)  # attention, Gated DeltaNet, packed matrices
    synth_draft(target, 1, root / "draft", seed=3)
    return target, root / "draft"


@pytest.mark.parametrize("mode", ["tree", "ar"])
def test_flashtree_run_on_the_cpu_without_triton(pair, mode):
    target, draft = pair
    argv = ["flashtree", "run", "--prompt", "Hi", "--target", str(target), "--draft", str(draft)]
    argv += ["--mode", mode, "--max-tokens", "6", "--device", "cpu", "--json"]
    r = run_without_triton(f"""
        import atexit
        atexit.register(lambda: print("TRITON_IMPORTED" if "triton" in sys.modules else "NO_TRITON"))
        sys.argv = {argv!r}
        from flashtree.cli import main
        main()
    """)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[-1] == "NO_TRITON"
    assert len(json.loads("\n".join(out[:-1]))["token_ids"]) > 0


def test_packed_matrix_on_the_cpu_and_the_gpu_hint_without_triton():
    r = run_without_triton("""
        import numpy as np
        import torch

        from flashtree import kernels
        from flashtree.errors import FlashtreeError
        from flashtree.kernels.qlinear import QuantLinear
        from flashtree.kernels.rotary import rounded
        from flashtree.quant.formats import QT
        from flashtree.quant.pack import random_blocks

        assert not kernels.HAVE_TRITON
        raw = torch.from_numpy(random_blocks(QT.Q4_K, 8, 256, np.random.default_rng(0)))
        y = QuantLinear(raw, QT.Q4_K, (8, 256))(torch.randn(2, 256))  # the CPU path: dequantize + matmul
        assert y.shape == (2, 8) and bool(torch.isfinite(y).all())

        class OnCuda:
            is_cuda = True

        refusals = (
            lambda: kernels.triton_kernels_for(OnCuda()),  # a model's GPU path, before any launch
            lambda: rounded[(1,)](0.0, False),  # a kernel launch
            lambda: kernels.triton.cdiv(5, 2),  # Triton's host helpers
        )
        for refused in refusals:
            try:
                refused()
            except FlashtreeError as e:
                assert "pip install triton" in str(e), e
                print("REFUSED")
        assert "triton" not in sys.modules
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["REFUSED"] * 3
