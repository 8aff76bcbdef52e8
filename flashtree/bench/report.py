"""Summaries, the markdown table and the plots of a `flashtree bench` run.

Rates follow the peer's methodology (prior-art-luce.md §8): tok/s is decode-only (tokens after the
first, over the time after the first), averaged over prompts; speedup is the ratio of those means;
AL (acceptance length) is tokens emitted per decode step, bonus included, averaged over prompts.
End-to-end rates (all generated tokens over prefill + decode) and TTFT (the prefill) are reported
beside them.
"""

from __future__ import annotations

from pathlib import Path
from statistics import fmean

from matplotlib.figure import Figure

LABELS = {"ar": "AR", "chain": "chain", "tree": "tree", "hf": "HF", "plain": "plain AR"}
SPEC_MODES = ("chain", "tree")
OVERALL = "overall"


def summarize_group(rows: list[dict], ar: dict | None) -> dict:
    """Means over the prompts of one (dataset, mode); speedups against the AR summary `ar`."""
    checked = [r["identical_to_ar"] for r in rows if r["identical_to_ar"] is not None]
    summary = {
        "n_prompts": len(rows),
        "n_generated": sum(r["n_generated"] for r in rows),
        "decode_tok_s": fmean(r["decode_tok_s"] for r in rows),
        "e2e_tok_s": fmean(r["e2e_tok_s"] for r in rows),
        "ttft_s": fmean(r["ttft_s"] for r in rows),
        "prefill_tok_s": fmean(r["prefill_tok_s"] for r in rows),
        "mean_accept_len": fmean(r["mean_accept_len"] for r in rows),
        "identical_to_ar": all(checked) if checked else None,
    }
    if ar is not None:
        summary["speedup"] = _ratio(summary["decode_tok_s"], ar["decode_tok_s"])
        summary["e2e_speedup"] = _ratio(summary["e2e_tok_s"], ar["e2e_tok_s"])
    return summary


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def summarize(rows: list[dict], modes: list[str]) -> dict:
    """{dataset or "overall": {mode: summary}}, datasets in the order of their first row."""
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    groups = {ds: [r for r in rows if r["dataset"] == ds] for ds in datasets} | {OVERALL: rows}
    result = {}
    for name, group in groups.items():
        by_mode = {m: [r for r in group if r["mode"] == m] for m in modes}
        ar = summarize_group(by_mode["ar"], None) if by_mode.get("ar") else None
        result[name] = {m: summarize_group(mode_rows, ar) for m, mode_rows in by_mode.items() if mode_rows}
        plain = result[name].get("plain")
        if plain:  # speculative modes against plain decoding's AR too (another arithmetic; see bench/run.py)
            for m in SPEC_MODES:
                if m in result[name]:
                    s = result[name][m]
                    s["speedup_vs_plain"] = _ratio(s["decode_tok_s"], plain["decode_tok_s"])
    return result


def accept_histogram(rows: list[dict], mode: str) -> list[int]:
    """Decode steps by tokens emitted, summed over every prompt of `mode`."""
    hists = [r["accept_hist"] for r in rows if r["mode"] == mode]
    total = [0] * max((len(h) for h in hists), default=0)
    for h in hists:
        for n, count in enumerate(h):
            total[n] += count
    return total


# --- markdown -----------------------------------------------------------------------------------------


def _fmt(x: float | None, digits: int = 1, suffix: str = "") -> str:
    return "–" if x is None else f"{x:.{digits}f}{suffix}"


def _table(header: list[str], lines: list[list[str]]) -> str:
    rows = [header, ["---"] * len(header), *lines]
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def peer_table(summary: dict, modes: list[str]) -> str:
    """Per benchmark: AR tok/s, then tok/s, AL and speedup of each speculative mode, then peers."""
    header = ["Task", "AR tok/s"]
    spec = [m for m in modes if m in SPEC_MODES]
    vs_plain = "plain" in modes
    for m in spec:
        header += [f"{m} tok/s", f"{m} AL", f"{m} speedup"] + ([f"{m} / plain AR"] if vs_plain else [])
    peers = [m for m in modes if m not in SPEC_MODES and m != "ar"]
    header += [f"{LABELS[m]} tok/s" for m in peers]
    lines = []
    for task, by_mode in summary.items():
        line = [task, _fmt(by_mode.get("ar", {}).get("decode_tok_s"))]
        for m in spec:
            s = by_mode[m]
            line += [_fmt(s["decode_tok_s"]), _fmt(s["mean_accept_len"], 2), _fmt(s.get("speedup"), 2, "×")]
            if vs_plain:
                line.append(_fmt(s.get("speedup_vs_plain"), 2, "×"))
        line += [_fmt(by_mode.get(m, {}).get("decode_tok_s")) for m in peers]
        lines.append(line)
    return _table(header, lines)


def rates_table(overall: dict, weight_read_tok_s: float | None) -> str:
    """Every rate of every mode over all prompts."""
    header = ["mode", "decode tok/s", "end-to-end tok/s", "TTFT ms", "prefill tok/s", "AL",
              "speedup", "e2e speedup", "identical to AR"]  # fmt: skip
    if weight_read_tok_s:
        header.append("decode / weight-read bound")
    lines = []
    for mode, s in overall.items():
        identical = {True: "yes", False: "**NO**", None: "–"}[s["identical_to_ar"]]
        line = [
            LABELS[mode],
            _fmt(s["decode_tok_s"]),
            _fmt(s["e2e_tok_s"]),
            _fmt(s["ttft_s"] * 1e3),
            _fmt(s["prefill_tok_s"]),
            _fmt(s["mean_accept_len"], 2),
            _fmt(s.get("speedup"), 2, "×"),
            _fmt(s.get("e2e_speedup"), 2, "×"),
            identical,
        ]
        if weight_read_tok_s:
            line.append(_fmt(100 * s["decode_tok_s"] / weight_read_tok_s, 1, "%"))
        lines.append(line)
    return _table(header, lines)


def markdown(results: dict) -> str:
    o, c, t, git = results["options"], results["ceilings"], results["target"], results["git"]
    d = results["draft"]
    draft = f"DFlash, {d['n_layers']} layers, block {d['block_size']}" if d else "none"
    lines = [
        "# flashtree bench",
        "",
        f"- command: `{results['command']}`",
        f"- commit: {git['commit'] or 'unknown'}{' (uncommitted changes)' if git['dirty'] else ''}",
        f"- device: {results['device']['name']}; torch {results['versions']['torch']}, "
        f"triton {results['versions']['triton'] or '–'}",
        f"- target: {t['name']} ({t['arch']}; {t['weight_bytes'] / 1e6:.1f} MB of weights"
        f"{', ' + t['weights'] if 'weights' in t else ''}, computing in {t['dtype']})",
        f"- draft: {draft}",
        f"- prompts: {o['n']} per dataset (seed {o['seed']}), "
        f"{'raw' if o['raw'] else 'chat template'}, greedy, up to {o['max_tokens']} new tokens; "
        f"tree budget {o['budget']}",
        f"- ceilings measured in this run: copy {c['copy_gb_s']:.1f} GB/s, {c['matmul_dtype']} matmul "
        f"{c['matmul_tflops']:.2f} TFLOP/s; reading the weights once per token bounds AR at "
        f"{results['weight_read_tok_s']:.1f} tok/s",
        "",
        "tok/s is decode-only, averaged over prompts; speedup is over AR; AL is tokens per decode step."
        + (
            " AR runs in the speculative engine's kernels (what chain/tree reproduce bit for bit);"
            " plain AR in plain decoding's (`flashtree run --mode ar`), possibly faster."
            if "plain" in results["modes"]
            else ""
        ),
        "",
        peer_table(results["summary"], results["modes"]),
        "",
        "## All rates, over all prompts",
        "",
        rates_table(results["summary"][OVERALL], results["weight_read_tok_s"]),
    ]
    if results["mismatches"]:
        lines += ["", "## Outputs that differ from AR (a correctness bug)", ""]
        lines += ["The logit gap is how far AR's token led the other one there (near 0: a near-tie that "
                  "rounding flipped; large: a bug).", ""]  # fmt: skip
        lines += [f"- {m['dataset']} {m['prompt_id']} {m['mode']}: first differs at token {m['at']}, "
                  f"logit gap {_fmt(m['logit_gap'], 3)}" for m in results["mismatches"]]  # fmt: skip
    return "\n".join(lines) + "\n"


# --- plots --------------------------------------------------------------------------------------------


def plot_rates(summary: dict, modes: list[str], path: Path) -> None:
    """Grouped bars: decode tok/s per dataset (and overall), one bar per mode."""
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    tasks = list(summary)
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        values = [summary[t].get(mode, {}).get("decode_tok_s", 0.0) for t in tasks]
        xs = [x + (i - (len(modes) - 1) / 2) * width for x in range(len(tasks))]
        bars = ax.bar(xs, values, width, label=LABELS[mode])
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(tasks)), tasks)
    ax.set_ylabel("decode tok/s")
    ax.set_title("Decode throughput by dataset and mode")
    ax.legend()
    fig.savefig(path, dpi=120)


def plot_acceptance(rows: list[dict], modes: list[str], path: Path) -> None:
    """Share of decode steps by tokens emitted per step, one bar series per speculative mode."""
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    spec = [m for m in modes if m in SPEC_MODES]
    longest = 1
    for i, mode in enumerate(spec):
        hist = accept_histogram(rows, mode)[1:]  # hist[n - 1]: steps that emitted n >= 1 tokens
        longest = max(longest, len(hist))
        steps = sum(hist) or 1
        width = 0.8 / len(spec)
        xs = [n + 1 + (i - (len(spec) - 1) / 2) * width for n in range(len(hist))]
        ax.bar(xs, [c / steps for c in hist], width, label=mode)
    ax.set_xticks(range(1, longest + 1))
    ax.set_xlabel("tokens emitted per decode step (accepted + bonus)")
    ax.set_ylabel("share of steps")
    ax.set_title("Acceptance length histogram")
    if spec:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no speculative mode in this run", ha="center", transform=ax.transAxes)
    fig.savefig(path, dpi=120)


def write_report(results: dict, out: Path) -> list[Path]:
    """results.md, tok_s.png and accept_hist.png in `out`; returns their paths."""
    md, rates, accept = out / "results.md", out / "tok_s.png", out / "accept_hist.png"
    md.write_text(markdown(results), encoding="utf-8")
    plot_rates(results["summary"], results["modes"], rates)
    plot_acceptance(results["rows"], results["modes"], accept)
    return [md, rates, accept]
