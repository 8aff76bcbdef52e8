"""Bounded by design (issue #41): every knob a user or a file sets has a range, a bad value is one
`error:` line (exit 1) before any model loads, and the context a file claims never sizes the cache."""

from __future__ import annotations

import json
import shutil
import struct
from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

from flashtree.cli import app
from flashtree.config import (
    DEFAULT_CONTEXT_CAP,
    MAX_BLOCK_SIZE,
    MAX_BUDGET,
    MAX_CONTEXT,
    MAX_TREE_TOP_K,
    SamplingParams,
    SpecConfig,
)
from flashtree.engine import memory
from flashtree.engine.generate import Engine
from flashtree.errors import FlashtreeError
from flashtree.models.dflash import load_draft
from flashtree.models.loader import load_target
from flashtree.quant.kv import KVPlane
from flashtree.spec.decoder import SpecDecoder
from flashtree.spec.tree import build_tree
from tests.spec_util import OracleDraft, generate, random_draft_dir
from tests.tiny import tiny_gguf

HUGE_CONTEXT = 2**32 - 1


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name", ["temperature", "top_p"])
def test_sampling_params_refuse_non_finite_values(name, value):
    with pytest.raises(FlashtreeError, match=f"{name} must be a finite number"):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("value", [1e-300, 1e-5, -0.5])
def test_a_temperature_is_greedy_or_large_enough_to_divide_by(value):
    """1e-300 is 0 in fp32: the logits / T would be inf and the reply token 0 repeated."""
    with pytest.raises(FlashtreeError, match="temperature must be 0 .greedy. or at least 0.0001"):
        SamplingParams(temperature=value)
    assert SamplingParams(temperature=1e-4).temperature == 1e-4 and SamplingParams().greedy


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_draft_temperature_must_be_finite(value):
    with pytest.raises(FlashtreeError, match="draft temperature must be a finite number"):
        SpecConfig(draft_temperature=value)


@pytest.mark.parametrize(
    "name,high",
    [("budget", MAX_BUDGET), ("block_size", MAX_BLOCK_SIZE), ("tree_top_k", MAX_TREE_TOP_K),
     ("draft_ctx", MAX_CONTEXT)],
)  # fmt: skip
def test_spec_settings_have_upper_bounds(name, high):
    assert getattr(SpecConfig(**{name: high}), name) == high
    with pytest.raises(FlashtreeError, match=f"must be between .* and {high}, got {high + 1}"):
        SpecConfig(**{name: high + 1})


def _refuse_loading(monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded for a command with a bad option")

    monkeypatch.setattr(Engine, "load", no_load)


BAD_OPTIONS = [
    ["run", "-p", "hi", "--temperature", "nan"],
    ["run", "-p", "hi", "--top-p", "inf"],
    ["run", "-p", "hi", "--draft-temperature", "nan"],
    ["run", "-p", "hi", "--budget", "100000"],
    ["run", "-p", "hi", "--block-size", "1000"],
    ["run", "-p", "hi", "--tree-top-k", "100000"],
    ["run", "-p", "hi", "--draft-ctx", str(10**9)],
    ["run", "-p", "hi", "--max-tokens", "-1"],
    ["run", "-p", "hi", "--max-tokens", str(10**9)],
    ["run", "-p", "hi", "--max-ctx", "0"],
    ["run", "-p", "hi", "--max-ctx", str(10**12)],
    ["chat", "--temperature", "nan"],
    ["chat", "--top-p", "inf"],
    ["chat", "--max-tokens", "-1"],
    ["chat", "--max-ctx", str(10**12)],
    ["bench", "--out", "{tmp}", "--datasets", "humaneval", "--n", "1", "--budget", "100000"],
    ["bench", "--out", "{tmp}", "--datasets", "humaneval", "--n", "1", "--block-size", "1000"],
    ["bench", "--out", "{tmp}", "--max-tokens", "-1"],
]


@pytest.mark.parametrize("argv", BAD_OPTIONS, ids=lambda a: " ".join(a[:1] + a[-2:]))
def test_a_bad_option_is_one_error_line_before_any_model_loads(argv, tmp_path, monkeypatch):
    _refuse_loading(monkeypatch)
    result = CliRunner().invoke(app, [a.format(tmp=tmp_path / "out") for a in argv])
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def llama(tiny_root):
    path = tiny_gguf("llama", 0, tiny_root)
    return path, load_target(path, device="cpu", dtype=torch.float32)[0]


def test_a_drafts_own_block_size_is_checked_before_it_sizes_anything(llama):
    _, target = llama
    draft = OracleDraft([0] * 8, target.config.vocab, block_size=10**6, error=0.0)
    with pytest.raises(FlashtreeError, match="the draft's block_size .* between 2 and 64, got 1000000"):
        SpecDecoder(target, draft, SpecConfig(mode="tree"))
    assert SpecDecoder(target, draft, SpecConfig(mode="tree", block_size=8)).block_size == 8  # an override


def test_a_draft_file_with_a_huge_block_size_is_one_error_line(llama, tiny_root, tmp_path):
    path, _ = llama
    draft = tmp_path / "draft"
    shutil.copytree(random_draft_dir(path, tiny_root), draft)
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "block_size": 10**6}))
    argv = ["run", "-p", "hi", "--target", str(path), "--draft", str(draft), "--mode", "tree"]  # auto: ar
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert "block_size" in result.stderr and "1000000" in result.stderr


def test_the_draft_ring_must_fit_in_free_memory(llama, tiny_root, monkeypatch):
    path, target = llama
    draft = load_draft(random_draft_dir(path, tiny_root), target)
    monkeypatch.setattr(memory, "free_bytes", lambda device: 1 << 20)
    with pytest.raises(FlashtreeError, match="draft's 1048576-token context ring needs .* lower --draft-ctx"):
        SpecDecoder(target, draft, SpecConfig(mode="tree", draft_ctx=MAX_CONTEXT))


def _with_context_length(src, dst, value: int):
    """A copy of GGUF `src` whose llama.context_length (a u32) claims `value`."""
    data = src.read_bytes()
    key = b"llama.context_length"
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    assert struct.unpack_from("<I", data, at)[0] == 4  # GGUF value type u32
    dst.write_bytes(data[: at + 4] + struct.pack("<I", value) + data[at + 8 :])
    return dst


def _state_bytes(state) -> int:
    """Bytes of every distinct tensor storage a ModelState holds (its stores' and its layers', a KV
    plane's fields included)."""
    seen, total = set(), 0
    for holder in [*state.stores, *state.layers]:
        values = [t for v in vars(holder).values() for t in (v if isinstance(v, KVPlane) else (v,))]
        for t in values:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
    return total


def test_a_file_claiming_a_huge_context_gets_the_capped_one(llama, tmp_path):
    path, _ = llama
    huge = _with_context_length(path, tmp_path / "huge.gguf", HUGE_CONTEXT)
    engine = Engine.load(huge, "none", device="cpu")
    assert engine.target.config.context_length == HUGE_CONTEXT
    assert engine.max_ctx == DEFAULT_CONTEXT_CAP
    allocated = _state_bytes(engine.state)
    assert allocated == engine.target.state_bytes(DEFAULT_CONTEXT_CAP + 1)  # + the one spare slot
    assert allocated < 64 << 20  # tens of MiB for this model, not the host's memory
    assert list(engine.generate(engine.encode("hi"), 3))  # and it runs


def test_the_cap_and_free_memory_both_bound_the_default_context(llama, monkeypatch):
    _, target = llama
    monkeypatch.setattr(target, "config", replace(target.config, context_length=HUGE_CONTEXT))
    per_token = target.state_bytes(1) - target.state_bytes(0)
    assert memory.plan_context(target, None) == DEFAULT_CONTEXT_CAP
    fixed = target.state_bytes(0)
    monkeypatch.setattr(memory, "free_bytes", lambda device: int((fixed + 300.5 * per_token) / memory.USABLE))
    assert memory.plan_context(target, None) == 300
    with pytest.raises(FlashtreeError, match="--max-ctx must be between 1 and"):
        memory.plan_context(target, MAX_CONTEXT + 1)
    with pytest.raises(FlashtreeError, match="--max-ctx must be between 1 and"):
        memory.plan_context(target, 0)


def test_the_largest_budget_and_block_decode_like_ar(llama, tiny_root):
    path, target = llama
    draft = load_draft(random_draft_dir(path, tiny_root), target)
    prompt = list(range(5, 25))
    ar, _ = generate(target, None, prompt, 6)
    spec = dict(mode="tree", budget=MAX_BUDGET, block_size=MAX_BLOCK_SIZE, tree_top_k=MAX_TREE_TOP_K)
    assert generate(target, draft, prompt, 6, **spec)[0] == ar


def test_budgets_past_the_kernels_tile_build_in_torch(monkeypatch, kernels_path):
    from flashtree.kernels import ddtree

    kernels_path("triton")
    monkeypatch.setattr(ddtree, "ddtree", lambda *a: pytest.fail("the Triton build past its tile"))
    logits = torch.randn(15, 320, generator=torch.Generator().manual_seed(0))
    tree = build_tree(torch.tensor(3), logits, MAX_BUDGET, 8)
    assert tree.tokens.shape == (MAX_BUDGET + 1,) and tree.layout.visible.shape == (MAX_BUDGET + 1,) * 2
