"""Self-written prompts (train/self_prompts.py, issue #43): the user prefix of a chat template, the
target's seeded user turns, the filters, the held-out split and train-draft's --self-prompts."""

from __future__ import annotations

import json
from itertools import islice

import pytest
import torch
from tiny import tiny_gguf
from typer.testing import CliRunner

from flashtree.bench.datasets import question_texts
from flashtree.cli import app
from flashtree.defaults import default_target_path
from flashtree.engine.generate import Engine
from flashtree.errors import FlashtreeError
from flashtree.gguf.reader import GGUFFile
from flashtree.gguf.tokenizer import Tokenizer
from flashtree.models.loader import load_target
from flashtree.train import self_prompts as S
from flashtree.train.prompts import read_prompts, write_prompts

SMOL_PREFIX = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\n"
)


@pytest.fixture(scope="module")
def tiny_engine(tiny_root):
    model, gguf = load_target(tiny_gguf("llama", 0, tiny_root), "cpu", torch.float32)
    return Engine(model, Tokenizer.from_gguf_metadata(gguf.metadata), max_ctx=128)


def test_user_prefix_of_the_smollm2_template_holds_its_default_system_turn():
    with GGUFFile(default_target_path(progress=False)) as gguf:
        tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    assert S.user_prefix(tokenizer) == SMOL_PREFIX
    assert {"<|im_start|>", "<|im_end|>", "<|endoftext|>"} <= S.control_texts(tokenizer)


def test_user_prefix_of_a_tiny_template_and_one_that_drops_the_content(tiny_engine):
    tokenizer = tiny_engine.tokenizer
    assert S.user_prefix(tokenizer) == "<|im_start|>user\n"
    assert S.control_texts(tokenizer) == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}

    class NoContent:
        def apply_chat_template(self, messages, add_generation_prompt):
            return "<|im_start|>user\n<|im_end|>\n"

    with pytest.raises(FlashtreeError, match="content"):
        S.user_prefix(NoContent())


def test_user_turns_are_seeded_resumable_and_sampled_from_the_prefix(tiny_engine):
    def take(settings, start=0, n=4):
        return list(islice(S.sample_user_turns(tiny_engine, settings, start), n))

    settings = S.SampleSettings(seed=3, max_tokens=6)
    first = take(settings)
    assert [t["index"] for t in first] == [0, 1, 2, 3]
    assert take(settings) == first  # seeded
    assert take(settings, start=2, n=2) == first[2:]  # a resumed run draws what the first would have
    assert len({t["text"] for t in first}) > 1  # sampled, not greedy
    other = take(S.SampleSettings(seed=4, max_tokens=6))
    assert [t["text"] for t in other] != [t["text"] for t in first]
    for t in first:  # a turn is cut at max_tokens unless it ended before
        assert (t["n_tokens"] < 6) if t["ended"] else (t["n_tokens"] == 6)


def test_batched_user_turns_are_seeded_resumable_at_a_batch_and_records_like_single_ones(tiny_engine):
    from flashtree.bench.hf_baseline import hf_model_from

    hf = hf_model_from(tiny_engine.target)

    def take(settings, start=0, n=6):
        turns = S.sample_user_turns_batched(hf, tiny_engine.tokenizer, settings, start, batch=3)
        return list(islice(turns, n))

    settings = S.SampleSettings(seed=3, max_tokens=6)
    first = take(settings)
    assert [t["index"] for t in first] == list(range(6))
    assert take(settings) == first  # seeded
    assert take(settings, start=3, n=3) == first[3:]  # a run resumed at a batch boundary
    assert len({t["text"] for t in first}) > 1  # sampled, not greedy
    assert [t["text"] for t in take(S.SampleSettings(seed=4, max_tokens=6))] != [t["text"] for t in first]
    single = next(S.sample_user_turns(tiny_engine, settings))
    for t in first:
        assert t.keys() == single.keys()
        assert (t["n_tokens"] < 6) if t["ended"] else (t["n_tokens"] == 6)
    prefix = tiny_engine.tokenizer.encode(S.user_prefix(tiny_engine.tokenizer), add_bos=False)
    greedy = take(S.SampleSettings(seed=3, temperature=0.0, max_tokens=6), n=3)
    want = [t for step in tiny_engine.generate(prefix, 6) for t in step]  # the engine's greedy turn
    assert all(g == S._turn(tiny_engine.tokenizer, g["index"], want) for g in greedy)  # the same decoding


def test_a_turn_ends_at_the_stop_token_which_is_not_in_its_text(tiny_engine):
    tokenizer = tiny_engine.tokenizer
    end, start = tokenizer.eos_id, tokenizer.encode("<|im_start|>", add_bos=False)
    assert tokenizer.is_special(start[0]) and len(start) == 1
    words = tokenizer.encode("The quick brown fox", add_bos=False)
    scripted = iter([words + [end], words + start + words, words])

    class Scripted:
        def __init__(self):
            self.tokenizer = tokenizer
            self.prompts = []

        def generate(self, prompt, max_tokens, sampling):
            self.prompts.append(prompt)
            yield next(scripted)

    engine = Scripted()
    turns = list(islice(S.sample_user_turns(engine, S.SampleSettings(max_tokens=99)), 3))
    assert engine.prompts[0] == tokenizer.encode("<|im_start|>user\n", add_bos=False)
    assert turns[0] == {"index": 0, "text": "The quick brown fox", "n_tokens": len(words), "ended": True,
                        "specials": 0}  # fmt: skip
    assert turns[1]["specials"] == 1 and "<|im_start|>" in turns[1]["text"] and not turns[1]["ended"]
    assert not turns[2]["ended"]


def _sample(text: str, ended: bool = True, specials: int = 0) -> dict:
    return {"index": 0, "text": text, "n_tokens": 10, "ended": ended, "specials": specials}


def test_filters_drop_each_kind_of_bad_turn_and_keep_the_rest():
    good = [
        "Can you help me plan a three day trip to Lisbon on a small budget?",
        "Write a Python function that checks whether a string is a palindrome.",
        "What are some good ways to learn to play the guitar as an adult?",
    ]
    bench = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."
    samples = [
        _sample(f"  {good[0]}\n"),
        _sample("Tell me a story about a dragon who is afraid of the dark", ended=False),  # truncated
        _sample("Summarize this text for me please <|im_end|> now", specials=0),  # control token as text
        _sample("Summarize this article for me please, in three lines", specials=1),  # as a token
        _sample("Hi there!"),  # too short
        _sample("Explain " + "the theory of everything " * 80),  # too long
        _sample("¿Puedes ayudarme a escribir una carta de presentación para un trabajo?"),  # not ASCII
        _sample("Kannst du mir bitte helfen, einen Brief zu schreiben?"),  # no English word
        _sample("=== +++ ### 123 456 789 %%% &&& the"),  # symbols, not words
        _sample(bench.upper()),  # a benchmark question, case aside
        _sample(bench + " Help!"),  # a near copy of it
        _sample(good[1]),
        _sample(good[1].lower() + "  "),  # the same text normalized
        _sample(good[1] + " Thanks!"),  # a near copy
        _sample(good[2]),
    ]
    kept, counts = S.filter_prompts(samples, ["<|im_start|>", "<|im_end|>"], [bench, "def f(x):\n    pass"])
    assert [r["text"] for r in kept] == good
    assert counts == {"samples": 15, "truncated": 1, "control_tokens": 2, "length": 2, "not_english": 3,
                      "benchmark": 2, "duplicate": 2, "kept": 3}  # fmt: skip
    assert S.filter_prompts(samples, ["<|im_end|>"], [bench]) == (kept, counts)  # deterministic


def test_near_duplicate_index_finds_exactly_the_pairs_above_the_threshold():
    """Prefix filtering probes only a few shingles: it must still find every pair a brute-force Jaccard
    finds."""
    import random

    rng = random.Random(0)
    bases = [[f"w{rng.randrange(50)}" for _ in range(rng.randint(6, 14))] for _ in range(20)]
    texts = []
    for _ in range(400):  # edits of a few base texts: pairs at every similarity
        words = list(rng.choice(bases))
        for _ in range(rng.randint(0, 3)):
            words[rng.randrange(len(words))] = f"w{rng.randrange(50)}"
        texts.append(" ".join(words))
    index, near = S.ShingleIndex(0.6), 0
    for text in texts:
        mine = S.ShingleIndex.shingles(text)
        brute = any(len(mine & o) >= 0.6 * len(mine | o) for o in index.sets)
        assert index.match(text) == brute, text
        near += brute and mine not in index.sets
        index.add(text)
    assert near > 20  # similar, not equal


def test_benchmark_questions_are_the_bare_texts_of_each_set():
    humaneval, gsm8k, math500 = (question_texts(n) for n in ("humaneval", "gsm8k", "math500"))
    assert (len(humaneval), len(gsm8k), len(math500)) == (164, 1319, 500)
    assert "def " in humaneval[0] and "Please reason" not in gsm8k[0] + math500[0]
    kept, counts = S.filter_prompts([_sample(gsm8k[5])], [], gsm8k)
    assert not kept and counts["benchmark"] == 1


def test_split_is_stable_disjoint_and_about_a_tenth():
    texts = [f"Please explain how topic number {i} works in practice." for i in range(2000)]
    records = [{"text": t} for t in texts]
    train, held = S.split(records)
    assert {r["text"] for r in train}.isdisjoint(r["text"] for r in held)
    assert len(train) + len(held) == len(records)
    assert 0.07 < len(held) / len(records) < 0.13
    _, held_again = S.split(records[::-1][:1000])  # another file's order and contents: the same split
    assert {r["text"] for r in held_again} == {r["text"] for r in held} & set(texts[1000:])
    assert S.is_held_out(held[0]["text"].upper() + " ")  # by the normalized text
    assert S.sample_seed(0, 1) != S.sample_seed(1, 0) and S.sample_seed(0, 1) == S.sample_seed(0, 1)


def test_pool_gets_training_split_prompts_and_never_held_out_ones():
    records = [{"text": f"How do I cook dish number {i} at home?"} for i in range(200)]
    held = {r["text"] for r in records if S.is_held_out(r["text"])}
    assert held
    pool = [{"source": "math", "text": f"Solve {i}."} for i in range(5)] + [
        {"source": "x", "text": records[0]["text"]}
    ]
    mixed = S.with_self_prompts(pool, records, None, seed=0)
    added = [r["text"] for r in mixed if r["source"] == S.SOURCE]
    assert len(added) == 200 - len(held) - (records[0]["text"] not in held) and not held & set(added)
    assert records[0]["text"] not in added  # the pool had it already
    assert all(r in mixed for r in pool) and mixed[: len(pool)] != pool  # shuffled in
    capped = S.with_self_prompts(pool, records, 7, seed=0)
    assert sum(r["source"] == S.SOURCE for r in capped) == 7 and len(capped) == len(pool) + 7
    assert S.with_self_prompts(pool, records, 7, seed=0) == capped


def test_train_draft_adds_self_prompts_but_not_held_out_ones(tiny_root, tmp_path):
    path = tiny_gguf("llama", 0, tiny_root)
    write_prompts([{"text": "Say hi."}], tmp_path / "p.jsonl.gz")
    texts = [f"Tell me about tree number {i}." for i in range(40)]
    (tmp_path / "self.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    n_train = sum(not S.is_held_out(t) for t in texts)
    assert n_train < 40
    out = tmp_path / "run"
    args = ["train-draft", "--target", str(path), "--out", str(out), "--layers", "1", "--block-size", "8",
            "--prompts", str(tmp_path / "p.jsonl.gz"), "--self-prompts", str(tmp_path / "self.jsonl"),
            "--n-self-prompts", "5", "--max-new-tokens", "24", "--gen-batch", "64", "--steps", "1",
            "--batch", "2", "--anchors", "2", "--val-sequences", "0", "--device", "cpu"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "prompts: 5 self-written ones added" in result.output, result.output
    shards = list((out / "data").glob("shard-*.pt"))
    assert sum(len(torch.load(s)["prompt_lens"]) for s in shards) == 6
    assert read_prompts(tmp_path / "p.jsonl.gz") == [{"text": "Say hi."}]
    help_text = CliRunner().invoke(app, ["train-draft", "--help"]).output
    assert "--self-prompts" in help_text and "--n-self-prompts" in help_text
