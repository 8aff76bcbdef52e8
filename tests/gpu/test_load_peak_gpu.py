"""A load's peak GPU memory is its resident size: the loader streams every tensor into its resident form
(models/loader.py, LOAD_CHUNK_BYTES), so the allocator never holds a decoded or repacked copy next to it.

The model: Qwen3.6-27B's width (its 248,320 x 5,120 embedding, decoded to bf16 on the device, and its
Q6_K LM head, the largest tensors a load converts) with 4 of its 64 layers (3 Gated DeltaNet, 1 gated
attention), random Q4_K_M weights, no tokenizer (the loader needs none). Also checks the plan's target
weights (flashtree/engine/plan.py) are what the load allocates, to the byte.
"""

import dataclasses

import pytest
import torch

from flashtree.convert.hf import general_metadata
from flashtree.convert.shapes import get_shape
from flashtree.convert.synth import _random_tensor, synth_plan
from flashtree.engine.plan import build_target, module_bytes
from flashtree.gguf.reader import open_gguf
from flashtree.gguf.writer import write_gguf
from flashtree.models.config import hybrid_layer_types
from flashtree.models.loader import load_target

pytestmark = pytest.mark.gpu

SLACK = 0.05  # of the resident bytes
ALLOCATOR_BYTES = 8 << 20  # the caching allocator's segments: small tensors share 2 MiB ones, rounding


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    shape = dataclasses.replace(get_shape("qwen3.6-27b"), n_layers=4, layer_types=hybrid_layer_types(4, 4))
    plan = synth_plan(shape, "q4_k_m")
    path = tmp_path_factory.mktemp("load-peak") / "qwen35-27b-width-4-layers.gguf"
    metadata = general_metadata("load peak", "q4_k_m") | shape.gguf_metadata()
    tensors = (_random_tensor(t, 0, i) for i, t in enumerate(plan))
    write_gguf(path, shape.arch, metadata, tensors, progress=False)
    return path


@pytest.mark.parametrize("quantized", [True, False], ids=["packed", "dense"])
def test_load_peak_is_the_resident_size(wide_model, quantized):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_reserved()
    model, _ = load_target(wide_model, device="cuda", quantized=quantized)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_reserved() - before
    resident = module_bytes(model)
    print(f"resident {resident / 2**30:.3f} GiB, load peak {peak / 2**30:.3f} GiB")
    assert resident <= peak <= resident * (1 + SLACK) + ALLOCATOR_BYTES, (peak, resident)
    gguf = open_gguf(wide_model)
    planned = build_target(model.config, gguf, "cuda", quantized=quantized)
    assert module_bytes(planned) == resident
    del model
    torch.cuda.empty_cache()


def test_free_memory_stays_within_a_process_cap():
    """A run that emulates a smaller card (benchmarks/long_run.py --gpu-memory) caps the allocator; the
    prefill chunk rule and the planner then see the cap's free memory, not the GPU's."""
    from flashtree.engine.memory import free_bytes

    device = torch.device("cuda")
    total = torch.cuda.mem_get_info(device)[1]
    torch.cuda.set_per_process_memory_fraction(0.25, device)
    try:
        held = torch.empty(1 << 28, dtype=torch.uint8, device=device)
        assert free_bytes(device) == int(0.25 * total) - torch.cuda.memory_reserved(device)
        del held
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    assert free_bytes(device) == torch.cuda.mem_get_info(device)[0]
