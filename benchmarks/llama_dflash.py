"""llama.cpp's draft-dflash against flashtree on the same GPU, GGUFs and prompts (scripts/llama_dflash.sh).

    python3 -m benchmarks.llama_dflash prompts TARGET DIR            the 30 `flashtree bench` prompts
    python3 -m benchmarks.llama_dflash llama BIN TARGET DRAFT DIR OUT.json [--n-max 3,7,15] [--threads N]
    python3 -m benchmarks.llama_dflash merge LLAMA.json FLASHTREE_DIR... OUT.json

`prompts` renders each prompt through the target's chat template as `flashtree bench` does (REPORT_N per
set at REPORT_SEED) and keeps its text (DIR/NN.txt) and flashtree's token ids. `llama` checks that
llama-tokenize gives the same ids, then times llama.cpp greedy AR (llama-completion: its eval rate) and
llama-speculative-simple --spec-type draft-dflash with the draft at each --spec-draft-n-max (decode rate,
tokens per target step = generated / (generated - accepted), acceptance = accepted / drafted), and
llama-bench tg256 (--threads N: -t N and the draft's -td N everywhere, for a CPU build; default: its own).
`merge` puts those and `flashtree bench` results (results.json) into one JSON.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

MAX_TOKENS = 256
CTX = ["-c", "4096", "-ngl", "99", "--seed", "0"]
SPEC = re.compile(
    r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds"
    r".*?n_predict = (\d+).*?n_drafted = (\d+).*?n_accept\s+= (\d+)",
    re.S,
)
EVAL = re.compile(r"\s eval time =\s+([\d.]+) ms /\s+(\d+) runs")
THREADS: list[str] = []  # ["-t", N] from `llama --threads N`
BENCH_TG = re.compile(r"\|\s+tg\d+\s+\|\s+([\d.]+) ± ([\d.]+)")


def prompts(target: str, out: str) -> None:
    from flashtree.bench.datasets import DATASETS, REPORT_N, REPORT_SEED, load_prompts
    from flashtree.gguf.reader import open_gguf
    from flashtree.gguf.tokenizer import Tokenizer

    with open_gguf(target) as g:
        tok = Tokenizer.from_gguf_metadata(g.metadata)
    rows = []
    for name in DATASETS:
        for p in load_prompts(name, REPORT_N, REPORT_SEED):
            chat = tok.render_chat([{"role": "user", "content": p.text}])
            if chat.hidden:  # control-token text in the prompt: llama.cpp would read it as control tokens
                raise SystemExit(f"{p.id}: its text holds control-token text, not comparable")
            path = Path(out) / f"{len(rows):02d}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(chat.text.encode())
            rows.append({"dataset": name, "id": p.id, "file": path.name, "ids": tok.encode_chat_text(chat)})
    (Path(out) / "prompts.json").write_text(json.dumps(rows))
    print(f"{len(rows)} prompts in {out}")


def _run(cmd: list[str], log) -> str:
    t0 = time.perf_counter()
    res = subprocess.run(
        cmd, capture_output=True, text=True, errors="replace", timeout=300, stdin=subprocess.DEVNULL
    )
    text = res.stdout + res.stderr
    log.write(f"$ {' '.join(cmd)}  (rc {res.returncode}, {time.perf_counter() - t0:.1f} s)\n{text[-3000:]}\n")
    if res.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed (rc {res.returncode}): {text[-500:]}")
    return text


def _tokens_match(bin: Path, target: str, rows: list[dict], pdir: Path, log) -> list[str]:
    """Prompt ids where llama-tokenize differs from flashtree (none expected)."""
    bad = []
    for r in rows:
        out = _run([str(bin / "llama-tokenize"), "-m", target, "-f", str(pdir / r["file"]), "--ids",
                    "--no-escape", "--log-disable"], log)  # fmt: skip
        ids = json.loads(out[out.rindex("[") : out.rindex("]") + 1])
        if ids != r["ids"]:
            bad.append(r["id"])
    return bad


def _prompt_args(row: dict, pdir: Path) -> list[str]:
    """The prompt's bytes as they are (-bf: no trailing-newline strip, --no-escape), greedy, MAX_TOKENS."""
    prompt = ["-bf", str(pdir / row["file"]), "--no-escape"]
    return [*prompt, "-n", str(MAX_TOKENS), "--temp", "0", "--top-k", "1", *CTX, *THREADS]


def _ar(bin: Path, target: str, row: dict, pdir: Path, log) -> dict:
    cmd = [
        str(bin / "llama-completion"),
        "-m",
        target,
        *_prompt_args(row, pdir),
        "-no-cnv",
        "--no-display-prompt",
    ]
    ms, runs = EVAL.findall(_run(cmd, log))[-1]  # the decode calls after the prompt's: one a token
    return {"tokens": int(runs), "seconds": float(ms) / 1e3}


def _dflash(bin: Path, target: str, draft: str, n_max: int, row: dict, pdir: Path, log) -> dict:
    spec = ["-md", draft, "--spec-type", "draft-dflash", "--spec-draft-n-max", str(n_max), "-ngld", "99"]
    spec += ["-td", THREADS[1]] if THREADS else []
    cmd = [str(bin / "llama-speculative-simple"), "-m", target, *spec, *_prompt_args(row, pdir)]
    n, seconds, n_predict, drafted, accepted = SPEC.search(_run(cmd, log)).groups()
    steps = int(n_predict) - int(accepted)  # a step commits its accepted tokens and one of the target's
    return {"tokens": int(n), "seconds": float(seconds), "steps": steps, "drafted": int(drafted),
            "accepted": int(accepted)}  # fmt: skip


def _summary(runs: list[dict]) -> dict:
    """Rates over the runs together: tok/s, tokens per target step, draft acceptance."""
    total = {k: sum(r.get(k, 0) for r in runs) for k in ("tokens", "seconds", "steps", "drafted", "accepted")}
    out = {"n_prompts": len(runs), "tokens": total["tokens"], "tok_s": total["tokens"] / total["seconds"]}
    if total["steps"]:
        out |= {"tokens_per_step": (total["accepted"] + total["steps"]) / total["steps"],
                "acceptance": total["accepted"] / max(total["drafted"], 1)}  # fmt: skip
    return out


def _by_set(rows: list[dict], runs: list[dict]) -> dict:
    sets = {r["dataset"] for r in rows}
    return {"all": _summary(runs)} | {
        s: _summary([run for r, run in zip(rows, runs, strict=True) if r["dataset"] == s])
        for s in sorted(sets)
    }


def llama(
    bin: str, target: str, draft: str, pdir: str, out: str, n_max: str = "3,7,15", threads: str | None = None
) -> None:
    """Every llama.cpp measurement; OUT is written again after each, so a cut-short run keeps the rest."""
    bin_dir, pdir_ = Path(bin), Path(pdir)
    rows = json.loads((pdir_ / "prompts.json").read_text())
    THREADS[:] = ["-t", threads] if threads else []
    result: dict = {"max_tokens": MAX_TOKENS, "n_max": [int(n) for n in n_max.split(",")], "threads": threads}

    def keep(name: str, value) -> None:
        result[name] = value
        Path(out).write_text(json.dumps(result, indent=1))
        print(name, json.dumps(value["all"] if isinstance(value, dict) else value), flush=True)

    with open(Path(out).with_suffix(".log"), "w") as log:
        keep("tokenizer_mismatches", _tokens_match(bin_dir, target, rows, pdir_, log))
        tg = ["-p", "0", "-n", str(MAX_TOKENS), "-ngl", "99", *THREADS]
        bench = _run([str(bin_dir / "llama-bench"), "-m", target, *tg], log)
        keep("llama_bench_tg", [float(m) for m, _ in BENCH_TG.findall(bench)])
        keep("ar", _by_set(rows, [_ar(bin_dir, target, r, pdir_, log) for r in rows]))
        for n in result["n_max"]:
            runs = [_dflash(bin_dir, target, draft, n, r, pdir_, log) for r in rows]
            keep(f"dflash_n_max_{n}", _by_set(rows, runs))


def _flashtree_summary(results: dict) -> dict:
    """Each mode's rates over all prompts of a `flashtree bench` results.json (its rows)."""
    modes: dict[str, dict] = {}
    for row in results["rows"]:
        m = modes.setdefault(
            row["mode"], {"tokens": 0, "after_first": 0, "seconds": 0.0, "steps": 0, "identical": True}
        )
        m["tokens"] += row["n_generated"]
        m["after_first"] += row["n_generated"] - 1  # the first token comes from the prefill, not a step
        m["seconds"] += row["decode_s"]
        m["steps"] += row["steps"]
        m["identical"] &= row.get("identical_to_ar") is not False
    block = results["options"].get("block_size")
    return {
        f"{mode}{'' if block is None or mode in ('ar', 'plain') else f'_block_{block}'}": {
            "tok_s": m["after_first"] / m["seconds"],
            "tokens_per_step": m["after_first"] / max(m["steps"], 1),
            "tokens": m["tokens"],
            "identical_to_ar": m["identical"],
        }  # fmt: skip
        for mode, m in modes.items()
    }


def merge(llama_json: str, *rest: str) -> None:
    *dirs, out = rest
    merged = {"llama_cpp": json.loads(Path(llama_json).read_text()), "flashtree": {}, "flashtree_runs": []}
    for d in dirs:
        results = json.loads((Path(d) / "results.json").read_text())
        merged["flashtree"] |= _flashtree_summary(results)
        merged["flashtree_runs"].append({k: results[k] for k in ("command", "git", "device", "ceilings")})
    Path(out).write_text(json.dumps(merged, indent=1))
    llama_all = {k: v["all"] for k, v in merged["llama_cpp"].items() if isinstance(v, dict)}
    print(json.dumps({"llama_cpp": llama_all, "flashtree": merged["flashtree"]}, indent=1))


if __name__ == "__main__":
    commands = {"prompts": prompts, "llama": llama, "merge": merge}
    command, *args = sys.argv[1:]
    options = {}
    while len(args) >= 2 and args[-2] in ("--n-max", "--threads"):
        options[args[-2][2:].replace("-", "_")] = args[-1]
        args = args[:-2]
    commands[command](*args, **options)
