"""The memory plan: context sizes decided from free memory before allocation."""

import pytest
import torch

from flashtree.engine import memory
from flashtree.errors import FlashtreeError
from flashtree.models.loader import default_dtype, load_target
from tests.tiny import tiny_gguf


@pytest.fixture(scope="module")
def hybrid(tiny_root):
    model, _ = load_target(tiny_gguf("qwen35", 0, tiny_root), device="cpu", dtype=torch.float32)
    return model


def test_state_bytes_is_what_new_state_allocates(hybrid):
    state = hybrid.new_state(100)
    allocated = sum(
        t.numel() * t.element_size()
        for layer in state.layers
        for value in vars(layer).values()
        for t in getattr(value, "fields", [value])  # a KV plane's fields (quant/kv.py)
        if isinstance(t, torch.Tensor)
    )
    assert hybrid.state_bytes(100) == allocated


def test_pending_bytes_is_what_a_verify_forward_allocates(hybrid):
    state = hybrid.new_state(64)
    stores = [s for s in state.stores if hasattr(s, "pending_buffers")]
    allocated = sum(t.numel() * t.element_size() for s in stores for t in s.pending_buffers(7))
    assert stores and hybrid.pending_bytes(7) == allocated > 0


def test_the_verify_pending_state_is_left_free(hybrid, monkeypatch):
    per_token = hybrid.state_bytes(1) - hybrid.state_bytes(0)
    fixed = hybrid.state_bytes(0) + hybrid.pending_bytes(23)
    monkeypatch.setattr(memory, "free_bytes", lambda device: int((fixed + 300.5 * per_token) / memory.USABLE))
    assert memory.plan_context(hybrid, None, verify_tokens=23) == 300
    assert memory.plan_context(hybrid, None) > 300  # without the verify, its bytes hold more context
    with pytest.raises(FlashtreeError, match="verify's pending state"):
        memory.plan_context(hybrid, 400, verify_tokens=23)


def test_context_shrinks_to_free_memory_and_explicit_sizes_are_checked(hybrid, monkeypatch):
    per_token = hybrid.state_bytes(1) - hybrid.state_bytes(0)
    fixed = hybrid.state_bytes(0)
    monkeypatch.setattr(memory, "free_bytes", lambda device: int((fixed + 300.5 * per_token) / memory.USABLE))
    assert memory.plan_context(hybrid, None) == 300  # the model allows 1024; memory allows 300
    assert memory.plan_context(hybrid, 200) == 200
    with pytest.raises(FlashtreeError, match="lower --max-ctx"):
        memory.plan_context(hybrid, 400)
    with pytest.raises(FlashtreeError, match="exceeds the model's context length"):
        memory.plan_context(hybrid, 5000)


@pytest.mark.parametrize(
    "device,n_params,dtype",
    [
        ("cpu", 27_000_000_000, torch.float32),  # the CPU always computes in fp32
        ("cuda", 135_000_000, torch.float32),  # small models: fp32 on the GPU (verify == AR numerics)
        ("cuda", 27_000_000_000, torch.bfloat16),
    ],
)
def test_compute_dtype_by_device_and_size(device, n_params, dtype):
    assert default_dtype(torch.device(device), n_params) == dtype
