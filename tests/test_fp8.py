"""fp8 draft matrices (kernels/fp8.py, layers.Fp8Linear): the Triton row quantizer writes torch's fp8 bytes
(run by Triton's interpreter), the product is x @ W^T to fp8 rounding, and a draft in fp8 keeps speculative
decoding lossless (its arithmetic changes proposals only)."""

import pytest
import torch

from flashtree.config import SamplingParams
from flashtree.errors import FlashtreeError
from flashtree.kernels import fp8
from flashtree.models.dflash import load_draft
from flashtree.models.layers import Fp8Linear, Linear
from flashtree.models.loader import load_target
from tests.spec_util import generate, random_draft_dir
from tests.tiny import tiny_gguf

FP8_REL_TOL = 0.06  # e4m3 keeps 3 mantissa bits: a relative step of 1/16, averaged over a row's products


def edge_rows() -> torch.Tensor:
    """Rows whose codes hit every rounding case: ties at 1.5 and 2.5 units, the binade edges that
    Triton's interpreter's own cast gets wrong, subnormals and their ties, zeros, the row's amax."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(6, 5000, generator=g) * torch.tensor([1.0, 1e-3, 50.0, 1.0, 1.0, 1.0])[:, None]
    rows[3] = 0.0
    # row 4: amax 448 (scale exactly 1), then exact values of every tie and edge
    ties = torch.tensor([448.0, 1.0625, 1.1875, 126.2, 127.9, 7.98, 31.5, 2**-7, 2**-6 - 2**-10, 3 * 2**-10])
    rows[4, : ties.numel()] = ties
    rows[4, ties.numel() : 2 * ties.numel()] = -ties
    rows[5, :100] = torch.linspace(-(2**-5), 2**-5, 100)  # around the subnormal range of a scale-1 row
    rows[5, 100] = 448.0
    # bf16 values times a scale that is no power of two land near ties often: 448 / 49 must be the
    # correctly rounded quotient on both paths (torch's CPU division was an ulp off)
    outliers = (
        (torch.randn(2, 5000, generator=g) * torch.exp(torch.randn(5000, generator=g))).bfloat16().float()
    )
    outliers[1, :4] = torch.tensor([49.0, 1.3671875, -0.73828125, -1.2578125])  # x * 448/49: 12.5 -/+ 1 ulp
    return torch.cat([rows, outliers])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_row_quantizer_writes_torchs_bytes(dtype):
    x = edge_rows().to(dtype)
    codes, scales = fp8.quantize_rows(x)
    want_codes, want_scales = fp8.quantize_rows_reference(x)
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(codes[3].float(), torch.zeros(x.shape[1]))  # an all-zero row: zero codes
    assert (codes.float() * scales - x.float()).abs().max() <= scales.max() * 16  # half a step at 448


def test_row_quantizer_reads_strided_rows():
    x = torch.randn(3, 2 * 96, generator=torch.Generator().manual_seed(1))[:, :96]
    codes, scales = fp8.quantize_rows(x)
    want_codes, want_scales = fp8.quantize_rows_reference(x)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)) and torch.equal(
        scales, want_scales
    )


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_fp8_linear_is_the_product_to_fp8_rounding(dtype, kernels_path):
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(48, 160, generator=g), torch.randn(2, 5, 160, generator=g)
    lin = Fp8Linear(w.to(dtype))
    ref = torch.nn.functional.linear(x, w)
    y = lin(x.to(dtype))
    assert y.dtype == dtype and y.shape == (2, 5, 48)
    assert rel_err(y, ref) < FP8_REL_TOL
    assert rel_err(lin.dense_weight(), w) < FP8_REL_TOL / 2
    kernels_path("triton")  # the Triton quantizer: same bits
    assert torch.equal(lin(x.to(dtype)), y)


def test_fp8_linear_of_a_module_rounds_chunk_by_chunk():
    """A shared LM head is read through dense_weight in row chunks (a 27B head is 5 GB in fp32)."""
    w = torch.randn(80, 32, generator=torch.Generator().manual_seed(3))
    whole = Fp8Linear(w)
    chunked = Fp8Linear(Linear(w), chunk_rows=16)
    assert torch.equal(chunked.codes.view(torch.uint8), whole.codes.view(torch.uint8))
    assert torch.equal(chunked.scales, whole.scales)


@pytest.fixture(scope="module", params=["llama", "qwen35"])
def fp8_pair(request, tiny_root):
    """(target, its random 2-layer draft's directory, the draft in each fp8 mode)."""
    gguf = tiny_gguf(request.param, 0, tiny_root)
    target, _ = load_target(gguf, device="cpu", dtype=torch.float32)
    draft_dir = random_draft_dir(gguf, tiny_root, layers=2)
    return target, draft_dir, {mode: load_draft(draft_dir, target, mode) for mode in fp8.MODES}


def test_fp8_draft_proposes_close_to_the_native_one(fp8_pair):
    target, _, drafts = fp8_pair
    assert [d.fp8_mode for d in drafts.values()] == list(fp8.MODES)
    n_fp8 = {mode: sum(isinstance(m, Fp8Linear) for m in d.modules()) for mode, d in drafts.items()}
    assert n_fp8 == {
        "off": 0,
        "matrices": 1 + 5 * 2,
        "all": 1 + 5 * 2 + 1,
    }  # fc; q, o, k|v, gate|up, down; head
    assert drafts["matrices"].head is None  # the target's LM head, shared
    feats = torch.randn(12, drafts["off"].fc.weight.shape[1], generator=torch.Generator().manual_seed(4))
    logits = {}
    for mode, draft in drafts.items():
        ctx = draft.new_context(64, block=8)
        draft.append_context(ctx, feats)
        logits[mode] = draft.propose(ctx, torch.tensor(5), 8)
        assert logits[mode].dtype == torch.float32 and logits[mode].shape == logits["off"].shape
    for mode in ("matrices", "all"):
        assert (
            rel_err(logits[mode], logits["off"]) < 2 * FP8_REL_TOL
        )  # rounding through 2 layers (and the head)


@pytest.mark.parametrize(
    "config",
    [dict(mode="chain", block_size=8), dict(mode="tree", block_size=16, budget=22)],
    ids=["chain", "tree"],
)
@pytest.mark.parametrize("mode", ["matrices", "all"])
def test_fp8_draft_keeps_decoding_lossless(fp8_pair, mode, config):
    target, _, drafts = fp8_pair
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        prompt = torch.randint(target.config.vocab, (3 + 5 * seed,), generator=gen).tolist()
        ar, _ = generate(target, None, prompt, 16)
        assert generate(target, drafts[mode], prompt, 16, **config)[0] == ar
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
    ar, _ = generate(target, None, prompt, 16, sampling)
    assert generate(target, drafts[mode], prompt, 16, sampling, **config)[0] == ar


def test_fp8_mode_is_checked_against_the_device(fp8_pair, monkeypatch):
    target, draft_dir, _ = fp8_pair
    assert load_draft(draft_dir, target).fp8_mode == "off"
    assert load_draft(draft_dir, target, "all").fp8_mode == "all"
    with pytest.raises(FlashtreeError, match="fp8 mode '1': expected one of off, matrices, all"):
        load_draft(draft_dir, target, "1")
    monkeypatch.setattr(fp8, "supported", lambda device: False)  # simulates a GPU older than sm_89
    with pytest.raises(FlashtreeError, match="compute capability 8.9"):
        load_draft(draft_dir, target, "matrices")
    with pytest.raises(FlashtreeError, match="compute capability 8.9"):
        load_draft(draft_dir, target, "all")


def test_fp8_draft_of_odd_shape_is_refused(fp8_pair, monkeypatch):
    target, draft_dir, _ = fp8_pair
    monkeypatch.setattr(fp8, "ALIGN", 1 << 20)  # simulates a draft of shapes the fp8 GEMM refuses
    assert load_draft(draft_dir, target, "off").fp8_mode == "off"  # nothing in fp8: no constraint
    with pytest.raises(FlashtreeError, match="multiples of"):
        load_draft(draft_dir, target, "matrices")
