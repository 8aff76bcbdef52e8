"""The DFlash draft: incremental context cache vs a full recompute, formats, fit checks, CLI."""

import json
import subprocess
import sys

import pytest
import torch

from flashtree.convert.hf import convert_checkpoint
from flashtree.errors import FlashtreeError
from flashtree.models.dflash import load_draft
from flashtree.models.loader import load_target
from tests.spec_util import random_draft, random_draft_dir, sliding_draft_dir
from tests.tiny import tiny_gguf


@pytest.fixture(scope="module")
def qwen3(tiny_root):
    gguf = tiny_gguf("qwen3", 0, tiny_root)
    target, _ = load_target(gguf, device="cpu", dtype=torch.float32)
    return gguf, target


def target_features(target, draft, n):
    ids = torch.randint(0, target.config.vocab, (n,), generator=torch.Generator().manual_seed(n))
    out = target(ids, target.new_state(256), logits="none", capture=draft.config.target_layer_ids)
    return out.features


def sliding_draft(gguf, target, tiny_root):
    return load_draft(sliding_draft_dir(gguf, tiny_root), target)


def propose_full(draft, features, root, block):
    """From scratch: every context position fused and attended at once."""
    ctx = draft.new_context(4096)
    draft.append_context(ctx, features)
    return draft.propose(ctx, root, block)


def test_incremental_context_equals_full_recompute(qwen3, tiny_root):
    gguf, target = qwen3
    draft = random_draft(gguf, target, tiny_root, layers=2)
    feats = target_features(target, draft, 60)
    ctx = draft.new_context(4096)
    for lo, hi in [(0, 17), (17, 18), (18, 41), (41, 60)]:  # committed in uneven steps
        draft.append_context(ctx, feats[lo:hi])
        torch.testing.assert_close(
            draft.propose(ctx, torch.tensor(5), 16),
            propose_full(draft, feats[:hi], torch.tensor(5), 16),
            atol=1e-5,
            rtol=1e-5,
        )


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
def test_propose_with_the_attention_kernel_is_the_torch_path(
    qwen3, tiny_root, monkeypatch, kernels_path, sliding
):
    """On the GPU the draft's block attention runs kernels/attention.block_attention (here under
    TRITON_INTERPRET=1, with every other decode kernel): the same logits as the torch path's SDPA,
    a sliding window's layer too (each row its own window of the context)."""
    from flashtree.kernels import attention

    gguf, target = qwen3
    if sliding:
        draft = sliding_draft(gguf, target, tiny_root)
    else:
        draft = random_draft(gguf, target, tiny_root, layers=2)
    feats = target_features(target, draft, 60)
    ring = draft.new_context(24, spare=16)  # wrapped, with dead slots
    for lo in range(0, 60, 7):
        draft.append_context(ring, feats[lo : lo + 7])
    want = draft.propose(ring, torch.tensor(3), 16)
    kernels_path("triton")
    kernel_ring = draft.new_context(24, spare=16)  # appended by the rotary kernel (K/V stored in its launch)
    for lo in range(0, 60, 7):
        draft.append_context(kernel_ring, feats[lo : lo + 7])
    n_slots = ring.slot_pos.shape[0]
    for got, ref in ((kernel_ring.k, ring.k), (kernel_ring.v, ring.v)):  # other kernels ran too: not bitwise
        torch.testing.assert_close(got[:, :, :n_slots], ref[:, :, :n_slots], atol=1e-5, rtol=1e-5)
    calls = []
    kernel = attention.block_attention
    monkeypatch.setattr(attention, "block_attention", lambda *a: calls.append(a) or kernel(*a))
    context = ring.k[:, :, :n_slots].clone()
    torch.testing.assert_close(draft.propose(ring, torch.tensor(3), 16), want, atol=1e-5, rtol=1e-5)
    assert len(calls) == 2  # both layers took the kernel
    assert [c[-1] for c in calls] == [n_slots, n_slots]  # the block's K/V in the scratch past the ring
    first_rows = [torch.equal(c[3][0], c[3][-1]) for c in calls]  # the block's rows' context masks
    assert first_rows == ([False, True] if sliding else [True, True])
    assert torch.equal(ring.k[:, :, :n_slots], context)  # which leaves the context as it was
    with pytest.raises(FlashtreeError, match="draft block of 17 tokens"):
        draft.propose(ring, torch.tensor(3), 17)


def test_ring_keeps_the_last_positions_only(qwen3, tiny_root):
    """A ring of 24 positions after 60 committed ones equals attending to positions 36..59 only."""
    gguf, target = qwen3
    draft = random_draft(gguf, target, tiny_root, layers=2)
    feats = target_features(target, draft, 60)
    ring = draft.new_context(24)
    for lo in range(0, 60, 7):
        draft.append_context(ring, feats[lo : lo + 7])
    assert sorted(ring.slot_pos.tolist()) == list(range(36, 60))
    full = draft.new_context(4096)
    draft.append_context(full, feats)
    full.slot_pos[full.slot_pos < 36] = -1  # hide what the ring dropped
    torch.testing.assert_close(
        draft.propose(ring, torch.tensor(3), 8), draft.propose(full, torch.tensor(3), 8), atol=1e-5, rtol=1e-5
    )


def test_ring_read_bounded_by_the_kv_bucket(qwen3, tiny_root):
    """propose(n_keys): reading the ring's first n_keys slots (every live position lies below) gives
    the full read's logits; past the ring's size the whole ring is read, wrapped positions included."""
    gguf, target = qwen3
    draft = random_draft(gguf, target, tiny_root, layers=2)
    feats = target_features(target, draft, 60)
    ctx = draft.new_context(4096, spare=17)
    draft.append_context(ctx, feats[:41])
    full = draft.propose(ctx, torch.tensor(5), 16)
    for n_keys in (41, 64, 256):
        torch.testing.assert_close(
            draft.propose(ctx, torch.tensor(5), 16, n_keys), full, atol=1e-6, rtol=1e-6
        )
    assert not torch.allclose(draft.propose(ctx, torch.tensor(5), 16, 20), full)  # too few: not the same
    ring = draft.new_context(24, spare=4)  # 28 slots, wrapped after 60 positions
    for lo in range(0, 60, 7):
        draft.append_context(ring, feats[lo : lo + 7])
    torch.testing.assert_close(
        draft.propose(ring, torch.tensor(3), 8, 512), draft.propose(ring, torch.tensor(3), 8), atol=0, rtol=0
    )


def test_sliding_window_layers_see_only_recent_context(qwen3, tiny_root):
    gguf, target = qwen3
    draft = sliding_draft(gguf, target, tiny_root)
    assert [layer.window for layer in draft.layers] == [10, None]
    feats = target_features(target, draft, 40)
    ctx = draft.new_context(4096)
    draft.append_context(ctx, feats)
    # Changing context older than the window may only move the full-attention layer's output:
    # with that layer's context fixed, the sliding layer must ignore positions < start + B - 10.
    altered = feats.clone()
    altered[:20] += 1.0
    other = draft.new_context(4096)
    draft.append_context(other, altered)
    for i, layer in enumerate(draft.layers):
        if layer.window is None:
            other.k[i], other.v[i] = ctx.k[i], ctx.v[i]
    torch.testing.assert_close(
        draft.propose(ctx, torch.tensor(2), 4), draft.propose(other, torch.tensor(2), 4), atol=1e-6, rtol=1e-6
    )


def test_gguf_draft_equals_safetensors_draft(qwen3, tiny_root):
    gguf, target = qwen3
    draft = random_draft(gguf, target, tiny_root, layers=2)
    src = random_draft_dir(gguf, tiny_root, layers=2)
    out = tiny_root / "draft.gguf"
    convert_checkpoint(src, out, "f32")
    from_gguf = load_draft(out, target)
    feats = target_features(target, draft, 30)
    torch.testing.assert_close(
        propose_full(from_gguf, feats, torch.tensor(7), 16), propose_full(draft, feats, torch.tensor(7), 16)
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(hidden_size=32), "hidden size"),
        (dict(vocab_size=999), "vocab"),
        (dict(dflash_config={"mask_token_id": 10**6, "target_layer_ids": [0, 1]}), "mask_token_id"),
        (dict(dflash_config={"mask_token_id": 1, "target_layer_ids": [0, 9]}), "target_layer_ids"),
        (dict(num_target_layers=36), "num_target_layers"),
    ],
    ids=["hidden", "vocab", "mask", "layers", "depth"],
)
def test_draft_for_another_target_is_refused(qwen3, tiny_root, change, message):
    gguf, target = qwen3
    plain = random_draft_dir(gguf, tiny_root, layers=1)
    bad = tiny_root / f"bad-draft-{message.replace(' ', '_')}"
    bad.mkdir(exist_ok=True)
    cfg = json.loads((plain / "config.json").read_text()) | change
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").write_bytes((plain / "model.safetensors").read_bytes())
    with pytest.raises(FlashtreeError, match=message):
        load_draft(bad, target)


def test_run_with_draft_reports_acceptance(qwen3, tiny_root):
    gguf, target = qwen3
    draft_dir = random_draft_dir(gguf, tiny_root, layers=1)
    base = [sys.executable, "-m", "flashtree", "run", "--prompt", "Hello there", "--target", str(gguf),
            "--max-tokens", "12", "--device", "cpu", "--json"]  # fmt: skip
    runs = {}
    for mode in ("ar", "tree"):
        extra = ["--draft", str(draft_dir), "--mode", mode] if mode == "tree" else ["--draft", "none"]
        res = subprocess.run(base + extra, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        runs[mode] = json.loads(res.stdout)
    tree = runs["tree"]
    assert tree["mode"] == "tree" and tree["token_ids"] == runs["ar"]["token_ids"]
    assert tree["steps"] == sum(tree["accept_hist"]) and tree["mean_accept_len"] >= 1.0
    assert {"text", "prompt_token_ids", "n_prompt", "n_generated", "prefill_tok_s", "decode_tok_s"} <= set(
        tree
    )
    bad = subprocess.run(
        base + ["--draft", str(tiny_root / "nowhere")], capture_output=True, text=True, timeout=300
    )
    assert bad.returncode == 1 and bad.stderr.startswith("error:") and "Traceback" not in bad.stderr


def test_padded_append_counts_only_the_first_n_rows(qwen3, tiny_root):
    """A decode step appends its whole verify block (fixed shape, for CUDA graphs) with the accepted
    count n: the draft must then propose exactly as if only the n accepted rows had been appended,
    also once the ring has wrapped around several times."""
    gguf, target = qwen3
    draft = random_draft(gguf, target, tiny_root, layers=2)
    feats = target_features(target, draft, 80)
    padded, exact = draft.new_context(24, spare=9), draft.new_context(24)
    junk = 100 * torch.randn(9, feats.shape[1], generator=torch.Generator().manual_seed(0))
    lo = 0
    for n in [5, 1, 9, 3, 7, 2, 8, 4, 6, 9, 9, 1]:  # 64 positions in blocks of 9 rows
        draft.append_context(padded, torch.cat([feats[lo : lo + n], junk[: 9 - n]]), torch.tensor(n))
        draft.append_context(exact, feats[lo : lo + n])
        lo += n
        root = torch.tensor(lo % 50)
        torch.testing.assert_close(
            draft.propose(padded, root, 8), draft.propose(exact, root, 8), atol=1e-5, rtol=1e-5
        )
