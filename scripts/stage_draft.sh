#!/usr/bin/env bash
# Build .stage/draft/ (git-ignored), everything scripts/train_draft_gpu.sh carries to the GPU machine:
#   whl/                   the gguf wheel for the GPU machine's Python 3.12 (it has no gguf);
#   prompts.jsonl.gz       the training prompt mix (flashtree.train.prompts.build_prompts, seed 0);
#   prompts-fresh.jsonl.gz a further pool disjoint from it (fresh_prompts: the Python functions it left
#                          out, other word problems, reasoning-gym problems), for runs after the pool's
#                          greedy responses were used (the fourth run's);
#   prompts-fresh2.jsonl.gz a third pool, disjoint from both (the eighth run used their greedy responses):
#                          its code from the Python files of the wheels under WHEEL_DIRS (default: this
#                          machine's wheel mirrors, /opt/pypi /opt/pypi-more /opt/wheels; extracted once
#                          to .stage/wheel-src), no function named like a HumanEval problem;
#   prompts-fresh3.jsonl.gz a fourth pool, the same way, disjoint from all three (the tenth run used the
#                          third's greedy responses);
#   prompts-fresh4.jsonl.gz a fifth, disjoint from all four (the eleventh run used the fourth's);
#   smoke_prompts.jsonl.gz its first 32 records, for the smoke run;
#   cache/datasets/        the benchmark prompts (HumanEval, GSM8K, MATH-500), without their wheels;
#   tiny.gguf              a tiny random llama target for the smoke run;
#   smollm2.part.aa/ab     the default target GGUF in pieces of PART_SIZE (default 47M: two; 64 MiB per
#                          device call).
# and for `python -m benchmarks` and tests/gpu: .wheels/issue6/ (the same wheel) and .cache/issue6/wheels/
# (the Qwen3 tokenizer's wheel, what `flashtree synth` needs for qwen-family shapes, tiny ones included),
# by scripts/gpu_wheels.sh.
# KEEP: a prompt pool already in .stage/draft/ is kept as it is, never rebuilt: a run may have trained on
# it, and a rebuild is not the same pool (the code roots are this machine's installed packages, which
# change; in session 16 a rebuilt third pool shared only 31k of its 64k prompts with the one the tenth run
# used), so every later pool is made disjoint from the files as they are.
# Needs PyPI (here, never on the GPU machine). Run from the repository root in the project's venv.
set -euo pipefail
S=.stage/draft
mkdir -p $S/whl $S/cache
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
  -d $S/whl 'gguf>=0.19'
python - <<'EOF'
from pathlib import Path
from flashtree.train.prompts import build_prompts, write_prompts
from flashtree.train.trainer import default_code_roots
if not Path(".stage/draft/prompts.jsonl.gz").exists():  # see KEEP below
    records = build_prompts(default_code_roots(), seed=0)
    write_prompts(records, Path(".stage/draft/prompts.jsonl.gz"))
    write_prompts(records[:32], Path(".stage/draft/smoke_prompts.jsonl.gz"))
    print(len(records), "prompts")
EOF
pip install -q 'reasoning-gym>=0.1.25'  # the train-data extra
python - <<'EOF'
from collections import Counter
from pathlib import Path
from flashtree.train.prompts import fresh_prompts, read_prompts, write_prompts
from flashtree.train.trainer import default_code_roots
if not Path(".stage/draft/prompts-fresh.jsonl.gz").exists():
    used = read_prompts(Path(".stage/draft/prompts.jsonl.gz"))
    records = fresh_prompts(default_code_roots(), used, seed=1)
    write_prompts(records, Path(".stage/draft/prompts-fresh.jsonl.gz"))
    print(len(records), "fresh prompts", dict(Counter(r["source"] for r in records)))
EOF
WHEEL_DIRS="${WHEEL_DIRS:-/opt/pypi /opt/pypi-more /opt/wheels}" python - <<'EOF'
import os
from collections import Counter
from pathlib import Path
from flashtree.train.prompts import fresh_prompts, humaneval_names, read_prompts, wheel_sources, write_prompts
from flashtree.train.trainer import default_code_roots
wheels = [w for d in os.environ["WHEEL_DIRS"].split() for w in Path(d).rglob("*.whl")]
code = wheel_sources(wheels, Path(".stage/wheel-src"))
used = [r for pool in ("prompts", "prompts-fresh") for r in read_prompts(Path(f".stage/draft/{pool}.jsonl.gz"))]
# each pool disjoint from all before it; reasoning-gym items seed + i: gym seeds a million apart
for pool, seed in (("prompts-fresh2", 2), ("prompts-fresh3", 3), ("prompts-fresh4", 4)):
    path = Path(f".stage/draft/{pool}.jsonl.gz")
    if not path.exists():
        records = fresh_prompts(
            [*default_code_roots(), code], used, seed=seed, n_functions=40000, n_per_gym_task=800,
            gym_seed=(seed - 1) * 10**6, exclude_names=humaneval_names(),
        )
        write_prompts(records, path)
        print(pool, len(records), "prompts from", len(wheels), "wheels", dict(Counter(r["source"] for r in records)))
    used += read_prompts(path)
EOF
FLASHTREE_CACHE=$S/cache python - <<'EOF'
from flashtree.bench.datasets import DATASETS, read_records
for name in DATASETS:
    print(name, len(read_records(name)), "records")
EOF
rm -rf $S/cache/wheels
bash scripts/gpu_wheels.sh
[ -f $S/tiny.gguf ] || python -m flashtree synth --shape tiny-llama $S/tiny.gguf
gguf=$(python -c "from flashtree.defaults import default_target_path; print(default_target_path())")
rm -f $S/smollm2.part.* && split -b "${PART_SIZE:-47M}" "$gguf" $S/smollm2.part.
ls -la $S $S/whl
