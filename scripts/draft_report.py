"""Turn what scripts/train_draft_gpu.sh brought back into the committed draft and its report.

    python scripts/draft_report.py RESULTS_DIR [--commit SHA]

RESULTS_DIR holds the run's $OUT: config.json, model.safetensors.part.*, train_log.jsonl,
train_config.json, train.log, eval.json. Writes flashtree/drafts/smollm2-135m-instruct/ and
bench/results/draft-training/{report.json, training_curve.png} (README.md is written by hand).
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
DRAFT_DIR = ROOT / "flashtree" / "drafts" / "smollm2-135m-instruct"
REPORT_DIR = ROOT / "bench" / "results" / "draft-training"


def install_draft(results: Path) -> None:
    DRAFT_DIR.mkdir(parents=True, exist_ok=True)
    shutil.copy(results / "config.json", DRAFT_DIR / "config.json")
    with open(DRAFT_DIR / "model.safetensors", "wb") as out:
        for part in sorted(results.glob("model.safetensors.part.*")):
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


def plot_curve(rows: list[dict], path: Path) -> None:
    steps = [r["step"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax1.plot(steps, [r["loss"] for r in rows])
    ax1.set_xlabel("step")
    ax1.set_ylabel("weighted CE loss")
    ax1.set_title("loss")
    ax2.plot(steps, [r["accept_len"] for r in rows], color="tab:green")
    ax2.set_xlabel("step")
    ax2.set_ylabel("accept length (teacher-forced blocks)")
    ax2.set_title("per-block accept length on training batches")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("results", type=Path)
    p.add_argument("--commit", default=None, help="The git commit the GPU run used.")
    a = p.parse_args()
    install_draft(a.results)
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(x) for x in (a.results / "train_log.jsonl").read_text().splitlines() if x.strip()]
    plot_curve(rows, REPORT_DIR / "training_curve.png")
    evaluation = json.loads((a.results / "eval.json").read_text())
    train_log = (a.results / "train.log").read_text()
    report = {
        "command": "scripts/train_draft_gpu.sh full (on one H200), then scripts/draft_report.py",
        "commit": a.commit,
        "device": next((line for line in train_log.splitlines() if line.startswith("GPU 0")), None),
        "draft": json.loads((a.results / "config.json").read_text()),
        "draft_bytes": (DRAFT_DIR / "model.safetensors").stat().st_size,
        "train_config": json.loads((a.results / "train_config.json").read_text()),
        "data": data_stats(train_log),
        "training": {"final": rows[-1], "first": rows[0], "log_rows": len(rows)},
        "evaluation": {
            "settings": "greedy, chat template, block 16, 256 new tokens, tree budget 22, 10 prompts per set "
            "(flashtree.bench.datasets.load_prompts seed 0), dense bf16 target weights",
            **evaluation,
        },
    }
    (REPORT_DIR / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(evaluation["summary"], indent=1))


if __name__ == "__main__":
    main()
