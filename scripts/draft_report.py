"""Turn what scripts/train_draft_gpu.sh brought back into the committed draft and its reports.

    python scripts/draft_report.py RESULTS_DIR --commit SHA --bench-dir bench/results/NAME --command TEXT
        [--not-shipped RUN]

RESULTS_DIR holds the run's $OUT: draft-q8_0.gguf.part.* and results.tar.gz unpacked (log,
run/{config,train_config}.json, run/train_log.jsonl, run/val_log.jsonl where the run held sequences out,
bench/). Writes the shipped draft
(flashtree/drafts/smollm2-135m-instruct.gguf), bench/results/draft-training/{report.json,
training_curve.png} (README.md is written by hand) and copies the `flashtree bench` run of the new
draft to --bench-dir. With --not-shipped RUN (a run whose draft did not beat the shipped one), the
shipped draft stays and the reports are report-RUN.json and training_curve-RUN.png.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DRAFT = ROOT / "flashtree" / "drafts" / "smollm2-135m-instruct.gguf"
REPORT_DIR = ROOT / "bench" / "results" / "draft-training"


def draft_parts(results: Path) -> list[Path]:
    return sorted(results.glob("draft-q8_0.gguf.part.*"))


def install_draft(results: Path) -> None:
    with open(DRAFT, "wb") as out:
        for part in draft_parts(results):
            out.write(part.read_bytes())


def data_stats(train_log: str) -> dict:
    """Counts from the `data:` and `responses:` lines of train.log."""
    seqs = re.search(r"data: (\d+) sequences, (\d+) response tokens", train_log)
    shards = re.findall(r"responses: shard \d+ \((\w+)\) (\d+) seqs, (\d+) tokens in ([\d.]+)s", train_log)
    return {
        "sequences": int(seqs.group(1)) if seqs else None,
        "response_tokens": int(seqs.group(2)) if seqs else None,
        "shards": len(shards),
        "greedy_shards": sum(s[0] == "greedy" for s in shards),
        "generation_s": round(sum(float(s[3]) for s in shards), 1),
        "generated_tokens": sum(int(s[2]) for s in shards),
    }


def plot_curve(rows: list[dict], val: list[dict], path: Path) -> None:
    steps = [r["step"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax1.plot(steps, [r["loss"] for r in rows])
    ax1.set_xlabel("step")
    ax1.set_ylabel("weighted CE loss")
    ax1.set_title("loss")
    ax2.plot(
        steps, [r["accept_len"] for r in rows], color="tab:green", label="training blocks (every anchor)"
    )
    for key, label in (
        ("val_chain_al", "held out, chain (replayed)"),
        ("val_tree_al", "held out, tree (replayed)"),
        ("dev_chain_al", "benchmark dev prompts, chain (replayed)"),
        ("dev_tree_al", "benchmark dev prompts, tree (replayed)"),
    ):
        logged = [r for r in val if key in r]
        if logged:
            ax2.plot([r["step"] for r in logged], [r[key] for r in logged], marker="o", label=label)
    ax2.set_xlabel("step")
    ax2.set_ylabel("accept length")
    ax2.set_title("accept length")
    ax2.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def acceptance(bench: dict) -> dict:
    """Mean AL per dataset and overall, chain and tree, from `flashtree bench`'s results.json."""
    return {
        dataset: {mode: round(rows[mode]["mean_accept_len"], 3) for mode in ("chain", "tree")}
        for dataset, rows in bench["summary"].items()
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("results", type=Path)
    p.add_argument("--commit", required=True, help="The git commit the GPU run used.")
    p.add_argument("--bench-dir", type=Path, required=True, help="Where the bench run is committed.")
    p.add_argument("--command", required=True, help="The GPU calls that ran, e.g. 'launch, then wait'.")
    p.add_argument("--not-shipped", metavar="RUN", help="Keep the shipped draft; name this run's reports.")
    a = p.parse_args()
    suffix = f"-{a.not_shipped}" if a.not_shipped else ""
    if not a.not_shipped:
        install_draft(a.results)
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    run = a.results / "run"
    rows, val = (
        [json.loads(x) for x in (run / name).read_text().splitlines() if x.strip()]
        if (run / name).exists()
        else []
        for name in ("train_log.jsonl", "val_log.jsonl")
    )
    plot_curve(rows, val, REPORT_DIR / f"training_curve{suffix}.png")
    shutil.copytree(a.results / "bench", a.bench_dir, dirs_exist_ok=True)
    bench = json.loads((a.results / "bench" / "results.json").read_text())
    bench["git"]["commit"] = a.commit  # the pipeline ran from a copy without .git
    (a.bench_dir / "results.json").write_text(json.dumps(bench, indent=1) + "\n")
    md = a.bench_dir / "results.md"
    md.write_text(md.read_text().replace("- commit: unknown", f"- commit: {a.commit}"))
    log = (a.results / "log").read_text()
    report = {
        "command": f"{a.command}, then scripts/draft_report.py",
        "commit": a.commit,
        "device": next((line for line in log.splitlines() if line.startswith("GPU 0")), None),
        "draft": json.loads((run / "config.json").read_text()),
        "draft_bytes": sum(part.stat().st_size for part in draft_parts(a.results)),
        "shipped": not a.not_shipped,
        "train_config": json.loads((run / "train_config.json").read_text()),
        "data": data_stats(log),
        "training": {"final": rows[-1], "first": rows[0], "log_rows": len(rows), "validation": val},
        "evaluation": {
            "settings": bench["options"],
            "source": str(a.bench_dir.relative_to(ROOT) if a.bench_dir.is_absolute() else a.bench_dir),
            "mean_accept_len": acceptance(bench),
        },
    }
    (REPORT_DIR / f"report{suffix}.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["evaluation"]["mean_accept_len"], indent=1))


if __name__ == "__main__":
    main()
