"""Replayed decoding (train/replay.py) takes the same steps as decoding: every step's emitted count equal."""

import pytest
import torch

from flashtree.bench.hf_baseline import hf_model_from
from flashtree.config import SpecConfig
from flashtree.models.loader import load_target
from flashtree.train import data as D
from flashtree.train.forward import new_draft
from flashtree.train.replay import TeacherForcedDraft, replay, replay_draft
from flashtree.train.trainer import TrainConfig, Trainer
from tests.spec_util import OracleDraft, _Context, generate
from tests.test_spec import prompts
from tests.test_train import BLOCK, _shape
from tests.tiny import tiny_gguf

N_NEW = 48
SPECS = [
    dict(mode="chain", block_size=16),
    dict(mode="chain", block_size=4),
    dict(mode="tree", block_size=16, budget=22),
    dict(mode="tree", block_size=16, budget=22, chain_seed=False, draft_temperature=0.7),
    dict(mode="tree", block_size=8, budget=64, tree_top_k=3),
]


@pytest.fixture(scope="module", params=["llama", "qwen35"])
def target(request, tiny_root):
    gguf = tiny_gguf(request.param, 0, tiny_root)
    model, reader = load_target(gguf, device="cpu", dtype=torch.float32)
    return model, reader


def _oracle_logits_at(oracle: OracleDraft, block_size: int):
    def logits_at(p: int) -> torch.Tensor:
        ctx = _Context()
        ctx.length = p
        return oracle.propose(ctx, None, block_size)

    return logits_at


@pytest.mark.parametrize("error", [0.0, 0.15, 0.4])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_replay_takes_the_steps_decoding_takes_with_an_often_right_draft(target, spec, error):
    model, _ = target
    block = spec["block_size"]
    hists = []
    for i, prompt in enumerate(prompts(6, model.config.vocab, seed=7)):
        ar, _ = generate(model, None, prompt, N_NEW)
        oracle = OracleDraft(prompt + ar, model.config.vocab, block, error, seed=i)
        out, stats = generate(model, oracle, prompt, N_NEW, **spec)
        assert out == ar
        ids = torch.tensor(prompt + ar)
        (replayed,) = replay(ids, len(prompt), _oracle_logits_at(oracle, block), [SpecConfig(**spec)], block)
        assert (replayed.steps, replayed.accept_hist) == (stats.steps, stats.accept_hist), f"prompt {i}"
        hists.append(stats.accept_hist)
    lengths = {n for h in hists for n, c in enumerate(h) if c}
    covers_all = spec.get("budget", 0) >= 2 * (block - 1)  # room for the chain + every runner-up
    if error == 0 or (covers_all and error < 0.2):  # long accepted paths are replayed too
        assert max(lengths) == block
    else:  # and short ones, branching trees among them
        assert len(lengths) >= 3 and max(lengths) >= 4


def test_replay_of_a_dflash_draft_equals_its_decoding(target, tmp_path):
    """A real draft, trained a little on these very outputs so that it is often right: its teacher-forced
    logits equal propose's, and the replayed chain and tree steps equal the engine's, several specs from
    one pass."""
    model, reader = target
    prompt_ids = prompts(4, model.config.vocab, seed=11)
    outputs = [generate(model, None, prompt, N_NEW)[0] for prompt in prompt_ids]
    seqs = D.Sequences([torch.tensor(p + o) for p, o in zip(prompt_ids, outputs, strict=True)],
                       [len(p) for p in prompt_ids], [False] * len(prompt_ids))  # fmt: skip
    draft = new_draft(_shape(reader), model, seed=3)
    cfg = TrainConfig(block_size=BLOCK, anchors=16, batch=4, lr=3e-3, warmup_steps=5, steps=40)
    Trainer(draft, hf_model_from(model), seqs, cfg, tmp_path, log=lambda m: None).run()
    draft.requires_grad_(False)
    layers = draft.config.target_layer_ids
    specs = [
        SpecConfig(mode="chain", block_size=BLOCK),
        SpecConfig(mode="chain", block_size=4),
        SpecConfig(mode="tree", block_size=BLOCK, budget=12),
        SpecConfig(mode="tree", block_size=BLOCK, tree_top_k=2),
    ]
    hist = [0] * (BLOCK + 1)
    for prompt, ar in zip(prompt_ids, outputs, strict=True):
        ids, replayed = torch.tensor(prompt + ar), []
        feats = model(ids, model.new_state(128), capture=layers).features
        forced = TeacherForcedDraft(draft, feats, ids, BLOCK, chunk=16)
        for p in (len(prompt), len(prompt) + 17, len(ids) - 2):
            ctx = draft.new_context(128)
            draft.append_context(ctx, feats[:p])
            torch.testing.assert_close(forced(p), draft.propose(ctx, ids[p], BLOCK), atol=1e-4, rtol=1e-4)
        for block_size in (BLOCK, 4):  # the specs of one block size walk together over one pass
            same = [s for s in specs if s.block_size == block_size]
            replayed += zip(same, replay_draft(draft, feats, ids, len(prompt), same, block_size), strict=True)
        for spec, got in replayed:
            settings = {k: v for k, v in vars(spec).items() if k != "draft_ctx"}
            _, stats = generate(model, draft, prompt, N_NEW, **settings)
            assert (got.steps, got.accept_hist) == (stats.steps, stats.accept_hist), spec
            for n, c in enumerate(got.accept_hist):
                hist[n] += c
    assert sum(c > 0 for c in hist) >= 4 and hist[BLOCK] > 0  # short and full-block steps both replayed
