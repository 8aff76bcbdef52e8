"""The memory plan against real allocations on the CPU, and a load whose peak is its resident size.

The plan's weights are the target (and draft) built on `meta` by the loader's own code; here they are
compared with what a load really allocates (storages of its parameters and buffers, to the byte), and
its state with what the engine's stores allocate. The load peak is measured from the CPU allocator's
own events (torch.profiler's memory events): bytes torch allocated and had not freed, at their maximum.
A GGUF's memory-mapped bytes are not torch allocations, so the peak counts exactly what the loader made.
"""

import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from typer.testing import CliRunner

from flashtree.cli import app
from flashtree.config import SpecConfig
from flashtree.convert.hf import convert_checkpoint
from flashtree.engine import memory, plan
from flashtree.engine.generate import Engine
from flashtree.errors import FlashtreeError
from flashtree.models import loader
from flashtree.models.dflash import load_draft
from flashtree.models.layers import PackedEmbedding
from flashtree.models.model import DecoderModel
from flashtree.quant.kv import KV_TYPES
from flashtree.settings import Settings
from flashtree.spec.decoder import SpecDecoder
from tests.spec_util import random_draft_dir
from tests.tiny import tiny_gguf

FAMILIES = ("llama", "qwen3", "qwen35")


def quantized_gguf(family: str, root, vocab: int = 320):
    """The tiny model of tests/tiny.py as a Q8_0 GGUF (its matrices packed; norms stay F32)."""
    tiny_gguf(family, 0, root, vocab)  # writes the Hugging Face dir it converts
    out = root / f"{family}-0-{vocab}-q8_0.gguf"
    if not out.exists():
        convert_checkpoint(root / f"{family}-0-{vocab}", out, "q8_0")
    return out


def allocation_peak(fn):
    """(fn(), the most bytes torch's CPU allocator held during fn beyond what it held before)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return out, peak


def tensor_bytes(*objects) -> int:
    """Bytes of the distinct storages of the tensors in `objects` (tensors, tuples, objects' fields)."""
    storages, seen = {}, set()

    def walk(x):
        if isinstance(x, torch.Tensor):
            storages[x.untyped_storage()._cdata] = x.untyped_storage().nbytes()
        elif isinstance(x, tuple | list):
            for y in x:
                walk(y)
        elif hasattr(x, "__dict__") and id(x) not in seen:
            seen.add(id(x))
            for y in vars(x).values():
                walk(y)

    walk(objects)
    return sum(storages.values())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("quantized", [False, True], ids=["dense", "packed"])
def test_load_peak_is_the_resident_size(family, quantized, tiny_root, monkeypatch):
    """Before streaming, a Q8_0 load held each tensor's decoded fp32 copy (dense) or its parts and their
    concatenation (packed) next to the result: 30-45% over the resident size here."""
    path = quantized_gguf(family, tiny_root, vocab=2048)
    monkeypatch.setattr(loader, "LOAD_CHUNK_BYTES", 1024)
    (model, _), peak = allocation_peak(lambda: loader.load_target(path, "cpu", quantized=quantized))
    resident = plan.module_bytes(model)
    # one chunk's temporaries: LOAD_CHUNK_BYTES of fp32 values and what their decoding makes on the way
    assert resident <= peak <= resident + 4 * loader.LOAD_CHUNK_BYTES, (peak, resident)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("quantized", [False, True], ids=["dense", "packed"])
def test_planned_weights_are_the_loaded_bytes(family, quantized, tiny_root):
    for path in (tiny_gguf(family, 0, tiny_root), quantized_gguf(family, tiny_root)):
        model, gguf = loader.load_target(path, "cpu", quantized=quantized)
        config = model.config
        planned = plan.build_target(config, gguf, "cpu", quantized=quantized)
        assert planned.device.type == "meta"
        assert plan.module_bytes(planned) == plan.module_bytes(model) > 0


def _state_cases():
    """(family, KV type) pairs: every KV type once the model takes them (DecoderModel.set_kv_types) on
    qwen35 (the one tiny model with a head size of whole 32-value blocks), the float ones everywhere."""
    if not hasattr(DecoderModel, "set_kv_types"):
        return [(family, None) for family in FAMILIES]
    floats = [None, *(k for k in KV_TYPES if k in ("bf16", "f16", "f32"))]
    return [(f, k) for f in FAMILIES for k in floats] + [("qwen35", k) for k in KV_TYPES if k not in floats]


@pytest.mark.parametrize("family,kind", _state_cases())
def test_planned_state_is_the_allocated_state(family, kind, tiny_root):
    model, gguf = loader.load_target(tiny_gguf(family, 0, tiny_root), "cpu")
    if kind is not None:
        model.set_kv_types(kind, kind)
    planner = plan.Planner(
        plan.build_target(model.config, gguf, "cpu"), None, plan.PlanOptions(kind, kind, "ar")
    )
    rows = dict((name, size) for name, size, _ in planner.plan(100).rows)
    # the engine allocates one verify block (one token for AR) past the context
    state = model.new_state(100 + planner.max_block)
    assert rows["KV cache"] + rows["DeltaNet state"] == tensor_bytes(state.stores)
    assert (rows["DeltaNet state"] > 0) == (family == "qwen35")


def test_a_quantized_cache_plans_the_prefill_slab(tiny_root):
    """A quantized cache's prefill reads earlier keys through a slab of values (prefill_attention's
    SLAB_BYTES): its workspace holds one; a float cache's does not."""
    from flashtree.kernels.prefill_attention import SLAB_BYTES

    model, gguf = loader.load_target(tiny_gguf("llama", 0, tiny_root), "cpu")
    target = plan.build_target(model.config, gguf, "cpu")
    work = {k: plan.Planner(target, None, plan.PlanOptions(k, k, "ar")).workspace_bytes() for k in KV_TYPES}
    assert {k: work[k] - work["f32"] for k in KV_TYPES} == {
        k: 0 if k in ("bf16", "f16", "f32") else SLAB_BYTES for k in KV_TYPES
    }


@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_planned_draft_ring_and_pending_state_are_allocated(mode, tiny_root):
    path = tiny_gguf("qwen35", 0, tiny_root)
    draft_dir = random_draft_dir(path, tiny_root, layers=2)
    target, _ = loader.load_target(path, "cpu")
    draft = load_draft(draft_dir, target)
    spec = SpecConfig(mode=mode, budget=7, draft_ctx=64)
    options = plan.PlanOptions(mode=mode, budget=7, draft_ctx=64)
    planner = plan.make_planner(path, draft=draft_dir, options=options, device_type="cpu")
    rows = dict((name, size) for name, size, _ in planner.plan(50).rows)
    decoder = SpecDecoder(target, draft, spec)
    assert planner.max_block == decoder.max_block
    assert rows["draft weights"] == plan.module_bytes(draft) > 0
    assert rows["draft context ring"] == tensor_bytes(decoder.context)
    state = target.new_state(50 + decoder.max_block)
    delta = [s for s in state.stores if hasattr(s, "pending_buffers")]
    # what a verify forward allocates for its commit (DeltaNetStore.pending_buffers)
    assert (
        rows["verify pending state"]
        == tensor_bytes([s.pending_buffers(decoder.max_block) for s in delta])
        > 0
    )


def test_plan_json_from_the_command(tiny_root):
    path = tiny_gguf("qwen35", 0, tiny_root)
    args = ["plan", "--target", str(path), "--max-ctx", "300", "--gpu-memory", "2", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["max_ctx"] == 300 and out["fits"] is True
    assert out["total_bytes"] == sum(c["bytes"] for c in out["components"].values())
    assert "KV cache" in out["components"] and "draft weights" not in out["components"]


def test_auto_context_grows_with_memory_and_fits(tiny_root):
    path = tiny_gguf("qwen3", 0, tiny_root)
    planner = plan.make_planner(path, device_type="cpu")
    fixed = planner.plan(0).total
    per_token = planner.kv_bytes(1) - planner.kv_bytes(0)
    limit = planner.target.config.context_length
    with pytest.raises(FlashtreeError, match="lower --max-ctx"):  # not one token's room
        plan.context_for(planner, "auto", fixed + per_token // 2, limit)
    last = 0
    for extra in range(1, 2 * limit + 2, 97):
        budget = fixed + extra * per_token + per_token // 2
        ctx = plan.context_for(planner, "auto", budget, limit)
        assert ctx >= last and planner.plan(ctx).total <= budget
        assert ctx == limit or planner.plan(ctx + 1).total > budget
        last = ctx
    assert last == limit


def test_the_cli_needs_a_budget_for_auto_without_a_gpu(tiny_root):
    path = tiny_gguf("qwen3", 0, tiny_root)
    result = CliRunner().invoke(app, ["plan", "--target", str(path), "--max-ctx", "auto"])
    if not torch.cuda.is_available():
        assert result.exit_code == 1 and "needs --gpu-memory" in result.output


def test_a_context_that_does_not_fit_is_refused_before_loading(tiny_root, monkeypatch):
    path = tiny_gguf("qwen3", 0, tiny_root)
    planner = plan.make_planner(path, device_type="cpu")
    monkeypatch.setattr(memory, "free_bytes", lambda device: planner.plan(200).total)
    monkeypatch.setattr(loader, "load_target", None)  # refused before any weight is read
    with pytest.raises(FlashtreeError, match="KV cache .* lower --max-ctx or use a smaller --kv-type"):
        Engine.load(path, "none", max_ctx=400, device="cpu", settings=Settings())
    with pytest.raises(FlashtreeError, match="exceeds the model's context length"):
        Engine.load(path, "none", max_ctx=5000, device="cpu", settings=Settings())


def test_the_default_context_is_planned_then_loaded(tiny_root, monkeypatch):
    path = tiny_gguf("qwen3", 0, tiny_root)
    planner = plan.make_planner(path, device_type="cpu")
    monkeypatch.setattr(memory, "free_bytes", lambda device: planner.plan(300).total)
    assert plan.plan_load(path, "none", None, None, None, torch.device("cpu"), Settings()) == 300
    monkeypatch.setattr(memory, "free_bytes", lambda device: 1 << 40)
    engine = Engine.load(path, "none", device="cpu", settings=Settings())
    assert engine.max_ctx == min(planner.target.config.context_length, plan.DEFAULT_CONTEXT_CAP)


def test_a_planned_context_is_not_refused_again_after_the_load(tiny_root, monkeypatch):
    """Engine.load allocates the context the plan accepted: the guard of an engine built directly (which
    keeps a margin of the free memory for the workspace the plan counts) does not refuse it again (it
    did on an H100 capped at 22 GiB: bench/results/h100-long-context-2026-12-06)."""
    path = tiny_gguf("qwen3", 0, tiny_root)
    planner = plan.make_planner(path, device_type="cpu")
    total, state = planner.plan(300).total, dict((r[0], r[1]) for r in planner.plan(300).rows)["KV cache"]
    reads = iter([total])  # the plan sees the budget; after the load only the cache's bytes are free
    monkeypatch.setattr(memory, "free_bytes", lambda device: next(reads, state))
    engine = Engine.load(path, "none", max_ctx=300, device="cpu", settings=Settings())
    assert engine.max_ctx == 300
    with pytest.raises(FlashtreeError, match="lower --max-ctx"):
        Engine(engine.target, None, None, max_ctx=300)  # built directly: the guard's margin refuses


def test_the_27b_plan_needs_no_weights():
    """The issue's target: Qwen3.6-27B Q4_K_M + a 5-layer fp8 draft at 262,144 tokens of tq3_0 within 22
    GiB (the workspace part is an estimate until measured on the GPU)."""
    args = [
        "plan",
        "--shape",
        "qwen3.6-27b",
        "--type",
        "q4_k_m",
        "--draft-layers",
        "5",
        "--draft-dtype",
        "fp8",
    ]
    args += ["--max-ctx", "262144", "--kv-type", "tq3_0", "--gpu-memory", "22", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    parts = out["components"]
    # 16 attention layers x K and V x 4 KV heads x (262144 + 23 slots) x 112 bytes (tq3_0 at head 256)
    assert parts["KV cache"]["bytes"] == 16 * 2 * 4 * (262144 + 23) * 112
    assert 15 * plan.GIB < parts["target weights"]["bytes"] < 15.5 * plan.GIB  # all packed
    assert out["fits"] is True  # the target: 22 GiB with fp8 draft matrices
    assert out["total_bytes"] == sum(c["bytes"] for c in parts.values())


@pytest.mark.parametrize("family", FAMILIES)
def test_a_packed_embedding_decodes_the_dense_rows(family, tiny_root):
    """Packed models keep their token embedding packed unless it is also the LM head (tied)."""
    path = quantized_gguf(family, tiny_root)
    packed, gguf = loader.load_target(path, "cpu", quantized=True)
    dense, _ = loader.load_target(path, "cpu", quantized=False)
    tokens = torch.randint(0, packed.config.vocab, (2, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(packed.embed(tokens), dense.embed(tokens))
    assert isinstance(packed.embedding, PackedEmbedding) == gguf.has("output.weight")
