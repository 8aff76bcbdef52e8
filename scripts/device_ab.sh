#!/usr/bin/env bash
# One device call: the GPU tests at HEAD, then the 27B step (bench-step, packed weights) at HEAD and at a
# base commit side by side, in the arithmetics ARITHS (default "int8 bf16"), results under $OUT. Both
# sides run from `git archive` copies (.stage/head, .stage/base), not from the working tree.
# Prepare here:  bash scripts/gpu_wheels.sh
#                for s in head:HEAD base:BASE; do mkdir -p .stage/${s%%:*}; git archive ${s#*:} flashtree \
#                  tests pyproject.toml | tar -x -C .stage/${s%%:*}; rm -rf .stage/${s%%:*}/flashtree/drafts; done
# Run (device):  run(command="BASE=<sha> HEAD_SHA=<sha> bash scripts/device_ab.sh",
#                    carry=[".wheels/issue6", ".cache/issue6", ".stage/base", ".stage/head"])
set -u
pip install -q --no-index --no-deps --target /tmp/site .wheels/issue6/*.whl
export FLASHTREE_CACHE=$PWD/.cache/issue6 TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
here=/tmp/site:$PWD/.stage/head
base=/tmp/site:$PWD/.stage/base
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/device.txt"
(PYTHONPATH=$here python3 -m flashtree synth --shape qwen3.6-27b --type q4_k_m /tmp/q27.gguf \
  && PYTHONPATH=$here python3 -m flashtree synth --draft-for /tmp/q27.gguf --layers 5 /tmp/d5_head \
  && PYTHONPATH=$base python3 -m flashtree synth --draft-for /tmp/q27.gguf --layers 5 /tmp/d5_base) \
  > "$OUT/synth.log" 2>&1 &
if [ "${TESTS_S:-200}" != 0 ]; then  # TESTS_S=0: no GPU tests this call
  (cd .stage/head && PYTHONPATH=$here timeout "${TESTS_S:-200}" python3 -m pytest -q -m gpu tests/gpu \
    -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1)
  echo "gpu tests rc=$?" >> "$OUT/gpu_tests.log"
fi
wait
for arith in ${ARITHS:-int8 bf16}; do
  for side in head base; do
    path=$here; commit=${HEAD_SHA:-head}
    if [ "$side" = base ]; then path=$base; commit=${BASE:-base}; fi
    FLASHTREE_QMM_ARITH=$arith FLASHTREE_GIT_COMMIT=$commit PYTHONPATH=$path python3 -m flashtree bench-step \
      --target /tmp/q27.gguf --draft /tmp/d5_$side --weights packed --repeats "${REPEATS:-10}" \
      --out "$OUT/step_${side}_${arith}.json" > "$OUT/step_${side}_${arith}.log" 2>&1
  done
done
