"""Training sequences: prompts through the chat template, responses written by the target itself.

Responses come from batched decoding on the target's own weights, as a transformers model
(batch_decode.py): greedy for most prompt batches and sampled for every `sampled_every`-th one, then
optionally further sampled passes over all prompts. Each batch is one shard file (token ids + where
the response starts), so an interrupted run resumes at the next missing shard. Training batches pad
sequences of similar length together; the loss mask marks the response.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from flashtree.config import SamplingParams
from flashtree.train import batch_decode

SHARD = "shard-{:05d}.pt"


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """The prompt as the engine encodes it (Engine.encode): one user turn, generation prompt added."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tokenizer.encode(rendered, add_bos=False)


@dataclass(frozen=True)
class GenerationJob:
    index: int
    prompts: list[list[int]]
    sampled: bool


def generation_jobs(
    prompt_ids: list[list[int]], batch_size: int, sampled_every: int, seed: int, passes: int = 1
) -> list[GenerationJob]:
    """Batches of prompts of similar length (little left padding), in a seeded random order so that a
    time-limited run still covers every kind of prompt. The first pass samples every `sampled_every`-th
    batch (greedy otherwise); each further pass gives every prompt one more, sampled, response."""
    by_length = sorted(prompt_ids, key=len)
    chunks = [by_length[s : s + batch_size] for s in range(0, len(by_length), batch_size)]
    jobs = []
    for p in range(passes):
        order = list(range(len(chunks)))
        random.Random(seed + p * 7919).shuffle(order)
        for i, c in enumerate(order):
            sampled = p > 0 or (sampled_every > 0 and i % sampled_every == sampled_every - 1)
            jobs.append(GenerationJob(len(jobs), chunks[c], sampled))
    return jobs


@torch.no_grad()
def generate_responses(
    hf_model,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_ids: list[int],
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> list[list[int]]:
    """Each prompt's response, ending at its first stop token (kept) or after max_new_tokens: our
    batched decoding loop for attention-only targets, transformers' `generate` over left-padded prompts
    for the others (linear-attention layers)."""
    if batch_decode.supports(hf_model):
        params = SamplingParams(temperature=temperature, top_p=top_p)
        return batch_decode.decode_batch(hf_model, prompts, max_new_tokens, stop_ids, params)
    device = hf_model.device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), stop_ids[0], dtype=torch.long)
    attention = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        attention[i, width - len(p) :] = 1
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 else {}
    out = hf_model.generate(
        input_ids=ids.to(device),
        attention_mask=attention.to(device),
        max_new_tokens=max_new_tokens,
        pad_token_id=stop_ids[0],
        eos_token_id=stop_ids,
        **(sampling or dict(do_sample=False)),
    )
    return [batch_decode.cut_at_stop(row, stop_ids) for row in out[:, width:].tolist()]


def write_shard(path: Path, prompts: list[list[int]], responses: list[list[int]], sampled: bool) -> None:
    seqs = [p + r for p, r in zip(prompts, responses, strict=True)]
    lengths = torch.tensor([len(s) for s in seqs])
    shard = {
        "tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        "prompt_lens": torch.tensor([len(p) for p in prompts], dtype=torch.int32),
        "sampled": sampled,
    }
    tmp = path.with_suffix(".tmp")
    torch.save(shard, tmp)
    tmp.replace(path)  # atomic: a shard on disk is always complete


def generate_dataset(
    hf_model,
    jobs: list[GenerationJob],
    data_dir: Path,
    max_new_tokens: int,
    stop_ids: list[int],
    temperature: float,
    top_p: float,
    seed: int,
    time_limit: float | None = None,
    log=print,
) -> None:
    """Generate the missing shards in job order. With a time limit, stop before a job that would not
    finish in time (judged by the slowest job so far)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    start, slowest = time.perf_counter(), 0.0
    todo = [j for j in jobs if not (data_dir / SHARD.format(j.index)).exists()]
    log(f"responses: {len(jobs) - len(todo)} of {len(jobs)} shards already done")
    for n_done, job in enumerate(todo):
        elapsed = time.perf_counter() - start
        if time_limit is not None and elapsed + slowest > time_limit:
            log(f"responses: time limit reached after {n_done} new shards")
            return
        t0 = time.perf_counter()
        torch.manual_seed(seed * 100_003 + job.index)  # the same shard whatever run produced it
        temp = temperature if job.sampled else 0.0
        responses = generate_responses(hf_model, job.prompts, max_new_tokens, stop_ids, temp, top_p)
        write_shard(data_dir / SHARD.format(job.index), job.prompts, responses, job.sampled)
        took = time.perf_counter() - t0
        slowest = max(slowest, took)
        n_tokens = sum(len(r) for r in responses)
        log(
            f"responses: shard {job.index} ({'sampled' if job.sampled else 'greedy'}) {len(responses)} seqs, "
            f"{n_tokens} tokens in {took:.1f}s ({n_tokens / took:.0f} tok/s)"
        )


@dataclass
class Sequences:
    tokens: list[torch.Tensor]  # (L,) long per sequence: prompt + response
    prompt_lens: list[int]
    sampled: list[bool]  # a sampled response (else the target's greedy one)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def n_response_tokens(self) -> int:
        return sum(len(t) - p for t, p in zip(self.tokens, self.prompt_lens, strict=True))


def load_sequences(data_dirs: list[Path], min_response: int) -> Sequences:
    """Every sequence of every shard of each directory in turn, in shard order, dropping responses
    shorter than min_response."""
    seqs = Sequences([], [], [])
    for path in (shard for d in data_dirs for shard in sorted(d.glob("shard-*.pt"))):
        shard = torch.load(path, weights_only=True)
        offsets = shard["offsets"].tolist()
        for i, p in enumerate(shard["prompt_lens"].tolist()):
            seq = shard["tokens"][offsets[i] : offsets[i + 1]].long()
            if len(seq) - p >= min_response:
                seqs.tokens.append(seq)
                seqs.prompt_lens.append(p)
                seqs.sampled.append(bool(shard["sampled"]))
    return seqs


def hold_out(seqs: Sequences, n: int, seed: int) -> tuple[Sequences, Sequences]:
    """(training, held-out): up to n greedy sequences, chosen by seed, kept out of training (never more
    than half of them). Greedy, because replayed decoding (replay.py) needs the target's own output."""
    greedy = [i for i, s in enumerate(seqs.sampled) if not s]
    chosen = set(random.Random(seed).sample(greedy, min(n, len(greedy), len(seqs) // 2)))

    def subset(keep) -> Sequences:
        idx = [i for i in range(len(seqs)) if keep(i)]
        return Sequences(
            *([field[i] for i in idx] for field in (seqs.tokens, seqs.prompt_lens, seqs.sampled))
        )

    return subset(lambda i: i not in chosen), subset(lambda i: i in chosen)


def epoch_batches(seqs: Sequences, batch_size: int, epoch: int, seed: int) -> list[list[int]]:
    """Index batches for one epoch: shuffled, then sorted by length within windows of 32 batches so
    that a batch pads little, then the batches shuffled again."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(seqs)))
    rng.shuffle(order)
    window = 32 * batch_size
    batches = []
    for s in range(0, len(order), window):
        chunk = sorted(order[s : s + window], key=lambda i: len(seqs.tokens[i]))
        batches += [chunk[k : k + batch_size] for k in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def collate(seqs: Sequences, indices: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids (b, S) and the response mask (b, S). Right padding needs no attention mask: a
    causal model's real tokens see only earlier positions, all real (hf_target.hf_features)."""
    width = max(len(seqs.tokens[i]) for i in indices)
    ids = torch.zeros(len(indices), width, dtype=torch.long)
    response = torch.zeros(len(indices), width, dtype=torch.bool)
    for row, i in enumerate(indices):
        seq, p = seqs.tokens[i], seqs.prompt_lens[i]
        ids[row, : len(seq)] = seq
        response[row, p : len(seq)] = True
    return ids.to(device), response.to(device)


def iterate_batches(seqs: Sequences, batch_size: int, seed: int, start_step: int) -> Iterator[list[int]]:
    """Batches forever, epoch after epoch, starting at global step `start_step` (for resuming)."""
    per_epoch = len(epoch_batches(seqs, batch_size, 0, seed))
    epoch, skip = divmod(start_step, per_epoch)
    while True:
        yield from epoch_batches(seqs, batch_size, epoch, seed)[skip:]
        epoch, skip = epoch + 1, 0
