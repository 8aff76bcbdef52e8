"""Draft training: features, masks, loss, the batched training forward against DFlashDraft.propose,
the target-written data against our own greedy decoding, and a tiny run that learns.

Tiny random targets from tests/tiny.py (2 llama layers, hidden 64, vocab 320), fp32 on the CPU.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tiny import tiny_gguf
from typer.testing import CliRunner

import flashtree
from flashtree.bench.hf_baseline import hf_model_from
from flashtree.cli import app
from flashtree.config import SamplingParams
from flashtree.convert.shapes import gguf_tensors
from flashtree.convert.synth import draft_shape_for
from flashtree.defaults import default_draft_path, default_target_path
from flashtree.engine.generate import Engine
from flashtree.gguf.reader import GGUFFile
from flashtree.gguf.tokenizer import Tokenizer
from flashtree.models.dflash import load_draft
from flashtree.models.layers import Linear
from flashtree.models.loader import load_target
from flashtree.quant.formats import type_name
from flashtree.train import batch_decode
from flashtree.train import data as D
from flashtree.train.forward import draft_hidden, new_draft, save_draft
from flashtree.train.hf_target import hf_features
from flashtree.train.loss import (
    FrozenHeadCrossEntropy,
    block_attention_mask,
    dflash_loss,
    make_blocks,
    sample_anchors,
)
from flashtree.train.prompts import read_prompts, write_prompts
from flashtree.train.trainer import TrainConfig, Trainer, lr_at

BLOCK = 8


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and a busy shared CI machine loses a lot to them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _tiny_target(tiny_root, family: str):
    path = tiny_gguf(family, 0, tiny_root)
    model, gguf = load_target(path, "cpu", torch.float32)
    return path, model, gguf


@pytest.fixture(scope="module")
def tiny(tiny_root):
    return _tiny_target(tiny_root, "llama")


def _shape(gguf, layers=2, **changes):
    return replace(draft_shape_for(gguf, layers), block_size=BLOCK, **changes)


# --- target features -----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])  # tied and untied LM head
def test_hf_features_equal_our_captured_layers(tiny_root, seed):
    model, _ = load_target(tiny_gguf("llama", seed, tiny_root), "cpu", torch.float32)
    hf = hf_model_from(model)
    lengths = [11, 7]
    ids = torch.randint(0, model.config.vocab, (2, 11), generator=torch.Generator().manual_seed(seed))
    ids[1, 7:] = 0  # right padding: features of the real positions do not depend on it
    feats = hf_features(hf, ids, (0, 1))  # the last layer too: hooks, not hidden_states
    for row, n in enumerate(lengths):
        ours = model(ids[row, :n], model.new_state(32), capture=(0, 1)).features
        torch.testing.assert_close(feats[row, :n], ours, atol=1e-5, rtol=1e-5)
    ran = []  # layers above the deepest captured one do not run
    hook = hf.model.layers[1].register_forward_pre_hook(lambda *a: ran.append(1))
    torch.testing.assert_close(hf_features(hf, ids, (0,)), feats[..., : model.config.hidden])
    hook.remove()
    assert not ran


# --- blocks, masks, loss -------------------------------------------------------------------------------


def test_anchors_are_distinct_sorted_response_positions_with_a_successor():
    loss_mask = torch.zeros(3, 40, dtype=torch.bool)
    loss_mask[0, 10:40] = True
    loss_mask[1, 5:9] = True  # 3 candidates only (5, 6, 7)
    loss_mask[2, 30:31] = True  # a single response token: no candidate
    anchors, keep = sample_anchors(loss_mask, 6, torch.Generator().manual_seed(0))
    assert keep.sum(1).tolist() == [6, 3, 0]
    assert anchors[1][keep[1]].tolist() == [5, 6, 7]
    kept = anchors[0][keep[0]]
    assert kept.unique().numel() == 6 and (kept.diff() > 0).all()
    assert ((kept >= 10) & (kept <= 38)).all()


def test_blocks_labels_weights_and_mask():
    s, gamma = 20, 3.0
    ids = torch.arange(100, 100 + s)[None]
    loss_mask = torch.zeros(1, s, dtype=torch.bool)
    loss_mask[0, 6:] = True
    anchors, keep = torch.tensor([[6, 15, 0]]), torch.tensor([[True, True, False]])
    blocks = make_blocks(ids, loss_mask, anchors, keep, BLOCK, mask_token_id=7, gamma=gamma)

    assert blocks.ids.view(3, BLOCK)[0].tolist() == [106] + [7] * (BLOCK - 1)
    assert blocks.positions.view(3, BLOCK)[1].tolist() == list(range(15, 15 + BLOCK))
    assert blocks.labels[0, 0].tolist() == list(range(106, 106 + BLOCK))  # same position, no shift
    decay = [0.0] + [math.exp(-(k - 1) / gamma) for k in range(1, BLOCK)]
    torch.testing.assert_close(blocks.weights[0, 0], torch.tensor(decay))
    assert (blocks.weights[0, 1, 5:] == 0).all() and (blocks.weights[0, 1, 1:5] > 0).all()  # past the end
    assert (blocks.weights[0, 2] == 0).all()  # padding block

    mask = blocks.mask[0]  # (3 * B, S + 3 * B)
    assert mask.shape == (3 * BLOCK, s + 3 * BLOCK)
    assert mask[:BLOCK, :s].sum(1).tolist() == [6] * BLOCK  # context strictly before the anchor
    assert mask[BLOCK : 2 * BLOCK, :s].sum(1).tolist() == [15] * BLOCK
    own = torch.block_diag(*[torch.ones(BLOCK, BLOCK, dtype=torch.bool)] * 3)
    assert torch.equal(mask[:, s:], own)  # bidirectional inside a block, other blocks invisible
    assert torch.equal(block_attention_mask(anchors, s, BLOCK), blocks.mask)


def test_loss_is_the_weighted_mean_ce_and_accept_len_counts_the_correct_prefix():
    vocab = 16
    ids = torch.randint(0, vocab, (1, 24), generator=torch.Generator().manual_seed(3))
    loss_mask = torch.ones(1, 24, dtype=torch.bool)
    blocks = make_blocks(
        ids, loss_mask, torch.tensor([[2, 12]]), torch.ones(1, 2, dtype=torch.bool), BLOCK, 0, 7.0
    )
    hidden = torch.randn(1, 2 * BLOCK, vocab, generator=torch.Generator().manual_seed(4))
    labels = blocks.labels.view(-1)
    hidden.view(-1, vocab)[:11, :] = -5.0
    hidden.view(-1, vocab)[torch.arange(11), labels[:11]] = 5.0  # block 0: tokens 1..7 right; block 1: 1..2
    hidden.view(-1, vocab)[11, :] = 0.0
    hidden.view(-1, vocab)[11, (labels[11] + 1) % vocab] = 9.0  # block 1, k = 3 wrong
    out = dflash_loss(hidden, Linear(torch.eye(vocab)), blocks)

    w = blocks.weights.view(-1)
    ce = torch.nn.functional.cross_entropy(hidden.view(-1, vocab), labels, reduction="none")
    torch.testing.assert_close(out.loss, (ce * w).sum() / w.sum())
    assert out.accept_len == pytest.approx((BLOCK + 3) / 2)  # (1 + 7 + 1 + 2) / 2


@pytest.mark.parametrize("chunk_rows", [1000, 7])  # one chunk; several, the last one short
def test_frozen_head_cross_entropy_equals_autograd_through_the_logits(monkeypatch, chunk_rows):
    vocab, hidden_size, n = 40, 12, 30
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(vocab, hidden_size, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    w = torch.rand(n, generator=gen, dtype=torch.float64)
    h = torch.randn(n, hidden_size, generator=gen, dtype=torch.float64, requires_grad=True)
    monkeypatch.setattr(FrozenHeadCrossEntropy, "CHUNK_ELEMENTS", chunk_rows * vocab)
    loss, correct = FrozenHeadCrossEntropy.apply(h, weight, labels, w)
    (3.0 * loss).backward()
    got = h.grad.clone()
    h.grad = None
    logits = h @ weight.t()
    want = (torch.nn.functional.cross_entropy(logits, labels, reduction="none") * w).sum()
    (3.0 * want).backward()
    torch.testing.assert_close(loss, want.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, h.grad, rtol=1e-10, atol=1e-12)
    assert correct.tolist() == (logits.argmax(-1) == labels).tolist()


# --- training forward == inference -----------------------------------------------------------------


@pytest.mark.parametrize("window", [None, 6])
def test_training_forward_equals_propose_per_block(tiny, window):
    _, model, gguf = tiny
    dflash = (
        dict(layer_types=("sliding_attention", "full_attention"), sliding_window=window) if window else {}
    )
    draft = new_draft(_shape(gguf, **dflash), model, seed=1, from_target=False)  # every weight random
    with torch.no_grad():  # norms away from 1 so that a missing norm would show
        for p in draft.parameters():
            if p.ndim == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    s = 30
    ids = torch.randint(0, model.config.vocab, (2, s), generator=torch.Generator().manual_seed(5))
    layers = draft.config.target_layer_ids
    feats = torch.stack([model(ids[r], model.new_state(64), capture=layers).features for r in range(2)])
    anchors = torch.tensor([[4, 19], [0, 22]])
    mask_id = draft.config.mask_token_id
    blocks = make_blocks(
        ids, torch.ones_like(ids, dtype=torch.bool), anchors, anchors >= 0, BLOCK, mask_id, 7.0
    )
    with torch.no_grad():
        logits = model.lm_head(draft_hidden(draft, feats, blocks.ids, blocks.positions, blocks.mask)).float()
    for row in range(2):
        for n, anchor in enumerate(anchors[row].tolist()):
            ctx = draft.new_context(64)
            if anchor:
                draft.append_context(ctx, feats[row, :anchor])
            ref = draft.propose(ctx, ids[row, anchor], BLOCK)  # (B - 1, V)
            got = logits[row, n * BLOCK + 1 : (n + 1) * BLOCK]
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen35"])
def test_new_draft_starts_from_the_target_top_layers(tiny_root, arch):
    model, gguf = load_target(tiny_gguf(arch, 0, tiny_root), "cpu", torch.float32)
    draft = new_draft(_shape(gguf), model, seed=0)
    hidden = model.config.hidden
    torch.testing.assert_close(draft.norm.weight, model.norm.weight, atol=0, rtol=0)
    fc = draft.fc.weight  # (H, 3H): passes the last captured layer through, the others start at zero
    torch.testing.assert_close(fc[:, -hidden:], torch.eye(hidden), atol=0, rtol=0)
    assert not fc[:, :-hidden].any()
    n_copied = 0
    for d, t in zip(draft.layers, model.layers[-len(draft.layers) :], strict=True):
        pairs = [(d.mlp.gate, t.mlp.gate), (d.mlp.up, t.mlp.up), (d.mlp.down, t.mlp.down)]
        pairs += (
            [(d.q, t.mixer.q), (d.k, t.mixer.k), (d.v, t.mixer.v), (d.o, t.mixer.o)]
            if hasattr(t.mixer, "o")
            else []
        )
        torch.testing.assert_close(d.attn_norm.weight, t.mixer_norm.weight, atol=0, rtol=0)
        for ours, theirs in pairs:
            if ours.weight.shape == theirs.weight.shape:
                torch.testing.assert_close(ours.weight, theirs.weight, atol=0, rtol=0)
                n_copied += 1
            else:  # qwen35's gated q: random, at the init scale
                assert abs(ours.weight.std().item() - 0.02) < 0.005
    assert n_copied >= 3 * len(draft.layers)


def test_target_init_learns_faster_than_random(tiny, tiny_data, tmp_path):
    """The point of starting from the target: after the same few steps the loss is lower."""
    _, model, gguf = tiny
    hf = hf_model_from(model).requires_grad_(False)
    cfg = TrainConfig(block_size=BLOCK, anchors=4, batch=4, lr=1e-3, warmup_steps=2, steps=12, log_every=12)
    losses = {}
    for from_target in (True, False):
        out = tmp_path / str(from_target)
        out.mkdir()
        draft = new_draft(_shape(gguf), model, seed=0, from_target=from_target)
        Trainer(draft, hf, tiny_data, cfg, out, log=lambda m: None).run()
        losses[from_target] = json.loads((out / "train_log.jsonl").read_text().splitlines()[-1])["loss"]
    assert losses[True] < losses[False]


def test_checkpoints_leave_a_loadable_snapshot_of_the_draft(tiny, tiny_data, tmp_path):
    """A run cut short (the GPU machine taken back) still leaves the draft of its last checkpoint."""
    _, model, gguf = tiny
    shape = _shape(gguf)
    cfg = TrainConfig(block_size=BLOCK, anchors=4, batch=4, lr=1e-3, warmup_steps=2, steps=6)
    draft = new_draft(shape, model, seed=0)
    trainer = Trainer(
        draft, hf_model_from(model), tiny_data, cfg, tmp_path, log=lambda m: None,
        export=lambda d: save_draft(draft, d),
    )  # fmt: skip
    batches = D.iterate_batches(tiny_data, cfg.batch, cfg.seed, 0)
    for step in (1, 3):
        while trainer.step < step:
            trainer.train_step(next(batches))
        trainer.save_checkpoint()
        assert (tmp_path / "snapshot" / "step").read_text() == f"{step}\n"
        assert not (tmp_path / "snapshot.tmp").exists()
        loaded = load_draft(tmp_path / "snapshot", model)
        for a, b in zip(draft.state_dict().values(), loaded.state_dict().values(), strict=True):
            torch.testing.assert_close(b, a.to(torch.bfloat16).float() if a.ndim == 2 else a)


def test_saved_draft_loads_with_load_draft(tiny, tmp_path):
    _, model, gguf = tiny
    shape = _shape(gguf)
    draft = new_draft(shape, model, seed=2)
    save_draft(draft, tmp_path / "d")
    loaded = load_draft(tmp_path / "d", model)
    assert loaded.config.block_size == BLOCK and loaded.config.n_layers == 2
    for a, b in zip(draft.state_dict().values(), loaded.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a.to(torch.bfloat16).float() if a.ndim == 2 else a)  # bf16 matrices


# --- data ----------------------------------------------------------------------------------------------


def test_batched_hf_responses_equal_our_greedy_decoding(tiny):
    path, model, gguf = tiny
    tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    texts = ["def add(a, b):", "What is 7 * 6? Explain step by step."]  # different lengths: left padding
    prompts = [D.chat_prompt_ids(tokenizer, t) for t in texts]
    stop = [tokenizer.eos_id]
    responses = D.generate_responses(hf_model_from(model), prompts, 12, stop)
    engine = Engine(model, tokenizer)
    for prompt, response, text in zip(prompts, responses, texts, strict=True):
        assert prompt == engine.encode(text)
        ours = [t for step in engine.generate(prompt, 12, SamplingParams(), stop) for t in step]
        assert response == ours


def _hf_generate(hf, prompts, max_new_tokens, stop_ids):
    """Reference: transformers' greedy `generate` on the left-padded batch, cut at the first stop."""
    width = max(map(len, prompts))
    ids = torch.tensor([[stop_ids[0]] * (width - len(p)) + p for p in prompts])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(input_ids=ids, attention_mask=attention, max_new_tokens=max_new_tokens, do_sample=False,
                      pad_token_id=stop_ids[0], eos_token_id=stop_ids)  # fmt: skip
    return [batch_decode.cut_at_stop(row, stop_ids) for row in out[:, width:].tolist()]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_batch_decoding_equals_transformers_generate_with_rows_dropped_as_they_stop(tiny_root, family):
    """Greedy decode_batch == transformers' generate on prompts of 3..40 tokens (left padding), with the
    stop tokens chosen so that rows end at different steps: dropping finished rows (at every quarter, or
    never) must not change any row."""
    _, model, _ = _tiny_target(tiny_root, family)
    hf = hf_model_from(model)
    assert batch_decode.supports(hf)
    gen = torch.Generator().manual_seed(5)
    lengths = (3, 17, 40, 9, 25, 5)
    prompts = [torch.randint(3, model.config.vocab, (n,), generator=gen).tolist() for n in lengths]
    free = _hf_generate(hf, prompts, 20, [0])
    stop_ids = [0]
    first_step = {}  # token -> the earliest step any row emits it
    for row in free:
        for k, t in enumerate(row):
            first_step[t] = min(k, first_step.get(t, k))
    for token in sorted(first_step, key=first_step.get, reverse=True):  # stops that add a response length
        lengths = {len(batch_decode.cut_at_stop(r, stop_ids + [token])) for r in free}
        if 20 in lengths and len(lengths) > len({len(batch_decode.cut_at_stop(r, stop_ids)) for r in free}):
            stop_ids.append(token)
    want = _hf_generate(hf, prompts, 20, stop_ids)
    assert len({len(r) for r in want}) >= 3 and max(map(len, want)) == 20  # rows end at different steps
    for compact_at in (0.25, 1.0):
        got = batch_decode.decode_batch(hf, prompts, 20, stop_ids, SamplingParams(), compact_at=compact_at)
        assert got == want


def test_batch_decoding_samples_rows_independently_and_top_p_cuts(tiny):
    _, model, _ = tiny
    hf = hf_model_from(model)
    prompts = [[5, 6, 7, 8]] * 16
    torch.manual_seed(0)
    sampled = batch_decode.decode_batch(hf, prompts, 8, [0], SamplingParams(temperature=1.5))
    assert len({tuple(r) for r in sampled}) > 8  # the same prompt, different draws per row
    nucleus = batch_decode.decode_batch(hf, prompts, 8, [0], SamplingParams(temperature=1.5, top_p=1e-6))
    assert nucleus == batch_decode.decode_batch(hf, prompts, 8, [0], SamplingParams())  # only the top-1


def test_shards_round_trip_and_short_responses_are_dropped(tmp_path):
    D.write_shard(tmp_path / D.SHARD.format(0), [[1, 2, 3], [4]], [[5] * 20, [6, 7]], sampled=False)
    D.write_shard(tmp_path / D.SHARD.format(1), [[8, 9]], [[10] * 16], sampled=True)
    seqs = D.load_sequences([tmp_path], min_response=16)
    assert [t.tolist() for t in seqs.tokens] == [[1, 2, 3] + [5] * 20, [8, 9] + [10] * 16]
    assert seqs.prompt_lens == [3, 2] and seqs.n_response_tokens == 36
    ids, response = D.collate(seqs, [1, 0], "cpu")
    assert ids.shape == (2, 23) and ids[0, 18:].tolist() == [0] * 5
    assert response[0].tolist() == [False] * 2 + [True] * 16 + [False] * 5


def test_generation_jobs_cover_every_prompt_once_per_pass():
    prompts = [[i] * (1 + i % 7) for i in range(50)]
    jobs = D.generation_jobs(prompts, 8, sampled_every=3, seed=1, passes=3)
    assert [j.index for j in jobs] == list(range(21))
    for p in range(3):
        in_pass = jobs[7 * p : 7 * (p + 1)]
        assert sorted(x for j in in_pass for x in j.prompts) == sorted(prompts)
        assert [j.sampled for j in in_pass] == (([False, False, True] * 3)[:7] if p == 0 else [True] * 7)
    assert [j.prompts for j in jobs[:7]] != [j.prompts for j in jobs[7:14]]  # each pass its own order
    assert D.generation_jobs(prompts, 8, 3, seed=1) == jobs[:7]  # one pass: the first


def test_prompt_files_round_trip(tmp_path):
    records = [{"source": "x", "text": "hello"}, {"text": "wörld\nwith lines"}]
    write_prompts(records, tmp_path / "p.jsonl.gz")
    assert read_prompts(tmp_path / "p.jsonl.gz") == records


# --- a tiny run ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_data(tiny, tmp_path_factory):
    """Responses of the tiny target to a few prompts (greedy and sampled), as shards."""
    _, model, gguf = tiny
    tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    texts = [f"Question: what is {i} * {i + 1}? Answer step by step." for i in range(12)]
    prompts = [D.chat_prompt_ids(tokenizer, t) for t in texts]
    out = tmp_path_factory.mktemp("tiny-data")
    jobs = D.generation_jobs(prompts, 6, sampled_every=2, seed=0)
    D.generate_dataset(
        hf_model_from(model), jobs, out, 48, [tokenizer.eos_id], 0.8, 0.95, 0, log=lambda m: None
    )
    return D.load_sequences([out], min_response=2 * BLOCK)


def test_tiny_run_lowers_loss_raises_accept_len_and_resumes(tiny, tiny_data, tmp_path):
    _, model, gguf = tiny
    hf = hf_model_from(model)
    cfg = TrainConfig(block_size=BLOCK, anchors=8, batch=4, lr=3e-3, warmup_steps=5, steps=60, log_every=5)
    probe = [list(range(4)), list(range(4, 8))]
    draft = new_draft(_shape(gguf), model, seed=0)
    start = [Trainer(draft, hf, tiny_data, cfg, tmp_path / "probe").train_step(b) for b in probe]

    _, greedy = D.hold_out(tiny_data, len(tiny_data), seed=0)  # validated on, here trained on too
    before = Trainer(draft, hf, tiny_data, cfg, tmp_path / "probe", val={"val": greedy}).validate()
    first = Trainer(draft, hf, tiny_data, cfg, tmp_path, log=lambda m: None)
    batches = D.iterate_batches(tiny_data, cfg.batch, cfg.seed, 0)
    for _ in range(30):  # half the run, then a checkpoint: as if the machine went away
        first.train_step(next(batches))
    first.save_checkpoint()
    resumed = Trainer(
        new_draft(_shape(gguf), model, seed=9),
        hf,
        tiny_data,
        cfg,
        tmp_path,
        log=lambda m: None,
        val={"val": greedy},
    )
    assert resumed.step == 30 and resumed.progress == 0.5
    for a, b in zip(draft.state_dict().values(), resumed.draft.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b)
    resumed.run()  # the second half of the same schedule
    assert resumed.step == 60
    end = [resumed.train_step(b) for b in probe]

    loss0, loss1 = (sum(s["loss"] for s in x) / 2 for x in (start, end))
    acc0, acc1 = (sum(s["accept_len"] for s in x) / 2 for x in (start, end))
    assert loss1 < 0.7 * loss0, (loss0, loss1)
    assert acc1 > acc0 + 0.5, (acc0, acc1)
    # replayed decoding of the greedy sequences, at the resumed run's start and its last checkpoint
    validated = [json.loads(line) for line in (tmp_path / "val_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in validated] == [30, 60]
    for key in ("val_chain_al", "val_tree_al"):
        assert validated[-1][key] > before[key] + 0.5, (key, before, validated)
    logged = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(35, 61, 5))
    phases = ("ms_features", "ms_forward", "ms_backward", "ms_optimizer")
    assert all(r[p] >= 0 for r in logged for p in phases)  # where each step's time went
    assert logged[-1]["lr"] < 0.05 * cfg.lr  # the cosine ran to its end


def test_run_validates_each_checkpoint_once(tiny, tiny_data, tmp_path):
    """A timed checkpoint at the last step is the final one: the end neither saves nor validates again."""
    _, model, gguf = tiny
    cfg = TrainConfig(block_size=BLOCK, anchors=8, batch=4, steps=3, checkpoint_every=0.0)
    _, greedy = D.hold_out(tiny_data, 2, seed=0)
    draft = new_draft(_shape(gguf), model, seed=0)
    val = {"val": greedy, "empty": D.Sequences([], [], [])}  # an empty set is not validated
    Trainer(draft, hf_model_from(model), tiny_data, cfg, tmp_path, log=lambda m: None, val=val).run()
    validated = [json.loads(line) for line in (tmp_path / "val_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in validated] == [0, 1, 2, 3]
    assert all(r.keys() == {"step", "progress", "val_chain_al", "val_tree_al"} for r in validated)


def test_time_limited_schedule_follows_training_seconds():
    cfg = TrainConfig(lr=1.0, warmup_steps=10, time_limit=100.0)
    assert lr_at(0, 0.0, cfg) == pytest.approx(0.1)  # warmup by steps
    assert lr_at(50, 0.5, cfg) == pytest.approx(0.5)  # cosine by progress
    assert lr_at(500, 1.0, cfg) == pytest.approx(0.0)


def test_train_draft_command_writes_a_loadable_draft(tiny, tmp_path):
    path, model, _ = tiny
    write_prompts([{"text": f"Say {i} words about trees."} for i in range(4)], tmp_path / "p.jsonl.gz")
    out = tmp_path / "run"
    args = ["train-draft", "--target", str(path), "--out", str(out), "--layers", "1", "--block-size", "8",
            "--prompts", str(tmp_path / "p.jsonl.gz"), "--max-new-tokens", "24", "--gen-batch", "4",
            "--steps", "2", "--batch", "2", "--anchors", "4", "--dev-prompts", "1",
            "--device", "cpu"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    draft = load_draft(out, model)
    assert draft.config.n_layers == 1 and draft.config.block_size == 8
    gguf = load_draft(out / "draft.gguf", model)  # llama.cpp's layout: the same draft, bit for bit
    assert gguf.config == replace(draft.config, n_target_layers=None)
    ours, theirs = draft.state_dict(), gguf.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert (out / "checkpoint.pt").is_file() and len(list((out / "data").glob("shard-*.pt"))) == 1
    # validated at the start and the end on held-out responses and on one development prompt per set
    assert "validation: 3 greedy responses to benchmark development prompts" in result.output, result.output
    validated = [json.loads(line) for line in (out / "val_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in validated] == [0, 2]
    for row in validated:
        assert {"val_chain_al", "val_tree_al", "dev_chain_al", "dev_tree_al"} <= row.keys()
        assert all(row[k] >= 1.0 for k in ("dev_chain_al", "dev_tree_al")), row


def test_train_draft_adds_the_responses_of_extra_data_dirs(tiny, tmp_path):
    """--extra-data: an earlier run's responses join this run's (a lease trains on what earlier leases
    generated); a dir without shards is refused before any generation."""
    path, _, _ = tiny
    write_prompts([{"text": f"Count to {i}."} for i in range(3)], tmp_path / "p.jsonl.gz")
    extra = tmp_path / "earlier" / "data"
    extra.mkdir(parents=True)
    D.write_shard(extra / D.SHARD.format(0), [[1, 2], [3]], [[5] * (2 * BLOCK), [6] * 40], sampled=False)
    out = tmp_path / "run"
    args = ["train-draft", "--target", str(path), "--out", str(out), "--layers", "1", "--block-size",
            str(BLOCK), "--prompts", str(tmp_path / "p.jsonl.gz"), "--max-new-tokens", "40", "--steps", "1",
            "--batch", "2", "--anchors", "4", "--device", "cpu"]  # fmt: skip
    result = CliRunner().invoke(app, [*args, "--extra-data", str(extra)])
    assert result.exit_code == 0, result.output
    own = len(D.load_sequences([out / "data"], min_response=2 * BLOCK))
    assert f"data: {own + 2} sequences" in result.output, result.output

    empty = tmp_path / "empty"
    empty.mkdir()
    args[args.index("--out") + 1] = str(tmp_path / "run2")
    result = CliRunner().invoke(app, [*args, "--extra-data", str(empty)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "--extra-data" in result.output and "no shard-*.pt" in result.output, result.output
    assert not (tmp_path / "run2" / "data").exists()


def test_train_draft_goes_on_from_a_draft_given_with_init(tiny, tmp_path):
    """--init: training continues from a trained draft (a later session's run starts where the last
    one stopped); a draft of another shape is refused before any generation."""
    path, model, gguf = tiny
    shape = _shape(gguf)
    trained = new_draft(shape, model, seed=3, from_target=False)
    save_draft(trained, tmp_path / "trained")
    loaded = load_draft(tmp_path / "trained", model)
    again = new_draft(shape, model, seed=4, init=loaded)
    for a, b in zip(trained.state_dict().values(), again.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a.to(torch.bfloat16).float() if a.ndim == 2 else a)  # bf16 matrices
    assert all(p.requires_grad for p in again.parameters())

    write_prompts([{"text": "Say hi."}], tmp_path / "p.jsonl.gz")
    out = tmp_path / "run"
    args = ["train-draft", "--target", str(path), "--out", str(out), "--layers", "1", "--block-size",
            str(BLOCK), "--init", str(tmp_path / "trained"), "--prompts", str(tmp_path / "p.jsonl.gz"),
            "--steps", "1", "--device", "cpu"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "n_layers 2 (want 1)" in result.output, result.output
    assert not (out / "data").exists()


# --- the shipped draft ---------------------------------------------------------------------------------


def test_shipped_draft_is_the_default_and_matches_what_train_draft_writes_for_smollm2():
    """The shipped draft: a Q8_0 GGUF (<= 24 MB) of exactly the shape train-draft gives SmolLM2 for its
    layer count, loadable next to the default target."""
    path = default_draft_path()
    assert path is not None and path.parent.parent == Path(flashtree.__file__).parent
    assert path.stat().st_size <= 24_000_000
    with GGUFFile(path) as draft, GGUFFile(default_target_path(progress=False)) as target:
        assert draft.arch == "dflash"  # llama.cpp's layout, its target's tokenizer inside
        assert draft.get("tokenizer.ggml.tokens") == target.get("tokenizer.ggml.tokens")
        n_layers = int(draft.get("dflash.block_count"))
        shape = draft_shape_for(target, n_layers)
        names = {"hidden_norm.weight": "enc.output_norm.weight"}
        assert {name: info.shape for name, info in draft.tensors.items()} == {
            names.get(spec.name, spec.name): tuple(spec.shape) for spec in gguf_tensors(shape)
        }
        matrices = {type_name(info.qtype) for info in draft.tensors.values() if len(info.shape) == 2}
        assert matrices == {"Q8_0"}
    model, _ = load_target(default_target_path(progress=False), device="cpu")
    loaded = load_draft(path, model)
    assert loaded.config == replace(shape, n_target_layers=None)  # llama.cpp's layout does not record it
