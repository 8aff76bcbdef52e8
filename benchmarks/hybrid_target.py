"""A small Qwen3.5-architecture target trained here (issue #43 part 1): transformers' Qwen3_5ForCausalLM
in miniature, trained on text SmolLM2-135M-Instruct writes (distillation by text), converted to GGUF.

    python -m benchmarks.hybrid_target stage --out .stage/hybrid    here: the prompt pool, teacher pieces
    python -m benchmarks.hybrid_target data --out DIR [--target GGUF] [--prompts F ...] [--gen-minutes 4.5]
    python -m benchmarks.hybrid_target train --out DIR [--minutes 6] [--tokens 3e8] [--hidden 512 ...]
    python -m benchmarks.hybrid_target convert --out DIR [--types bf16 q4_k_m]
    python -m benchmarks.hybrid_target all --out DIR ...               the three in turn, then provenance

Every stage skips what DIR already holds, so a stopped run goes on where it stopped:
- `data`: the teacher (--target, default: the embedded SmolLM2 GGUF) writes responses to the prompt pool
  (--prompts files, else train-draft's built-in mix, plus the training split of --self-prompts), in
  batches of similar length, every --sampled-every-th batch sampled; each batch is one shard of token ids
  (DIR/data/shard-*.pt, flashtree/train/data.py: the chat-templated prompt, then the response), written
  atomically, up to --gen-minutes. DIR/data.json: the pool and each run's counts and rate.
- `train`: a fresh model (HybridShape: 3 Gated DeltaNet layers then 1 gated-attention layer, partial
  rotary 0.25, the 27B's head ratios in miniature, tied embeddings, the teacher's vocabulary), AdamW,
  warmup then cosine over the run's progress (the larger of tokens / --tokens and seconds / --minutes, so
  the schedule ends at either cap), next-token loss on every token of each sequence, bf16 autocast on
  CUDA. DIR/hf/ (config.json, model.safetensors, the teacher's tokenizer as tokenizer.json +
  tokenizer_config.json), DIR/loss_curve.json (train loss every --log-every steps, held-out loss every
  --eval-every), DIR/train.json.
- `convert`: `flashtree convert`'s convert_checkpoint to DIR/hybrid-TYPE.gguf per --types, then a check
  (DIR/check.json): the GGUF's tokenizer keys equal the teacher's, and flashtree's greedy output on a few
  chat prompts against transformers' on DIR/hf (fp32), with the largest logit difference along it.
- `all`: then DIR/provenance.json: seed, shape, data, steps, tokens, losses, wall times, commit, device.

On CUDA transformers runs the DeltaNet layers with flash-linear-attention's Triton kernels when `fla`
imports (fla-core), else its torch path (chunked, fp32, launch-bound; same math); train.json says which.

Budget on one H100/H200 (~12.5 min in all): data 4.5 min (SmolLM2 batch-decodes 41-71k tok/s on real
prompts: ~12-18M response tokens), training 6 min (55M parameters, ~0.33 GFLOP a token: ~100-200M tokens
with fla, fewer on the torch path), loading, saving, convert and check ~2 min. The device has no PyPI
and takes 64 MiB a call: `scripts/device_hybrid.sh` stages and runs it (then the draft, #43 part 2).
A failure on the fla path: `rm -rf /tmp/site/fla` and run `all` again (the data stays; training restarts).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.kv_quality import decode, say
from flashtree.bench.hf_baseline import hf_model_from
from flashtree.bench.run import device_info, git_info, versions
from flashtree.convert.hf import convert_checkpoint
from flashtree.defaults import default_target_path
from flashtree.gguf.reader import GGUFFile
from flashtree.gguf.tokenizer import CONTROL, USER_DEFINED, Tokenizer
from flashtree.models.config import hybrid_layer_types
from flashtree.train import data as D
from flashtree.train.batch_decode import cut_at_stop
from flashtree.train.prompts import read_prompts
from flashtree.train.self_prompts import with_self_prompts
from flashtree.train.trainer import _prompt_records, lr_at

DATA, HF, CURVE, CHECK, PROVENANCE = "data", "hf", "loss_curve.json", "check.json", "provenance.json"
SELF_PROMPTS = Path("bench/results/cpu-self-prompts-2026-12-06/prompts.jsonl")
PART_SIZE = 30 << 20  # teacher pieces: with the 33 MB working tree, one piece a 64 MiB device call
CHECK_PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that returns the square of a number.",
    "Give me three tips for staying focused while studying.",
    "What is 12 times 7?",
)
# tokenizer.json pre-tokenizer steps for the GGUF pre-tokenizers `flashtree convert` recognizes
# (gguf/hf_tokenizer.py _infer_pre): SmolLM2's, and plain GPT-2's (the tiny test teachers').
PRE_TOKENIZER_STEPS = {"smollm": ("digits", "byte_level"), "gpt-2": ("byte_level",)}
TOK = "tokenizer.ggml."
TOKENIZER_KEYS = ("model", "pre", "tokens", "token_type", "merges", "bos_token_id", "eos_token_id")


@dataclass(frozen=True)
class HybridShape:
    """The model: Qwen3.6-27B's layout in miniature (5120 hidden, 24 q / 4 kv heads of 256, DeltaNet 16 K /
    48 V heads of 128: q and V widths ~1.2x hidden, 6 q heads per kv head, 3 V heads per K head)."""

    hidden: int = 512
    layers: int = 8  # a multiple of 4: three DeltaNet layers, then one gated-attention layer
    ffn: int = 1536
    heads: int = 6
    kv_heads: int = 1
    head_dim: int = 128  # rotary on its first quarter, as the family's
    linear_k_heads: int = 2
    linear_v_heads: int = 6
    linear_head_dim: int = 128
    context: int = 4096


@dataclass(frozen=True)
class TrainSettings:
    minutes: float = 6.0  # wall-clock cap of the training loop
    tokens: float = 3e8  # token budget (whichever of the two ends first)
    batch: int = 64  # sequences per step
    lr: float = 2e-3
    warmup_steps: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    val_sequences: int = 128  # greedy sequences held out of training
    log_every: int = 10
    eval_every: int = 200
    steps = None  # lr_at's TrainConfig field: the schedule runs on progress


@dataclass(frozen=True)
class DataSettings:
    minutes: float = 4.5
    batch: int = 2048  # prompts per batch-decode call (one shard)
    max_new_tokens: int = 256
    max_prompt_tokens: int = 384
    sampled_every: int = 2  # every n-th batch sampled, the others greedy
    temperature: float = 0.7
    top_p: float = 0.95


def qwen35_config(shape: HybridShape, tokenizer: Tokenizer):
    """The transformers config of `shape` over `tokenizer`'s vocabulary."""
    import transformers as tf

    if shape.layers % 4:
        raise SystemExit(f"--layers {shape.layers}: a multiple of 4 (3 DeltaNet + 1 attention layer)")
    return tf.Qwen3_5TextConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=shape.hidden, intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers, layer_types=list(hybrid_layer_types(shape.layers, 4)),
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        linear_num_key_heads=shape.linear_k_heads, linear_num_value_heads=shape.linear_v_heads,
        linear_key_head_dim=shape.linear_head_dim, linear_value_head_dim=shape.linear_head_dim,
        linear_conv_kernel_dim=4, max_position_embeddings=shape.context, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
    )  # fmt: skip


def gguf_tokenizer(path: Path) -> tuple[dict, Tokenizer]:
    with GGUFFile(path) as g:
        meta = {k: v for k, v in g.metadata.items() if k.startswith("tokenizer.")}
    return meta, Tokenizer.from_gguf_metadata(meta)


def write_tokenizer_files(meta: dict, dest: Path) -> None:
    """tokenizer.json + tokenizer_config.json from a GGUF's tokenizer keys, as Hugging Face writes them
    for that pre-tokenizer, so that `flashtree convert` puts the same keys back."""
    from tokenizers import AddedToken, decoders, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    pre = meta["tokenizer.ggml.pre"]
    if pre not in PRE_TOKENIZER_STEPS:
        raise SystemExit(f"teacher pre-tokenizer {pre!r}: only {', '.join(PRE_TOKENIZER_STEPS)}")
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    tok = HFTokenizer(BPE(vocab, [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]))
    steps = {
        "digits": pre_tokenizers.Digits(individual_digits=True),
        "byte_level": pre_tokenizers.ByteLevel(add_prefix_space=False),
    }
    tok.pre_tokenizer = pre_tokenizers.Sequence([steps[s] for s in PRE_TOKENIZER_STEPS[pre]])
    tok.decoder = decoders.ByteLevel()
    typed = list(zip(tokens, types, strict=True))
    tok.add_special_tokens([AddedToken(t, special=True) for t, k in typed if k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False) for t, k in typed if k == USER_DEFINED])
    dest.mkdir(parents=True, exist_ok=True)
    tok.save(str(dest / "tokenizer.json"))

    def name(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return None if i is None else tokens[i]

    config = {
        "chat_template": meta.get("tokenizer.chat_template"),
        "bos_token": name("bos_token_id"), "eos_token": name("eos_token_id"),
        "pad_token": name("padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token")),
    }  # fmt: skip
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False))


def stop_ids(tokenizer: Tokenizer) -> list[int]:
    return [tokenizer.eos_id] + sorted(tokenizer.stop_ids - {tokenizer.eos_id})


# --- stages -----------------------------------------------------------------------------------------


def stage(args: argparse.Namespace) -> None:
    """Here, before a GPU lease: the prompt pool (train-draft's built-in mix), the teacher in pieces and
    its md5 (`md5sum -c teacher.md5` once joined as teacher.gguf)."""
    _prompt_records(args.out / "prompts.jsonl.gz", None, args.seed)
    teacher = (args.target or default_target_path()).read_bytes()
    for k, at in enumerate(range(0, len(teacher), PART_SIZE)):
        (args.out / f"teacher.part.a{chr(ord('a') + k)}").write_bytes(teacher[at : at + PART_SIZE])
    (args.out / "teacher.md5").write_text(f"{hashlib.md5(teacher).hexdigest()}  teacher.gguf\n")
    say(f"staged {args.out}: prompts.jsonl.gz, teacher.part.* ({len(teacher)} bytes), teacher.md5")


def data(args: argparse.Namespace, gen: DataSettings, seed: int) -> None:
    from flashtree.models.loader import load_target, resolve_device

    out, target = args.out, args.target or default_target_path()
    records = _prompt_records(out / "prompts.jsonl.gz", args.prompts, seed)
    if args.self_prompts and args.self_prompts.exists():
        records = with_self_prompts(records, read_prompts(args.self_prompts), None, seed)
    _, tokenizer = gguf_tokenizer(target)
    chats = (D.chat_prompt_ids(tokenizer, r["text"]) for r in records)
    prompt_ids = [ids for ids in chats if len(ids) <= gen.max_prompt_tokens]
    jobs = D.generation_jobs(prompt_ids, gen.batch, gen.sampled_every, seed)
    done = sum((out / DATA / D.SHARD.format(j.index)).exists() for j in jobs)
    t0 = time.perf_counter()
    if done < len(jobs):
        device = resolve_device(args.device)
        dtype = torch.bfloat16 if device.type == "cuda" else None  # as train-draft generates
        hf = hf_model_from(load_target(target, device=device, dtype=dtype)[0]).requires_grad_(False)
        D.generate_dataset(
            hf, jobs, out / DATA, gen.max_new_tokens, stop_ids(tokenizer), gen.temperature, gen.top_p,
            seed, gen.minutes * 60, log=say,
        )  # fmt: skip
        del hf
    seconds = time.perf_counter() - t0
    seqs = D.load_sequences([out / DATA], min_response=1)
    made = sum((out / DATA / D.SHARD.format(j.index)).exists() for j in jobs) - done
    report_path = out / "data.json"
    runs = json.loads(report_path.read_text())["runs"] if report_path.exists() else []
    report = {
        "teacher": str(target), "settings": asdict(gen), "seed": seed, "prompts": len(prompt_ids),
        "sources": _counts(r.get("source", "file") for r in records), "shards": f"{done + made}/{len(jobs)}",
        "sequences": len(seqs), "tokens": sum(len(t) for t in seqs.tokens),
        "response_tokens": seqs.n_response_tokens,
        "runs": [*runs, {"new_shards": made, "seconds": round(seconds, 1)}] if made else runs,
    }  # fmt: skip
    report_path.write_text(json.dumps(report, indent=1) + "\n")
    say(f"data: {report['shards']} shards, {len(seqs)} sequences, {report['tokens']} tokens")


def _counts(items) -> dict[str, int]:
    counts: dict[str, int] = {}
    for x in items:
        counts[x] = counts.get(x, 0) + 1
    return counts


def lm_loss(model, ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over the real tokens of right-padded `ids` (b, S); the LM head
    runs only on the positions that predict a real token."""
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state  # (b, S, H)
    target = real[:, 1:]
    logits = model.lm_head(hidden[:, :-1][target])  # (N, V)
    return F.cross_entropy(logits.float(), ids[:, 1:][target])


def _batch(seqs: D.Sequences, indices: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and where the real tokens are (prompt and response)."""
    ids, response = D.collate(seqs, indices, device)
    lengths = response.sum(1) + torch.tensor([seqs.prompt_lens[i] for i in indices], device=device)
    return ids, torch.arange(ids.shape[1], device=device)[None] < lengths[:, None]


@torch.no_grad()
def held_out_loss(model, val: D.Sequences, device, autocast, batch: int = 16) -> float:
    total, count = 0.0, 0
    for lo in range(0, len(val), batch):
        ids, real = _batch(val, list(range(lo, min(lo + batch, len(val)))), device)
        with autocast:
            n = int(real[:, 1:].sum())
            total, count = total + float(lm_loss(model, ids, real)) * n, count + n
    return total / max(count, 1)


def deltanet_path(device: torch.device) -> str:
    """Which DeltaNet implementation transformers runs here (hub_kernels: fla on CUDA when it imports)."""
    return "fla" if device.type == "cuda" and importlib.util.find_spec("fla") else "torch"


def train(args: argparse.Namespace, shape: HybridShape, cfg: TrainSettings) -> None:
    import transformers as tf

    from flashtree.models.loader import resolve_device

    out, device = args.out, resolve_device(args.device)
    meta, tokenizer = gguf_tokenizer(args.target or default_target_path())
    seqs = D.load_sequences([out / DATA], min_response=1)
    if not len(seqs):
        raise SystemExit(f"{out / DATA}: no data (run the data stage first)")
    seqs, val = D.hold_out(seqs, cfg.val_sequences, cfg.seed)
    torch.manual_seed(cfg.seed)
    model = tf.Qwen3_5ForCausalLM(qwen35_config(shape, tokenizer)).to(device)  # fp32 master weights
    n_params = sum(p.numel() for p in model.parameters())
    say(f"train: {n_params / 1e6:.1f}M parameters, {len(seqs)} sequences (+{len(val)} held out), "
        f"DeltaNet: {deltanet_path(device)}")  # fmt: skip
    cuda = device.type == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = True
    # matrices decay; norms, A_log and dt_bias (1-D) keep their values
    groups = [
        {"params": [p for p in model.parameters() if p.ndim > 1], "weight_decay": cfg.weight_decay},
        {"params": [p for p in model.parameters() if p.ndim <= 1], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=cuda)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda)
    batches = D.iterate_batches(seqs, cfg.batch, cfg.seed, 0)
    curve, tokens, step, t0 = [], 0, 0, time.perf_counter()
    progress, window = 0.0, []
    while progress < 1.0:
        ids, real = _batch(seqs, next(batches), device)
        lr = lr_at(step, progress, cfg)
        for group in opt.param_groups:
            group["lr"] = lr
        with autocast:
            loss = lm_loss(model, ids, real)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step, tokens = step + 1, tokens + int(real.sum())
        window.append(loss.detach())
        seconds = time.perf_counter() - t0
        progress = max(tokens / cfg.tokens, seconds / (cfg.minutes * 60))
        if step % cfg.log_every == 0 or progress >= 1.0:
            row = {"step": step, "tokens": tokens, "seconds": round(seconds, 1), "lr": lr,
                   "loss": float(torch.stack(window).mean())}  # fmt: skip
            window = []
            if step % cfg.eval_every == 0 or progress >= 1.0:
                model.eval()
                row["val_loss"] = held_out_loss(model, val, device, autocast)
                model.train()
            curve.append(row)
            say(f"train: step {step} ({progress:.0%}) loss {row['loss']:.3f}"
                + (f" val {row['val_loss']:.3f}" if "val_loss" in row else "")
                + f" lr {lr:.2e}, {tokens / seconds:.0f} tok/s")  # fmt: skip
    model.save_pretrained(out / HF, safe_serialization=True)
    write_tokenizer_files(meta, out / HF)
    (out / CURVE).write_text(json.dumps(curve) + "\n")
    report = {
        "shape": asdict(shape), "settings": asdict(cfg), "parameters": n_params, "steps": step,
        "tokens": tokens, "seconds": round(time.perf_counter() - t0, 1),
        "tokens_per_second": round(tokens / seconds), "final_loss": curve[-1]["loss"],
        "final_val_loss": curve[-1]["val_loss"], "train_sequences": len(seqs), "held_out_sequences": len(val),
        "deltanet": deltanet_path(device), "device": device_info(device), "versions": versions(),
    }  # fmt: skip
    (out / "train.json").write_text(json.dumps(report, indent=1) + "\n")


def convert(args: argparse.Namespace) -> None:
    """The GGUFs, then the check: tokenizer keys, and greedy output and logits against transformers."""
    out = args.out
    for qtype in args.types:
        gguf = out / f"hybrid-{qtype}.gguf"
        if not gguf.exists():
            convert_checkpoint(out / HF, gguf, qtype)
    (out / CHECK).write_text(json.dumps(check(args), indent=1) + "\n")


def check(args: argparse.Namespace) -> dict:
    import transformers as tf

    from flashtree.engine.generate import Engine
    from flashtree.models.loader import resolve_device

    out, device = args.out, resolve_device(args.device)
    teacher, _ = gguf_tokenizer(args.target or default_target_path())
    ref = tf.Qwen3_5ForCausalLM.from_pretrained(out / HF, dtype=torch.float32).to(device).eval()
    report = {"device": device_info(device), "max_tokens": args.check_tokens, "files": {}}
    for qtype in args.types:
        path = out / f"hybrid-{qtype}.gguf"
        meta, _ = gguf_tokenizer(path)
        differ = [k for k in TOKENIZER_KEYS if meta.get(f"{TOK}{k}") != teacher.get(f"{TOK}{k}")]
        engine = Engine.load(target=path, draft="none", mode="ar", device=str(device))
        stops = stop_ids(engine.tokenizer)
        rows = [_compare(engine, ref, text, args.check_tokens, stops) for text in CHECK_PROMPTS]
        report["files"][qtype] = {
            "bytes": path.stat().st_size, "tokenizer_keys_differing": differ,
            "identical": sum(r["identical"] for r in rows), "prompts": rows,
        }  # fmt: skip
        say(f"check {qtype}: {report['files'][qtype]['identical']}/{len(rows)} greedy outputs equal to "
            f"transformers', max logit diff {max(r['max_logit_diff'] for r in rows):.2e}")  # fmt: skip
        del engine
    return report


@torch.no_grad()
def _compare(engine, ref, text: str, max_tokens: int, stops: list[int]) -> dict:
    ids = engine.encode(text)
    ours, _ = decode(engine, ids, max_tokens)
    ours = cut_at_stop(ours, stops)
    prompt = torch.tensor([ids], device=ref.device)
    theirs = ref.generate(prompt, max_new_tokens=max_tokens, do_sample=False, eos_token_id=stops,
                          pad_token_id=stops[0], attention_mask=torch.ones_like(prompt))  # fmt: skip
    theirs = cut_at_stop(theirs[0, len(ids) :].tolist(), stops)
    # Both models' logits along the reference's sequence: how far apart they are, not where they part.
    seq = torch.tensor(ids + theirs, device=engine.device)
    target = engine.target
    got = target(seq, target.new_state(len(seq)), logits="all").logits.float()
    expected = ref(seq[None]).logits[0].float()
    pairs = enumerate(zip(ours, theirs, strict=False))  # to the shorter's end
    first = next((i for i, (a, b) in pairs if a != b), min(len(ours), len(theirs)))
    return {
        "prompt": text, "identical": ours == theirs, "agree_tokens": first, "tokens": len(theirs),
        "max_logit_diff": float((got - expected).abs().max()), "text": engine.tokenizer.decode(ours),
    }  # fmt: skip


def provenance(args: argparse.Namespace, shape: HybridShape, walls: dict[str, float]) -> None:
    out = args.out
    read = {name: json.loads((out / f"{name}.json").read_text()) for name in ("data", "train", "check")}
    files = read["check"]["files"]
    report = {
        "git": git_info(), "seed": read["train"]["settings"]["seed"], "shape": asdict(shape),
        "data": read["data"], "train": read["train"], "loss_curve": CURVE,
        "check": {q: {k: v for k, v in f.items() if k != "prompts"} for q, f in files.items()},
        "wall_seconds": walls, "device": read["train"]["device"],
    }  # fmt: skip
    (out / PROVENANCE).write_text(json.dumps(report, indent=1) + "\n")
    say(f"wrote {out / PROVENANCE}")


# --- command line -----------------------------------------------------------------------------------


def _add_fields(parser: argparse.ArgumentParser, cls, prefix: str = "") -> None:
    for f in fields(cls):
        parser.add_argument(f"--{prefix}{f.name.replace('_', '-')}", type=type(f.default), default=f.default)


def _settings(args: argparse.Namespace, cls, prefix: str = ""):
    return cls(**{f.name: getattr(args, prefix.replace("-", "_") + f.name) for f in fields(cls)})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=("stage", "data", "train", "convert", "all"))
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--target", type=Path, default=None, help="the teacher GGUF (default: SmolLM2's)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--prompts", type=Path, nargs="*", default=None, help="default: train-draft's mix")
    parser.add_argument(
        "--self-prompts", type=lambda s: None if s == "none" else Path(s), default=SELF_PROMPTS,
        help=f"self-written prompts added to the pool ('none': not any; default {SELF_PROMPTS})",
    )  # fmt: skip
    parser.add_argument("--types", nargs="+", default=["bf16", "q4_k_m"])
    parser.add_argument("--check-tokens", type=int, default=48)
    _add_fields(parser, HybridShape)
    _add_fields(parser, TrainSettings)
    _add_fields(parser, DataSettings, "gen-")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    shape, cfg = _settings(args, HybridShape), _settings(args, TrainSettings)
    gen = _settings(args, DataSettings, "gen-")
    walls: dict[str, float] = {}
    todo = ("data", "train", "convert") if args.what == "all" else (args.what,)
    for name in todo:
        t0 = time.perf_counter()
        if name == "stage":
            stage(args)
        elif name == "data":
            data(args, gen, cfg.seed)
        elif name == "train" and not (args.out / HF / "config.json").exists():
            train(args, shape, cfg)
        elif name == "convert":
            convert(args)
        walls[name] = round(time.perf_counter() - t0, 1)
    if args.what == "all":
        provenance(args, shape, walls)


if __name__ == "__main__":
    main()
