"""Self-written prompts (issue #43, the Magpie method): the target, given only its chat template's text
before a user turn's content, writes a user request itself and ends the turn. Those requests look like
what the target was tuned on, so they widen a draft's training prompts beyond the benchmark-like mix of
prompts.py.

`sample_user_turns` draws the raw turns (seeded, one Engine generation each); `filter_prompts` keeps the
usable ones and counts what each filter dropped; `is_held_out` splits off a stable held-out set (by a
seeded hash of the text) that training never sees and acceptance is measured on; `with_self_prompts` adds
them to train-draft's prompt pool.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass

from flashtree.errors import FlashtreeError

# The content of the one user turn rendered to find where a template puts the content: text no template
# writes itself, so the first occurrence is where the content goes.
PLACEHOLDER = "\u2063flashtree-user-content\u2063"
HELD_OUT_FRACTION = 0.1  # of the filtered prompts, never trained on
SPLIT_SEED = 0
SOURCE = "self"  # the "source" of these prompts in a pool's records


def user_prefix(tokenizer) -> str:
    """The chat template's text before a user turn's content: e.g. for SmolLM2 its default system turn
    and then "<|im_start|>user\\n". Found by rendering one user turn whose content is PLACEHOLDER and
    cutting there, so it holds for any template (system turns and BOS text included)."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PLACEHOLDER}], add_generation_prompt=False
    )
    if text.count(PLACEHOLDER) != 1:
        raise FlashtreeError("the chat template does not write a user turn's content once as given")
    return text[: text.index(PLACEHOLDER)]


@dataclass(frozen=True)
class SampleSettings:
    """How the target writes its user turns: sampled (temperature, top_p), at most max_tokens each."""

    seed: int = 0
    temperature: float = 1.0
    top_p: float = 0.95
    max_tokens: int = 128


def sample_seed(seed: int, index: int) -> int:
    """The sampling seed of turn `index`: a hash of (seed, index), so runs with nearby seeds share no
    draws and a resumed run goes on with the same draws."""
    digest = hashlib.sha256(f"self-prompt:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # an int64's non-negative range


def sample_user_turns(engine, settings: SampleSettings, start: int = 0) -> Iterator[dict]:
    """Raw user turns written by the engine's target from the template's user prefix, turn start,
    start + 1, ... (without end), one generation each: {"index", "text", "n_tokens", "ended",
    "specials"}. `ended`: the turn stopped at an end-of-turn (stop) token rather than max_tokens;
    `specials`: control tokens inside it. The text is decoded with control tokens' text in it (for the
    filters to see)."""
    from flashtree.config import SamplingParams

    tokenizer = engine.tokenizer
    prefix = tokenizer.encode(user_prefix(tokenizer), add_bos=False)
    index = start
    while True:
        sampling = SamplingParams(
            settings.temperature, settings.top_p, seed=sample_seed(settings.seed, index)
        )
        out = [t for step in engine.generate(prefix, settings.max_tokens, sampling) for t in step]
        yield _turn(tokenizer, index, out)
        index += 1


def sample_user_turns_batched(hf_model, tokenizer, settings: SampleSettings, start: int = 0,
                              batch: int = 256) -> Iterator[dict]:  # fmt: skip
    """`sample_user_turns`, `batch` turns a generation (a GPU's way: train/data.py's batched decoding of
    a transformers model, `hf_model`): the turns start .. start + batch - 1 drawn together from torch's
    generator seeded by sample_seed(seed, start), so a run resumed at a batch boundary draws the same
    turns; other draws than one turn at a time."""
    import torch

    from flashtree.train.data import generate_responses

    prefix = tokenizer.encode(user_prefix(tokenizer), add_bos=False)
    index = start
    while True:
        torch.manual_seed(sample_seed(settings.seed, index))
        outs = generate_responses(
            hf_model, [prefix] * batch, settings.max_tokens, list(tokenizer.stop_ids), settings.temperature,
            settings.top_p,
        )  # fmt: skip
        for out in outs:
            yield _turn(tokenizer, index, out)
            index += 1


def _turn(tokenizer, index: int, out: list[int]) -> dict:
    """The record of turn `index` whose generated tokens are `out` (its stop token last, if it ended)."""
    ended = bool(out) and out[-1] in set(tokenizer.stop_ids)
    body = out[:-1] if ended else out
    return {
        "index": index,
        "text": tokenizer.decode(body),
        "n_tokens": len(body),
        "ended": ended,
        "specials": sum(tokenizer.is_special(t) for t in body),
    }


def control_texts(tokenizer) -> frozenset[str]:
    """The text of every control token (<|im_start|>, <|im_end|>, ...): a prompt holding one is a turn
    that ran into the template's markup."""
    special = (tokenizer.decode([i]) for i in range(tokenizer.vocab_size) if tokenizer.is_special(i))
    return frozenset(t for t in special if t.strip())


# --- filters ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FilterSettings:
    min_chars: int = 16
    max_chars: int = 1500
    min_words: int = 4
    min_ascii: float = 0.98  # share of characters that are ASCII
    min_letters: float = 0.5  # share of non-space characters that are letters
    near_duplicate: float = 0.8  # Jaccard similarity of word 3-shingles at which a prompt is a copy


# Words nearly every English request of a few words holds; a romanized other language seldom does.
ENGLISH_WORDS = frozenset((
    "a", "an", "the", "to", "of", "and", "or", "in", "on", "for", "with", "is", "are", "be", "do", "does",
    "can", "could", "would", "should", "will", "i", "you", "my", "me", "your", "what", "how", "why",
    "which", "who", "when", "where", "this", "that", "it", "please", "write", "explain",
))  # fmt: skip
FILTERS = ("truncated", "control_tokens", "length", "not_english", "benchmark", "duplicate")


def normalize(text: str) -> str:
    """Lowercase, punctuation dropped, whitespace collapsed: the text two copies share."""
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def is_english(text: str, settings: FilterSettings) -> bool:
    """The heuristic: almost all ASCII (settings.min_ascii), mostly letters (min_letters of the
    non-space characters: code and formulas pass, symbol soup does not), and at least one of
    ENGLISH_WORDS among its words."""
    ascii_share = sum(c.isascii() for c in text) / len(text)
    dense = [c for c in text if not c.isspace()]
    letter_share = sum(c.isalpha() for c in dense) / max(len(dense), 1)
    words = set(normalize(text).split())
    return (
        ascii_share >= settings.min_ascii
        and letter_share >= settings.min_letters
        and bool(words & ENGLISH_WORDS)
    )


class ShingleIndex:
    """Near-duplicate lookup by the Jaccard similarity of word 3-shingles, with prefix filtering: two
    sets of similarity >= t share one of the first len - ceil(t * len) + 1 shingles of each in a fixed
    (hash) order, so only those are indexed and probed; candidates are then checked exactly."""

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.sets: list[frozenset[str]] = []
        self.index: dict[str, list[int]] = {}

    @staticmethod
    def shingles(text: str) -> frozenset[str]:
        words = normalize(text).split()
        return frozenset(" ".join(words[i : i + 3]) for i in range(max(len(words) - 2, 1)))

    def _prefix(self, shingles: frozenset[str]) -> list[str]:
        order = sorted(shingles, key=lambda s: hashlib.blake2b(s.encode(), digest_size=8).digest())
        keep = len(order) - int(-(-self.threshold * len(order) // 1)) + 1
        return order[:keep]

    def match(self, text: str) -> bool:
        """Whether an added text is at least `threshold` similar to `text`."""
        mine = self.shingles(text)
        seen = {i for s in self._prefix(mine) for i in self.index.get(s, ())}
        return any(len(mine & self.sets[i]) >= self.threshold * len(mine | self.sets[i]) for i in seen)

    def add(self, text: str) -> None:
        shingles = self.shingles(text)
        for s in self._prefix(shingles):
            self.index.setdefault(s, []).append(len(self.sets))
        self.sets.append(shingles)


def filter_prompts(
    samples: Iterable[dict],
    controls: Iterable[str],
    benchmark: Iterable[str],
    settings: FilterSettings = FilterSettings(),
) -> tuple[list[dict], dict[str, int]]:
    """The usable samples of sample_user_turns (text stripped), in order, and {filter: dropped} for each
    of FILTERS in the order they apply (plus "samples" and "kept"): turns cut at max_tokens, turns with
    control tokens (as tokens or as text), outside the length bounds (characters, words), not English
    (is_english), matching a benchmark prompt in `benchmark` (the same normalized text, or a near
    duplicate of it) and near duplicates of an earlier kept prompt (normalized text equal, or shingles
    similar as settings.near_duplicate says)."""
    controls = tuple(controls)
    bench = ShingleIndex(settings.near_duplicate)
    bench_keys = set()
    for text in benchmark:
        bench.add(text)
        bench_keys.add(normalize(text))
    kept_index, kept_keys = ShingleIndex(settings.near_duplicate), set()
    counts = dict.fromkeys(("samples", *FILTERS, "kept"), 0)
    kept = []
    for sample in samples:
        counts["samples"] += 1
        text = sample["text"].strip()
        key = normalize(text)
        if not sample["ended"]:
            reason = "truncated"
        elif sample.get("specials") or any(c in text for c in controls):
            reason = "control_tokens"
        elif (
            not settings.min_chars <= len(text) <= settings.max_chars or len(key.split()) < settings.min_words
        ):
            reason = "length"
        elif not is_english(text, settings):
            reason = "not_english"
        elif key in bench_keys or bench.match(text):
            reason = "benchmark"
        elif key in kept_keys or kept_index.match(text):
            reason = "duplicate"
        else:
            kept_keys.add(key)
            kept_index.add(text)
            kept.append({**sample, "text": text})
            counts["kept"] += 1
            continue
        counts[reason] += 1
    return kept, counts


def is_held_out(text: str, fraction: float = HELD_OUT_FRACTION, seed: int = SPLIT_SEED) -> bool:
    """Whether a prompt is in the held-out split: a seeded hash of its normalized text, so the split is
    the same in every pool and file that holds the prompt, whatever else they hold."""
    digest = hashlib.sha256(f"{seed}:{normalize(text)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") < fraction * 2**64


def split(records: Iterable[dict]) -> tuple[list[dict], list[dict]]:
    """(training, held out) records, each in the given order."""
    train, held = [], []
    for r in records:
        (held if is_held_out(r["text"]) else train).append(r)
    return train, held


def with_self_prompts(pool: list[dict], records: Iterable[dict], n: int | None, seed: int) -> list[dict]:
    """A training pool with up to n (None: all) of the self-written `records` of the training split
    added as {"source": SOURCE, "text"} (never one of the held-out split, nor a text the pool holds),
    shuffled by `seed` so a --max-prompts cut takes both kinds."""
    texts = {r["text"] for r in pool}
    train, _ = split(r for r in records if r["text"] not in texts)
    mixed = pool + [{"source": SOURCE, "text": r["text"]} for r in train[:n]]
    random.Random(seed).shuffle(mixed)
    return mixed


def provenance(settings: SampleSettings, filters: FilterSettings, counts: dict[str, int]) -> dict:
    """What a file of self-written prompts was made with: the sampling, the filters and their counts."""
    return {
        "method": "magpie: the target samples a user turn from its chat template's user prefix",
        "sampling": asdict(settings),
        "filters": asdict(filters),
        "counts": counts,
        "held_out": {"fraction": HELD_OUT_FRACTION, "seed": SPLIT_SEED},
    }
